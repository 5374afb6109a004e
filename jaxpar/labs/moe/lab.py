"""Lab 07 (course module 4): sparse Mixture-of-Experts, expert parallelism, load balancing.

One run, six parts, every number beside its prediction (experiments/07_moe/README.md is the lab sheet):

a. equivalence    the single-device run (the oracle) against manual EP (expert=N, expert=N/2 x data=2)
                  and automatic EP, dropless and with capacity dropping, fp32, the same batches.
b. communication  all_to_all bytes per step from each compiled program against 2·T·k·h·bytes per
                  direction (dispatch + combine, forward and backward) and against jaxpar's buffers
                  (`parallel/theory.moe_all_to_all_bytes`); what XLA's partitioner chose for automatic EP.
c. balance        training without balancing, with the Switch aux loss, with the aux-free bias, with
                  noisy gating: coefficient of variation of expert load and dropped fraction over
                  steps (capacity dispatch), heatmaps layer x expert over steps.
d. capacity       capacity factor 1.0 / 1.25 / 2.0 (and dropless) under manual EP: dropped fraction,
                  all_to_all bytes, step time.
e. MoE vs dense   the MoE against a dense model with the same active FLOPs per token: loss curves at
                  equal steps.
f. layouts        MoE in the hand-written pipeline schedules, manual EP inside pipeline stages, MoE under
                  manual TP: losses and per-layer router statistics vs one device, bytes per axis vs
                  predicted (labs/moe/layouts.py, with lab 04's builder).

Every step runs in float32 from one initial state per model (made once, placed in each layout); every
program is compiled once (`lower().compile()`) and that executable is run, timed and read. Files in
the run directory: report.md, results.json, config.json and six plots.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.labs.arguments import MOE_PARTS as PARTS
from jaxpar.labs.arguments import MOE_SETTINGS as LAB_SETTINGS
from jaxpar.labs.arguments import moe as add_arguments
from jaxpar.labs.base.report import max_rel_dev, md_table
from jaxpar.labs.base.runner import Part, chosen_parts, run_directory, run_parts, standalone_main
from jaxpar.labs.moe.build import Lab
from jaxpar.labs.moe.layouts import moe_layouts
from jaxpar.labs.moe.plots import PLOTS
from jaxpar.units import fmt_bytes, ratio

TOLERANCE = 1e-4
CAPACITY_FACTORS = (1.0, 1.25, 2.0)
BALANCE_METHODS = {   # name -> overrides (on top of the capacity dispatch at factor 1.25)
    "none": ["model.moe.router=softmax", "model.moe.balance_loss=0", "model.moe.z_loss=0"],
    "aux loss": ["model.moe.router=softmax", "model.moe.balance_loss=0.01", "model.moe.z_loss=0.001"],
    "aux-free bias": ["model.moe.router=sigmoid", "model.moe.balance_loss=0", "model.moe.z_loss=0"],
    "noisy gating": ["model.moe.router=noisy", "model.moe.balance_loss=0", "model.moe.z_loss=0"],
}


def _median_ms(times) -> float:
    rest = times[1:] if len(times) > 1 else times
    return 1e3 * statistics.median(rest)


def _ep(manual: bool) -> str:
    return "parallel.expert=manual" if manual else "parallel.expert=auto"


CAPACITY = ["model.moe.dispatch=capacity", "model.moe.capacity_factor=1.0"]
DROPLESS = ["model.moe.dispatch=dropless"]


def _strategies(n: int) -> list[tuple[str, list[str], int]]:
    """(label, overrides, devices) of part a; the first of each dispatch is the oracle."""
    half = n // 2
    rows = []
    for name, dispatch in (("dropless", DROPLESS), ("capacity 1.0", CAPACITY)):
        rows += [(f"{name}: single device", dispatch, 1),
                 (f"{name}: manual EP expert={n}", [*dispatch, f"mesh.expert={n}", _ep(True)], n)]
        if name == "dropless" and half > 1:
            rows.append((f"{name}: manual EP expert={half} x data=2",
                         [*dispatch, f"mesh.expert={half}", "mesh.data=2", _ep(True)], n))
        if name == "dropless":                    # the teaching baseline: every chunk padded to the most it can hold
            rows.append((f"{name}: manual EP expert={n}, padded exchange",
                         [*dispatch, f"mesh.expert={n}", _ep(True), "parallel.expert_exchange=padded"], n))
        if name == "dropless" and n % 8 == 0:     # EP x FSDP x tensor parallelism inside each expert
            rows.append((f"{name}: manual EP expert={n // 4} x fsdp=2 x tensor=2",
                         [*dispatch, f"mesh.expert={n // 4}", "mesh.fsdp=2", "mesh.tensor=2", _ep(True)], n))
        rows.append((f"{name}: auto EP expert={n}", [*dispatch, f"mesh.expert={n}", _ep(False)], n))
    return rows


# ============================================================================ a. equivalence

def equivalence(lab: Lab, steps: int) -> dict:
    runs = {}
    for label, overrides, devices in _strategies(lab.n):
        built = lab.build(label, overrides, devices)
        r = lab.run(built, steps)
        runs[label] = {"losses": r["losses"], "step_ms": _median_ms(r["times"]), "compile_s": built.compile_s,
                       "dropped": float(np.mean([np.sum(d, axis=-1).mean() for d in r["moe_dropped"]]))}
    rows = []
    for label, r in runs.items():
        oracle = runs[label.split(":")[0] + ": single device"]
        r["max_rel_dev"] = max_rel_dev(r["losses"], oracle["losses"])
        r["within_tolerance"] = r["max_rel_dev"] <= TOLERANCE
        rows.append([label, f"{r['losses'][0]:.5f}", f"{r['losses'][-1]:.5f}", f"{r['max_rel_dev']:.2e}",
                     f"{TOLERANCE:.0e}", "yes" if r["within_tolerance"] else "**NO**", f"{r['dropped']:.3f}",
                     f"{r['step_ms']:.1f}"])
    md = "\n".join([
        f"## a. Equivalence: {steps} steps, the same batches, fp32",
        "",
        md_table(["run", "loss step 1", f"loss step {steps}", "max rel. deviation vs its single device (measured)",
                "tolerance", "within", "dropped fraction (mean)", "step ms (median)"], rows),
        "",
        "Deviation = max over steps of |loss - oracle| / oracle, each dispatch against its own single-device "
        "run (predicted: 0 up to fp32 rounding). The router runs in the global view, so every strategy routes "
        "the same tokens to the same experts; capacity groups are whole sequences of a device's batch shard "
        "(`model.moe.group_sequences`), so one device and N devices cut the batch into the same groups and "
        "drop the same assignments.",
    ])
    return {"steps": steps, "tolerance": TOLERANCE, "runs": runs, "markdown": md}


# ============================================================================ b. communication

def _by_op(found, axis_filter=None) -> dict:
    out: defaultdict[str, dict[str, float]] = defaultdict(lambda: {"instructions": 0, "runs": 0, "bytes": 0.0})
    for c in found:
        if axis_filter is None or axis_filter(c):
            out[c.op]["instructions"] += 1
            out[c.op]["runs"] += c.runs_per_step
            out[c.op]["bytes"] += c.bytes_per_step
    return dict(out)


def communication(lab: Lab) -> dict:
    from jaxpar.measure.hlo import collectives, compiled_hlo
    from jaxpar.parallel.registry import workload
    from jaxpar.parallel.theory import moe_all_to_all_bytes

    rows = {}
    for label, overrides, devices in _strategies(lab.n):
        if devices == 1:
            continue
        built = lab.build(label, overrides, devices)
        found = collectives(compiled_hlo(built.compiled), built.strategy.mesh)
        theory = moe_all_to_all_bytes(*workload(built.config, built.strategy.model_cfg, built.sizes,
                                               lab.devices[0].platform))
        on_expert = _by_op(found, lambda c: "expert" in (c.axes or ()))
        a2a = on_expert.get("all-to-all", {}).get("bytes", 0.0)
        rows[label] = {"by_op_expert_axes": on_expert, "by_op_all": _by_op(found), "all_to_all": a2a,
                       "formula": theory["formula"], "predicted": theory["predicted"] - theory["vote"],
                       "tokens_per_device": theory["tokens_per_device"], "manual": "manual" in label}
    m = lab.base.model
    table = []
    for label, r in rows.items():
        table.append([label, r["tokens_per_device"], fmt_bytes(r["all_to_all"]), fmt_bytes(r["formula"]),
                      ratio(r["all_to_all"], r["formula"]),
                      fmt_bytes(r["predicted"]) if r["manual"] else "-",
                      ratio(r["all_to_all"], r["predicted"]) if r["manual"] else "-"])
    chose = []
    for label, r in rows.items():
        if r["manual"]:
            continue
        ops = ", ".join(f"{op} x{o['runs']} = {fmt_bytes(o['bytes'])}"
                        for op, o in sorted(r["by_op_expert_axes"].items()))
        manual = rows[label.replace("auto EP", "manual EP")]
        mops = ", ".join(f"{op} x{o['runs']} = {fmt_bytes(o['bytes'])}" for op, o in
                         sorted(manual["by_op_expert_axes"].items()))
        chose.append([label.split(":")[0], ops, mops])
    md = "\n".join([
        "## b. Communication: all_to_all bytes per device per step (ring model: a device keeps 1/N)",
        "",
        f"Formula (the course's): per MoE layer 2·T·k·h·bytes forward (dispatch + combine) and the same "
        f"backward, x (N-1)/N, T = tokens per device, k = {m.moe.top_k}, h = {m.d_model}, 4 bytes (fp32). "
        "jaxpar's buffers (`parallel/theory.moe_all_to_all_bytes`): capacity [E, groups, C, h] = factor x formula; "
        "dropless by `parallel.expert_exchange` (on CPU `auto` is capacity): ceil(1.25·T·k/N) rows per "
        "destination, about 1.25 x formula, when no device overflows (the overflow round, the padded exchange, "
        "is in the program but not counted); padded: T·min(k, E/N) rows per destination = N·min(k, E/N)/k x "
        "formula; both plus the int32 expert ids (XLA:CPU has no ragged all-to-all).",
        "",
        md_table(["run", "T", "all_to_all compiled", "formula 2·T·k·h·e x2", "compiled / formula",
                "jaxpar's buffers (predicted)", "compiled / predicted"], table),
        "",
        "### What XLA's partitioner chose for automatic EP (collectives whose groups span `expert`)",
        "",
        md_table(["dispatch", "automatic EP: op x runs/step = bytes", "manual EP"], chose, "lll"),
        "",
        "Automatic EP gets the same routing and losses (part a) but not the same program: see the README "
        "for how to read these rows.",
    ])
    return {"rows": rows, "markdown": md}


# ============================================================================ c. load balance

def _cv(routed) -> np.ndarray:
    """Coefficient of variation of expert load per step and layer: std/mean over experts. [steps, layers]"""
    load = np.asarray(routed)
    return load.std(axis=-1) / load.mean(axis=-1)


def balance(lab: Lab, steps: int, bias_rate: float) -> dict:
    runs = {}
    for method, overrides in BALANCE_METHODS.items():
        extra = [f"model.moe.bias_rate={bias_rate}"] if method == "aux-free bias" else []
        built = lab.build(f"balance: {method}", ["model.moe.dispatch=capacity", "model.moe.capacity_factor=1.25",
                                                  *overrides, *extra])
        r = lab.run(built, steps, evaluate=True)
        cv = _cv(r["moe_routed"])
        dropped = np.sum(np.asarray(r["moe_dropped"]), axis=-1)       # [steps, layers]
        tail = max(1, steps // 5)
        runs[method] = {"routed": r["moe_routed"], "cv": cv.tolist(), "dropped": dropped.tolist(),
                        "ce": r["ce"], "val_loss": r["val_loss"], "step_ms": _median_ms(r["times"]),
                        "cv_start": float(cv[:10].mean()), "cv_end": float(cv[-tail:].mean()),
                        "cv_max": float(cv.mean(axis=1).max()), "dropped_end": float(dropped[-tail:].mean()),
                        "dropped_mean": float(dropped.mean()), "ce_end": float(np.mean(r["ce"][-tail:]))}
    rows = [[m, f"{r['cv_start']:.3f}", f"{r['cv_end']:.3f}", f"{r['cv_max']:.3f}", f"{r['dropped_mean']:.3f}",
             f"{r['dropped_end']:.3f}", f"{r['ce_end']:.4f}", f"{r['val_loss']:.4f}"] for m, r in runs.items()]
    md = "\n".join([
        f"## c. Load balance over {steps} training steps (capacity dispatch, factor 1.25, one device)",
        "",
        md_table(["method", "CV of load, first 10 steps", f"CV, last {max(1, steps // 5)} steps", "CV, max",
                "dropped fraction, mean", "dropped, last steps", "train CE, last steps", "val CE"], rows),
        "",
        f"CV = std/mean of the fraction of assignments each expert receives, per layer, averaged over layers "
        f"(0: perfectly balanced; {np.sqrt(lab.base.model.moe.experts - 1):.2f}: every token to one expert). "
        "Dropped = fraction of all assignments past their expert's capacity. Balancing settings: aux loss "
        "weight 0.01 (+ z-loss 0.001); aux-free bias: sigmoid router, "
        f"bias step {bias_rate} per step; noisy gating: Shazeer's learned noise, no loss. "
        "Heatmaps: balance_heatmaps.png (layer x expert load over steps).",
    ])
    return {"steps": steps, "bias_rate": bias_rate, "runs": runs, "markdown": md}


# ============================================================================ d. capacity factor

def capacity(lab: Lab, steps: int) -> dict:
    from jaxpar.measure.hlo import collectives, compiled_hlo
    from jaxpar.parallel.registry import workload
    from jaxpar.parallel.theory import moe_all_to_all_bytes

    n, rows = lab.n, {}
    settings = [(f"capacity {cf}", ["model.moe.dispatch=capacity", f"model.moe.capacity_factor={cf}"])
                for cf in CAPACITY_FACTORS] + [("dropless", DROPLESS)]
    for label, dispatch in settings:
        built = lab.build(f"manual EP expert={n}, {label}", [*dispatch, f"mesh.expert={n}", _ep(True)], n)
        r = lab.run(built, steps)
        a2a = sum(c.bytes_per_step for c in collectives(compiled_hlo(built.compiled), built.strategy.mesh)
                  if c.op == "all-to-all")
        theory = moe_all_to_all_bytes(*workload(built.config, built.strategy.model_cfg, built.sizes,
                                               lab.devices[0].platform))
        dropped = np.sum(np.asarray(r["moe_dropped"]), axis=-1).mean(axis=-1)
        rows[label] = {"dropped": dropped.tolist(), "dropped_mean": float(dropped.mean()), "all_to_all": a2a,
                       "formula": theory["formula"], "predicted": theory["predicted"] - theory["vote"],
                       "step_ms": _median_ms(r["times"]), "ce": r["ce"]}
    base = rows[f"capacity {CAPACITY_FACTORS[0]}"]["step_ms"]
    table = [[label, f"{r['dropped_mean']:.4f}", fmt_bytes(r["all_to_all"]), ratio(r["all_to_all"], r["formula"]),
              ratio(r["predicted"], r["formula"]), f"{r['step_ms']:.1f}", ratio(r["step_ms"], base)]
             for label, r in rows.items()]
    md = "\n".join([
        f"## d. Capacity factor (manual EP expert={n}, aux loss, {steps} steps)",
        "",
        md_table(["dispatch", "dropped fraction (measured)", "all_to_all / step", "/ formula (measured)",
                "/ formula (predicted)", "step ms (median)", "vs factor 1.0"], table),
        "",
        "A larger factor drops fewer tokens and sends (and computes) proportionally more padding. "
        "Timings on CPU: noisy, compare ratios within this table only.",
    ])
    return {"steps": steps, "rows": rows, "markdown": md}


# ============================================================================ e. MoE vs dense

def moe_vs_dense(lab: Lab, steps: int) -> dict:
    from jaxpar.model.counting import param_count, train_flops_per_token

    m = lab.base.model.moe
    width = (m.expert_mlp_dim or lab.base.model.mlp_dim) * (m.top_k + m.shared_experts)
    models = {"MoE": ["model.moe.dispatch=dropless"],
              f"dense (MLP {width})": ["model.moe.experts=0", f"model.mlp_dim={width}"]}
    runs = {}
    for label, overrides in models.items():
        built = lab.build(f"compare: {label}", overrides)
        r = lab.run(built, steps, keep=(), evaluate=True)
        cfg = built.strategy.model_cfg
        counts = param_count(cfg)
        runs[label] = {"ce": r["ce"], "val_loss": r["val_loss"], "step_ms": _median_ms(r["times"]),
                       "params": counts["total"], "active": counts["active"],
                       "flops_per_token": train_flops_per_token(cfg, lab.base.data.seq_len)}
    tail = max(1, steps // 10)
    dense = runs[next(k for k in runs if k != "MoE")]
    rows = [[label, f"{r['params']:,}", f"{r['active']:,}", f"{r['flops_per_token']:.4g}",
             ratio(r["flops_per_token"], dense["flops_per_token"]), f"{np.mean(r['ce'][-tail:]):.4f}",
             f"{r['val_loss']:.4f}", f"{r['step_ms']:.1f}"] for label, r in runs.items()]
    md = "\n".join([
        f"## e. MoE against a dense model of the same active FLOPs ({steps} steps, the same batches, one device)",
        "",
        md_table(["model", "params", "active params", "train FLOPs/token (6·active + attention)", "vs dense",
                f"train CE, last {tail} steps", "val CE", "step ms (median)"], rows),
        "",
        f"The dense model's MLP is as wide as the k = {m.top_k} experts a token uses, so both spend the same "
        "FLOPs per token (the MoE adds its router); the MoE holds E/k times the expert parameters. "
        "Step times are not comparable on CPU: XLA:CPU lowers `ragged_dot` to one dense matmul per expert "
        "(every row through every expert, masked), E/k times the active FLOPs. Curves: moe_vs_dense.png.",
    ])
    return {"steps": steps, "runs": runs, "markdown": md}


# ============================================================================ the whole lab


def run_lab(config, out: str | Path | None = None, *, steps: int = 5, balance_steps: int = 150,
            capacity_steps: int = 30, compare_steps: int = 150, bias_rate: float = 0.01, parts=PARTS,
            quick: bool = False, log=print) -> dict:
    """Run `parts` (default: a-f) on every local device; write the run directory; return every number.
    `quick`: part f on two of its layouts."""
    start = time.perf_counter()
    parts = chosen_parts(parts, PARTS)
    for name, value in (("--steps", steps), ("--balance-steps", balance_steps),
                        ("--capacity-steps", capacity_steps), ("--compare-steps", compare_steps)):
        if value < 2:
            raise ConfigError(name, f"is {value}; must be at least 2")
    if bias_rate <= 0:
        raise ConfigError("--bias-rate", f"is {bias_rate}; must be > 0")
    if not config.model.moe.experts:
        raise ConfigError("model.moe.experts", "the MoE lab needs an MoE model; use the default "
                          "(configs/mixtral_tiny.py) or set model.moe.experts > 0")
    devices = jax.devices()
    n = len(devices)
    if n < 2 or config.model.moe.experts % n or config.train.batch_size % n:
        raise ConfigError("--cpu-devices", f"the lab splits {config.model.moe.experts} experts and a batch of "
                          f"{config.train.batch_size} over every device, but JAX has {n}; on CPU pass "
                          "--cpu-devices 8 (a count > 1 dividing both)")
    lab = Lab(config, devices, log)
    out = run_directory(out, "moe", config, log=log)
    m = lab.base.model
    header = lab.sheet_header(
        "Lab 07: Mixture-of-Experts and expert parallelism",
        f"Model: d_model {m.d_model}, {m.layers} layers ({m.moe.dense_layers} dense), {m.moe.experts} experts of "
        f"hidden {m.moe.expert_mlp_dim or m.mlp_dim}, top-{m.moe.top_k}, {m.moe.shared_experts} shared; "
        f"vocab {lab.vocab}")
    work = {"equivalence": lambda: equivalence(lab, steps), "communication": lambda: communication(lab),
            "balance": lambda: balance(lab, balance_steps, bias_rate),
            "capacity": lambda: capacity(lab, capacity_steps), "moe_vs_dense": lambda: moe_vs_dense(lab, compare_steps),
            "layouts": lambda: moe_layouts(out / "layouts", steps, n, log, quick)}
    return run_parts("moe", out, [Part(name, work[name]) for name in parts], lab.facts(), [header],
                     PLOTS, start=start, compiles=lab.compiles, log=log)


# ============================================================================ command line

def run_from_args(args) -> int:
    """`jaxpar lab moe` and run.py: the CPU device count must already be set (before JAX started)."""
    config = load_config(args.config)
    apply_overrides(config, [*LAB_SETTINGS, *args.overrides])
    run_lab(config, args.out, steps=args.steps, balance_steps=args.balance_steps,
            capacity_steps=args.capacity_steps, compare_steps=args.compare_steps, bias_rate=args.bias_rate,
            parts=args.parts, quick=args.quick)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/07_moe/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

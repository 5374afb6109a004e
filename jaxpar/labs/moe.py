"""Lab 04 (course module 4): sparse Mixture-of-Experts, expert parallelism, load balancing.

One run, five parts, every number beside its prediction (experiments/04_moe/README.md is the lab sheet):

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

Every step runs in float32 from one initial state per model (made once, placed in each layout); every
program is compiled once (`lower().compile()`) and that executable is run, timed and read. Files in
the run directory: report.md, results.json, config.json and six plots.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, load_config, model_vocab_size, to_json
from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs import report
from jaxpar.labs.arguments import MOE_PARTS as PARTS
from jaxpar.labs.arguments import MOE_SETTINGS as LAB_SETTINGS
from jaxpar.labs.arguments import moe as add_arguments
from jaxpar.labs.report import max_rel_dev, md_table, standalone_main, write_report
from jaxpar.units import byte_unit, fmt_bytes, ratio

TOLERANCE = 1e-4
CAPACITY_FACTORS = (1.0, 1.25, 2.0)
BALANCE_METHODS = {   # name -> overrides (on top of the capacity dispatch at factor 1.25)
    "none": ["model.moe.router=softmax", "model.moe.balance_loss=0", "model.moe.z_loss=0"],
    "aux loss": ["model.moe.router=softmax", "model.moe.balance_loss=0.01", "model.moe.z_loss=0.001"],
    "aux-free bias": ["model.moe.router=sigmoid", "model.moe.balance_loss=0", "model.moe.z_loss=0"],
    "noisy gating": ["model.moe.router=noisy", "model.moe.balance_loss=0", "model.moe.z_loss=0"],
}


@dataclasses.dataclass
class Built:
    """One configuration's trainer and its compiled step (compiled once: run, timed and inspected)."""

    label: str
    config: object
    trainer: object
    compiled: object
    compile_s: float

    @property
    def sizes(self) -> dict:
        return {name: int(size) for name, size in self.trainer.mesh.shape.items()}


class Lab:
    def __init__(self, config, devices, log=print):
        from jaxpar.data.pipeline import build_token_data, train_dataset, val_batches

        self.base, self.devices, self.n, self.log = config, devices, len(devices), log
        self.data = build_token_data(config.data)
        self.vocab = model_vocab_size(config, self.data.stats["vocab_size"], 1)
        B = config.train.batch_size
        self._stream = iter(train_dataset(self.data.train, B, config.data.shuffle_seed, slice(0, B)))
        self.validation = val_batches(self.data.val, B, config.train.eval_batches, slice(0, B))
        self._batches: list[np.ndarray] = []
        self.builds: dict[tuple, Built] = {}
        self._initial: dict = {}

    def batches(self, count: int) -> list[np.ndarray]:
        """The first `count` training batches of the corpus: the same list for every run."""
        while len(self._batches) < count:
            self._batches.append(np.asarray(next(self._stream)))
        return self._batches[:count]

    def build(self, label: str, overrides: list[str], devices: int = 1) -> Built:
        """Configure, build and compile one run (cached by its overrides and device count)."""
        from jaxpar.parallel.registry import build_trainer

        key = (tuple(overrides), devices)
        if key not in self.builds:
            config = copy.deepcopy(self.base)
            apply_overrides(config, ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", "mesh.tensor=1",
                                     "parallel.expert=auto", "train.compute_dtype=float32", *overrides])
            trainer = build_trainer(config, self.devices[:devices], self.vocab)
            start = time.perf_counter()
            with jax.set_mesh(trainer.mesh):
                compiled = trainer.lower_step().compile()
            self.builds[key] = Built(label, config, trainer, compiled, time.perf_counter() - start)
            self.log(f"  compiled {label} in {self.builds[key].compile_s:.1f} s")
        return self.builds[key]

    def initial_state(self, built: Built):
        """The initial state of `built`'s model in its layout: made once per parameter shapes (the same seed
        gives the same values), on the host without compiling anything, then placed per layout."""
        shapes = jax.eval_shape(built.trainer.make_state)
        key = str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), shapes))
        if key not in self._initial:
            with jax.default_device(jax.devices("cpu")[0]):
                self._initial[key] = jax.device_get(built.trainer.make_state())
        return jax.device_put(self._initial[key], built.trainer.state_shardings)

    def run(self, built: Built, steps: int, keep=("moe_routed", "moe_dropped"), evaluate: bool = False) -> dict:
        """Train from the initial state over the first `steps` batches: losses, times, kept metrics per step,
        and with `evaluate` the validation cross-entropy at the end."""
        state = self.initial_state(built)
        out = {"losses": [], "ce": [], "times": [], **{k: [] for k in keep}}
        with jax.set_mesh(built.trainer.mesh):
            for batch in self.batches(steps):
                tokens = jax.device_put(batch, built.trainer.batch_sharding)
                start = time.perf_counter()
                state, metrics = built.compiled(state, tokens)
                jax.block_until_ready(metrics)
                out["times"].append(time.perf_counter() - start)
                out["losses"].append(float(metrics["loss"]))
                out["ce"].append(float(metrics.get("ce_loss", metrics["loss"])))
                for k in keep:
                    if k in metrics:
                        out[k].append(np.asarray(metrics[k]).tolist())
            if evaluate:
                out["val_loss"] = float(np.mean([float(built.trainer.evaluate(state["params"], b))
                                                 for b in self.validation]))
        return out


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
    out = defaultdict(lambda: {"instructions": 0, "runs": 0, "bytes": 0.0})
    for c in found:
        if axis_filter is None or axis_filter(c):
            out[c.op]["instructions"] += 1
            out[c.op]["runs"] += c.runs_per_step
            out[c.op]["bytes"] += c.bytes_per_step
    return dict(out)


def communication(lab: Lab) -> dict:
    from jaxpar.measure.hlo import collectives
    from jaxpar.parallel.registry import workload
    from jaxpar.parallel.theory import moe_all_to_all_bytes

    rows = {}
    for label, overrides, devices in _strategies(lab.n):
        if devices == 1:
            continue
        built = lab.build(label, overrides, devices)
        found = collectives(built.compiled.as_text(), built.trainer.mesh)
        theory = moe_all_to_all_bytes(*workload(built.config, built.trainer.model_cfg, built.sizes,
                                               lab.devices[0].platform))
        on_expert = _by_op(found, lambda c: "expert" in (c.axes or ()))
        a2a = on_expert.get("all-to-all", {}).get("bytes", 0.0)
        rows[label] = {"by_op_expert_axes": on_expert, "by_op_all": _by_op(found), "all_to_all": a2a,
                       "formula": theory["formula"], "predicted": theory["predicted"],
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
        ops = ", ".join(f"{op} x{o['runs']} = {fmt_bytes(o['bytes'])}" for op, o in sorted(r["by_op_expert_axes"].items()))
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
        "dropless padded to T·min(k, E/N) rows per destination = N·min(k, E/N)/k x formula, plus the int32 "
        "expert ids (XLA:CPU has no ragged all-to-all).",
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
    from jaxpar.measure.hlo import collectives
    from jaxpar.parallel.registry import workload
    from jaxpar.parallel.theory import moe_all_to_all_bytes

    n, rows = lab.n, {}
    settings = [(f"capacity {cf}", ["model.moe.dispatch=capacity", f"model.moe.capacity_factor={cf}"])
                for cf in CAPACITY_FACTORS] + [("dropless (padded)", DROPLESS)]
    for label, dispatch in settings:
        built = lab.build(f"manual EP expert={n}, {label}", [*dispatch, f"mesh.expert={n}", _ep(True)], n)
        r = lab.run(built, steps)
        a2a = sum(c.bytes_per_step for c in collectives(built.compiled.as_text(), built.trainer.mesh)
                  if c.op == "all-to-all")
        theory = moe_all_to_all_bytes(*workload(built.config, built.trainer.model_cfg, built.sizes,
                                               lab.devices[0].platform))
        dropped = np.sum(np.asarray(r["moe_dropped"]), axis=-1).mean(axis=-1)
        rows[label] = {"dropped": dropped.tolist(), "dropped_mean": float(dropped.mean()), "all_to_all": a2a,
                       "formula": theory["formula"], "predicted": theory["predicted"],
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
        cfg = built.trainer.model_cfg
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


# ============================================================================ plots

def plot_equivalence(result: dict, path: Path):
    """Each dispatch against its own single-device oracle."""
    return report.plot_equivalence(path, [(label, r["losses"], None if "single" in label else
                                           label.split(":")[0] + ": single device")
                                          for label, r in result["runs"].items()], result["tolerance"])


def _wrapped(labels, width: int = 15) -> list[str]:
    import textwrap
    return ["\n".join(textwrap.wrap(label, width)) for label in labels]


@styled
def plot_communication(result: dict, path: Path):
    """Per strategy: compiled all_to_all, the course's formula, jaxpar's buffers (manual EP only) and every
    compiled collective over `expert`; log scale."""
    from matplotlib.transforms import blended_transform_factory
    rows = result["rows"]
    every = [sum(o["bytes"] for o in r["by_op_expert_axes"].values()) for r in rows.values()]
    unit, scale = byte_unit([*every, *(r["formula"] for r in rows.values())])
    fig = figure(10, 6.4)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.2
    ax.bar(x - 1.5 * w, [r["all_to_all"] / scale for r in rows.values()], w, label="compiled all_to_all")
    ax.bar(x - 0.5 * w, [r["formula"] / scale for r in rows.values()], w, color="0.75", hatch="..", edgecolor="0.3",
           label="course formula 2·T·k·h·4 B x 2 (fwd + bwd):\nT tokens per device, k experts per token, h = d_model")
    ax.bar(x + 0.5 * w, [(r["predicted"] if r["manual"] else 0) / scale for r in rows.values()], w, color="0.35",
           label="jaxpar's buffers, manual EP (dryrun)")
    ax.bar(x + 1.5 * w, np.array(every) / scale, w, color="#c44e52", label="every compiled collective over `expert`")
    at_bottom = blended_transform_factory(ax.transData, ax.transAxes)
    for i, r in enumerate(rows.values()):
        if not r["manual"]:
            ax.text(x[i] + 0.5 * w, 0.02, "no formula: XLA's buffers", rotation=90, ha="center", va="bottom",
                    transform=at_bottom)
    ax.set_yscale("log")
    ax.set_xticks(x, _wrapped(rows))
    ax.set(ylabel=f"{unit} per device per step (log)", title="Expert-parallel all_to_all per step: compiled vs formula")
    legend_below(ax, ncols=2, gap=0.3)
    return save(fig, path)


@styled
def plot_balance(result: dict, path: Path):
    fig = figure(10, 5.2)
    cv, dropped = fig.subplots(1, 2)
    for method, r in result["runs"].items():
        steps = np.arange(1, len(r["cv"]) + 1)
        cv.plot(steps, np.mean(r["cv"], axis=1), lw=1.5, label=method)
        dropped.plot(steps, np.mean(r["dropped"], axis=1), lw=1.5, label=method)
    cv.set(xlabel="step", ylabel="CV of expert load (0 = balanced)", title="load imbalance")
    report.integer_steps(cv, dropped)
    dropped.set(xlabel="step", ylabel="fraction of assignments dropped", title="dropped at capacity factor 1.25")
    handles, labels = cv.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), title="balancing method")
    fig.suptitle("Load balance (CV = std / mean of each expert's share, mean over layers)")
    return save(fig, path)


@styled
def plot_heatmaps(result: dict, path: Path):
    methods = list(result["runs"])
    layers = np.asarray(result["runs"][methods[0]]["routed"]).shape[1]
    fig = figure(10, 1.8 * layers + 1.6)
    top = max(float(np.max(r["routed"])) for r in result["runs"].values())
    axes = np.asarray(fig.subplots(layers, len(methods), sharex=True, sharey=True, squeeze=False))
    image = None
    for col, method in enumerate(methods):
        load = np.asarray(result["runs"][method]["routed"])              # [steps, layers, experts]
        for layer in range(layers):
            ax = axes[layer, col]
            image = ax.imshow(load[:, layer, :].T, aspect="auto", cmap="viridis", vmin=0, vmax=top,
                              interpolation="nearest")
            ax.grid(False)
            ax.set_title(method if layer == 0 else "")
            if col == 0:
                ax.set_ylabel(f"layer {layer}\nexpert")
            if layer == layers - 1:
                ax.set_xlabel("step")
    fig.colorbar(image, ax=axes, shrink=0.8, label="share of the layer's assignments")
    fig.suptitle("Expert load over training, per balancing method (capacity factor 1.25)")
    return save(fig, path)


@styled
def plot_capacity(result: dict, path: Path):
    rows = result["rows"]
    fig = figure(10, 4.8)
    drop, t = fig.subplots(1, 2)
    labels = _wrapped(rows, 10)
    bars = drop.bar(labels, [r["dropped_mean"] for r in rows.values()], color="#dd8452")
    drop.bar_label(bars, [f"{r['dropped_mean']:.3f}" if r["dropped_mean"] else "0\n(drops none)"
                          for r in rows.values()], padding=2)
    bars = t.bar(labels, [r["step_ms"] for r in rows.values()], color="#4c72b0")
    t.bar_label(bars, [f"{r['step_ms']:.0f}" for r in rows.values()], padding=2)
    drop.margins(y=0.12)
    t.margins(y=0.12)
    drop.set(ylabel="fraction of assignments dropped", title="dropped (mean over steps, layers)")
    t.set(ylabel="step time, median (ms, measured)", title="step time")
    fig.suptitle("Capacity factor: each expert takes factor x its even share of a group's tokens")
    return save(fig, path)


@styled
def plot_moe_vs_dense(result: dict, path: Path):
    fig = figure(8, 5.2)
    ax = fig.add_subplot()
    for label, r in result["runs"].items():
        ax.plot(np.arange(1, len(r["ce"]) + 1), r["ce"], lw=1.5,
                label=f"{label}: validation CE after training {r['val_loss']:.3f}")
    ax.set(xlabel="step", ylabel="training cross-entropy", title="MoE vs dense, the same active FLOPs per token")
    report.integer_steps(ax)
    legend_below(ax, gap=0.16)
    return save(fig, path)


PLOTS = {"equivalence.png": ("equivalence", plot_equivalence), "communication.png": ("communication", plot_communication),
         "balance.png": ("balance", plot_balance), "balance_heatmaps.png": ("balance", plot_heatmaps),
         "capacity.png": ("capacity", plot_capacity), "moe_vs_dense.png": ("moe_vs_dense", plot_moe_vs_dense)}


# ============================================================================ the whole lab


def run_lab(config, out: str | Path | None = None, *, steps: int = 5, balance_steps: int = 150,
            capacity_steps: int = 30, compare_steps: int = 150, bias_rate: float = 0.01, parts=PARTS,
            log=print) -> dict:
    """Run `parts` (default: a-e) on every local device; write the run directory; return every number."""
    start = time.perf_counter()
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ConfigError("--parts", f"{', '.join(unknown) or 'nothing'} given; choose from {', '.join(PARTS)}")
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
    out = Path(out or f"runs/lab-moe-{time.strftime('%Y%m%d-%H%M%S')}")
    log(f"lab moe: {n} x {devices[0].platform} devices, run directory {out}")
    lab = Lab(config, devices, log)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(to_json(config))
    m = config.model
    header = "\n".join([
        f"# Lab 04: Mixture-of-Experts and expert parallelism: config {config.name}, {n} x {devices[0].platform}",
        "",
        f"jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. Model: d_model {m.d_model}, {m.layers} layers "
        f"({m.moe.dense_layers} dense), {m.moe.experts} experts of hidden {m.moe.expert_mlp_dim or m.mlp_dim}, "
        f"top-{m.moe.top_k}, {m.moe.shared_experts} shared; vocab {lab.vocab}; batch {config.train.batch_size} x "
        f"{config.data.seq_len} tokens of the corpus '{config.data.corpus}'. Measured values come from the "
        "compiled program or the clock; predicted values from the formulas named beside them.",
    ])
    results = {"config": config.name, "devices": n, "platform": devices[0].platform, "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d")}
    sections = [header]
    log(header + "\n")
    work = {"equivalence": lambda: equivalence(lab, steps), "communication": lambda: communication(lab),
            "balance": lambda: balance(lab, balance_steps, bias_rate),
            "capacity": lambda: capacity(lab, capacity_steps), "moe_vs_dense": lambda: moe_vs_dense(lab, compare_steps)}
    parts_run = [name for name in PARTS if name in parts]
    for name in parts_run:
        t0 = time.perf_counter()
        log(f"[{name}]")
        result = work[name]()
        result["seconds"] = time.perf_counter() - t0
        results[name] = result
        sections.append(result["markdown"])
        log(result["markdown"] + f"\n\n({name}: {result['seconds']:.1f} s)\n")
    footer = write_report(out, sections, results, start, {k: results[k]["seconds"] for k in parts_run},
                          compiles=(len(lab.builds), sum(b.compile_s for b in lab.builds.values())))
    log(footer)
    report.draw_plots(results, out, PLOTS)     # after results.json: a failed plot can be redrawn
    log(f"wrote {out / 'report.md'}, results.json and the plots")
    return results


# ============================================================================ command line

def run_from_args(args) -> int:
    """`jaxpar lab moe` and run.py: the CPU device count must already be set (before JAX started)."""
    config = load_config(args.config)
    apply_overrides(config, [*LAB_SETTINGS, *args.overrides])
    run_lab(config, args.out, steps=args.steps, balance_steps=args.balance_steps,
            capacity_steps=args.capacity_steps, compare_steps=args.compare_steps, bias_rate=args.bias_rate,
            parts=[p.strip() for p in args.parts.split(",") if p.strip()])
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/04_moe/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

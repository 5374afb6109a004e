"""Lab 02 (course module 2): DDP, ZeRO-1/2/3 and FSDP on one mesh: same losses, different memory, different bytes.

One run, five parts, every number beside its prediction (experiments/02_zero/README.md is the lab sheet):

a. equivalence   losses of the single-device oracle, auto data=N, auto fsdp=N and the manual stages 0-3
                 (`parallel/zero.py`) over the same batches, fp32: max relative deviation vs the oracle.
b. memory        per-device params, grads, optimizer state: the ZeRO formulas in jaxpar's dtypes
                 (`measure.memory.zero_formula`) vs the compiled step (input shardings, memory_analysis).
c. communication collectives per step from the compiled HLO (`measure.hlo`) vs 2Ψ / 3Ψ, and what XLA's
                 partitioner chose for the automatic FSDP beside the hand-written ZeRO-3.
d. remat         none/full/dots/names on the auto FSDP step: temp bytes and step time (interleaved).
e. precision     fp32, bf16 (fp32 master weights), fp8: loss curves on the real corpus.

Parts a-d run in float32 whatever the config says (e is the precision part). Every step is
compiled once ahead of time (`lower().compile()`); the same executable is run, timed and read
(memory_analysis, HLO), so nothing is compiled twice. Files in the run directory: report.md,
results.json, config.json, equivalence.png, memory.png, communication.png, remat.png, precision.png.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.labs.arguments import ZERO_PARTS as PARTS
from jaxpar.labs.arguments import zero as add_arguments
from jaxpar.labs.base.report import max_rel_dev, md_table
from jaxpar.labs.base.runner import Part, chosen_parts, run_directory, run_parts, standalone_main
from jaxpar.labs.zero.build import Lab
from jaxpar.labs.zero.communication import communication
from jaxpar.labs.zero.plots import PLOTS
from jaxpar.parallel.zero import STAGE_NAMES
from jaxpar.units import fmt_bytes, ratio

TOLERANCE = 1e-4          # max relative loss deviation from the oracle (tests/test_zero.py uses the same)
REMATS = ("none", "full", "dots", "names")
PRECISIONS = (("float32", "fp32"), ("bfloat16", "bf16 (fp32 master weights)"), ("float8", "fp8"))


# ============================================================================ parts a-e

def _median_ms(times) -> float:
    rest = times[1:] if len(times) > 1 else times   # the first call pays one-off costs
    return 1e3 * statistics.median(rest)


# ============================================================================ a. equivalence

def equivalence(lab: Lab, steps: int) -> dict:
    """The same batches through every strategy; fp32 matmuls at full precision.

    XLA:GPU would run fp32 matmuls in TF32 (~1e-3 deviations), so on accelerators these
    steps are compiled with matmul precision 'highest' (cached apart from the later parts'
    default-precision compiles). XLA:CPU computes fp32 dots in fp32 either way.
    """
    batches = lab.batches(steps)
    runs: dict[str, dict[str, Any]] = {}
    exact = contextlib.nullcontext() if lab.platform == "cpu" else jax.default_matmul_precision("highest")
    with exact:
        for built in lab.strategies():
            losses, times = lab.run(built, batches)
            runs[built.key] = {"label": built.label, "losses": losses, "step_ms": _median_ms(times),
                               "compile_s": built.compile_s}
    oracle = runs["single"]
    for r in runs.values():
        r["max_rel_dev"] = max_rel_dev(r["losses"], oracle["losses"])
        r["within_tolerance"] = r["max_rel_dev"] <= TOLERANCE
    rows = [[r["label"], f"{r['losses'][0]:.5f}", f"{r['losses'][-1]:.5f}", f"{r['max_rel_dev']:.2e}",
             "0 (fp32 rounding only)", f"{TOLERANCE:.0e}", "yes" if r["within_tolerance"] else "**NO**",
             f"{r['step_ms']:.1f}", ratio(r["step_ms"], oracle["step_ms"])] for r in runs.values()]
    md = "\n".join([
        f"## a. Equivalence: {steps} steps, same batches, fp32",
        "",
        md_table(["strategy", "loss step 1", f"loss step {steps}", "max rel. deviation vs single device (measured)",
                "predicted", "tolerance", "within", "step ms (median)", "vs single device"], rows),
        "",
        "Deviation = max over steps of |loss - oracle| / oracle. The strategies compute the same sums in a "
        "different order (per-device partial sums, then a collective), so only fp32 rounding separates them.",
    ])
    return {"steps": steps, "tolerance": TOLERANCE, "runs": runs, "markdown": md}


# ============================================================================ b. memory

def memory(lab: Lab) -> dict:
    from jaxpar.measure.memory import (
        compiled_memory,
        korthikanti_activations,
        shard_counts,
        state_bytes,
        zero_formula,
    )
    from jaxpar.parallel.memory import config_memory
    from jaxpar.parallel.zero import gradient_held

    rows = {}
    for built in lab.strategies():
        cfg, sizes, strategy = built.config, built.sizes, built.strategy
        shards = shard_counts(cfg, sizes)
        formula = zero_formula(lab.psi, shards)            # jaxpar's dtypes: fp32 params 4, grads 4, Adam 8
        # what the compiled executable takes in, leaf by leaf: its input shardings x the global shapes
        in_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                strategy.abstract_state, built.compiled.input_shardings[0][0])
        compiled_state = state_bytes(in_state)
        mem = compiled_memory(built.compiled, lab.platform)
        batch_bytes = cfg.train.batch_size // (sizes["data"] * sizes["fsdp"]) * (cfg.data.seq_len + 1) * 4
        micro = cfg.train.batch_size // cfg.train.microbatches // (sizes["data"] * sizes["fsdp"])
        paper = korthikanti_activations(layers=lab.model_cfg.layers, seq_len=cfg.data.seq_len, micro_batch=micro,
                                        d_model=lab.model_cfg.d_model, heads=lab.model_cfg.heads,
                                        vocab_size=lab.model_cfg.vocab_size, compute_bytes=4, remat=cfg.train.remat)
        ours = config_memory(cfg, lab.model_cfg, sizes, lab.platform)
        rows[built.key] = {
            "label": built.label, "shards": shards, "formula": formula, "compiled_state": compiled_state,
            "compiled": mem.as_dict(), "batch_bytes": batch_bytes, "activations_paper": paper["total"],
            "arguments_check": compiled_state["state_total"] + batch_bytes == mem.argument,
            "temp_paper": formula["grads"] + paper["total"], "temp_jaxpar": ours.total - ours.state,
        }
    state_rows, temp_rows = [], []
    for r in rows.values():
        f, c, m = r["formula"], r["compiled_state"], r["compiled"]
        s = r["shards"]
        state_rows.append([r["label"], f"{s['params']} / {s['grads']} / {s['optimizer']}",
                           fmt_bytes(f["params"]), fmt_bytes(c["params"]), ratio(c["params"], f["params"]),
                           fmt_bytes(f["optimizer"]), fmt_bytes(c["optimizer"]), ratio(c["optimizer"], f["optimizer"]),
                           fmt_bytes(m["argument"]), "yes" if r["arguments_check"] else "**no**"])
        temp_rows.append([r["label"], fmt_bytes(f["grads"]), fmt_bytes(r["activations_paper"]),
                          fmt_bytes(r["temp_paper"]), fmt_bytes(r["temp_jaxpar"]), fmt_bytes(m["temp"]),
                          ratio(m["temp"], r["temp_paper"]), ratio(m["temp"], r["temp_jaxpar"]), fmt_bytes(m["peak"])])
    md = "\n".join([
        "## b. Memory per device",
        "",
        "Stored state: formula = `zero_formula` in jaxpar's dtypes (fp32 params 4Ψ, Adam mu + nu 8Ψ, each / its "
        "shard count); compiled = the executable's input shardings applied to the state's shapes.",
        "",
        md_table(["strategy", "shards p / g / opt", "params: formula", "params: compiled", "ratio",
                "Adam mu+nu: formula", "Adam: compiled", "ratio", "arguments (memory_analysis)",
                "= state + counters + batch"], state_rows),
        "",
        "Gradients are not arguments: they live in the step's temporaries, with the activations. Paper = grads "
        "(4Ψ / grad shards) + the activations of Korthikanti et al. 2022 (adapted, fp32); jaxpar's prediction = "
        "the strategy's memory model (jaxpar.parallel.memory: gradients, activations kept, working set), the one "
        "the dry run and the planner use, fitted on XLA:GPU bf16 compiles (its fixed 0.95 GB of XLA:GPU buffers "
        "is charged on GPU only): on CPU in fp32 it is not calibrated, and the ratio is reported as it comes.",
        "",
        md_table(["strategy", "grads: formula", "activations: paper (Korthikanti)", "temp: paper",
                "temp: jaxpar's prediction", "temp: compiled", "compiled / paper", "compiled / jaxpar's",
                "peak (compiled)"], temp_rows),
        "",
        f"Peak: {rows['single']['compiled']['peak_method']}.",
    ])
    gradient = gradient_term(lab, gradient_held)
    return {"rows": rows, "gradient": gradient, "markdown": md + "\n\n" + gradient["markdown"]}


def gradient_term(lab: Lab, gradient_held) -> dict:
    """ZeRO-1 vs ZeRO-2 with twice the layers (at least 8): the same state, the same bytes on the wire;
    the compiled temp memory differs by the gradient ZeRO-2 never holds whole."""
    from jaxpar.measure.memory import compiled_memory
    from jaxpar.model.counting import param_count
    from jaxpar.model.transformer import ModelConfig

    layers = max(8, 2 * lab.model_cfg.layers)
    built = {stage: lab.manual(stage, layers=layers) for stage in ("zero1", "zero2")}
    counts = param_count(ModelConfig.from_config(built["zero1"].config.model, lab.model_cfg.vocab_size))
    psi, psi_layers, n = counts["total"], counts["blocks"], lab.n
    mem = {stage: compiled_memory(b.compiled, lab.platform) for stage, b in built.items()}
    held = {stage: gradient_held(stage, psi, psi_layers, layers, n) for stage in built}
    measured, predicted, full = mem["zero1"].temp - mem["zero2"].temp, held["zero1"] - held["zero2"], 4 * psi
    rows = [[f"manual {STAGE_NAMES[s]}", *(fmt_bytes(b) for b in (mem[s].argument, mem[s].output, mem[s].temp,
                                                                 mem[s].peak, held[s]))] for s in built]
    md = "\n".join([
        f"### The gradient term: ZeRO-1 vs ZeRO-2 at {layers} layers (Ψ = {psi:,}, Ψ_L = {psi_layers:,}, N = {n})",
        "",
        md_table(["stage", "arguments", "outputs", "temp (compiled)", "peak (compiled)",
                "gradient held at peak (predicted)"], rows),
        "",
        md_table(["", "bytes", "/ full gradient 4Ψ"],
               [["temp: ZeRO-1 − ZeRO-2, measured", fmt_bytes(measured), f"{measured / full:.3f}"],
                ["predicted 4Ψ_L·(1 − 1/N − 1/L)", fmt_bytes(predicted), f"{predicted / full:.3f}"],
                ["measured / predicted", ratio(measured, predicted), ""]], "lrr"),
        "",
        "Both stages store the same state and send the same 2Ψ; ZeRO-1 finishes the backward pass holding the "
        "whole local gradient and reduce-scatters it once, ZeRO-2 reduce-scatters each layer's gradient inside the "
        "backward scan, so at most one layer's gradient is whole at a time (plus the embedding's and head's, "
        "which are computed outside the layer loop).",
    ])
    return {"layers": layers, "measured_drop": measured, "predicted_drop": predicted, "full_gradient": full,
            "rows": {s: mem[s].as_dict() for s in built}, "markdown": md}


# ============================================================================ d. activation checkpointing

def remat(lab: Lab, repeats: int) -> dict:
    """remat none/full/dots/names on the auto FSDP step: temp bytes, FLOPs, interleaved step times."""
    from jaxpar.measure.flops import compiled_flops
    from jaxpar.measure.memory import compiled_memory, korthikanti_activations
    from jaxpar.parallel.memory import config_memory

    builts = {policy: lab.variant("auto-fsdp", fsdp=lab.n, remat=policy) for policy in REMATS}
    batch = lab.batches(1)[0]
    any_built = builts["none"]
    state = lab.initial_state(any_built)                 # the same shardings for all four: one state goes round
    tokens = jax.device_put(batch, any_built.strategy.batch_sharding)
    times: dict[str, list[float]] = {p: [] for p in REMATS}
    with jax.set_mesh(any_built.strategy.mesh):
        for policy in REMATS:                            # warm-up: first call of each executable
            state, metrics = builts[policy].compiled(state, tokens)
            jax.block_until_ready(metrics)
        for _ in range(repeats):
            for policy in REMATS:
                start = time.perf_counter()
                state, metrics = builts[policy].compiled(state, tokens)
                jax.block_until_ready(metrics)
                times[policy].append(time.perf_counter() - start)
    del state
    cfg = any_built.config
    micro = cfg.train.batch_size // cfg.train.microbatches // lab.n
    rows = {}
    for policy, built in builts.items():
        mem = compiled_memory(built.compiled, lab.platform)
        flops = compiled_flops(built.compiled, built.hlo)["corrected"]
        paper = korthikanti_activations(layers=lab.model_cfg.layers, seq_len=cfg.data.seq_len, micro_batch=micro,
                                        d_model=lab.model_cfg.d_model, heads=lab.model_cfg.heads,
                                        vocab_size=lab.model_cfg.vocab_size, compute_bytes=4, remat=policy)
        ours = config_memory(built.config, lab.model_cfg, built.sizes, lab.platform)
        rows[policy] = {"temp": mem.temp, "activations_paper": paper["total"], "paper_note": paper["note"],
                        "activations_jaxpar": ours.activations,
                        "flops": flops, "step_ms": 1e3 * statistics.median(times[policy]),
                        "times_ms": [1e3 * t for t in times[policy]]}
    base = rows["none"]
    table = [[p, fmt_bytes(r["temp"]), ratio(r["temp"], base["temp"]), fmt_bytes(r["activations_paper"]),
              fmt_bytes(r["activations_jaxpar"]),
              ratio(r["temp"] - base["temp"], r["activations_paper"] - base["activations_paper"])
              if p == "full" else "-",
              ratio(r["temp"] - base["temp"], r["activations_jaxpar"] - base["activations_jaxpar"])
              if r["activations_jaxpar"] != base["activations_jaxpar"] else "-",
              f"{r['flops']:.3g}", ratio(r["flops"], base["flops"]), f"{r['step_ms']:.1f}",
              ratio(r["step_ms"], base["step_ms"])] for p, r in rows.items()]
    md = "\n".join([
        f"## d. Activation checkpointing (auto fsdp={lab.n}, fp32, {repeats} interleaved steps per policy)",
        "",
        md_table(["remat", "temp (compiled)", "vs none", "activations: paper (Korthikanti)",
                "activations kept: jaxpar's prediction", "Δtemp / Δpaper", "Δtemp / Δjaxpar's",
                "FLOPs/device (compiled, loop-corrected)", "predicted time ratio (FLOPs)",
                "step ms (median, measured)", "measured time ratio"], table),
        "",
        "Predicted time ratio = compiled FLOPs / those of remat none (recomputation is extra FLOPs); "
        "measured = median step time / that of none, with the four policies run in turn so that load on "
        "the machine hits them alike. No pass/fail: small steps on CPU are dominated by fixed overheads. "
        f"Paper: {rows['full']['paper_note']}; 'dots'/'names' are not in the paper (no-remat upper bound). "
        "jaxpar's prediction: the strategy's memory model (jaxpar.parallel.memory; 'names' counts as 'full'), "
        "fitted on XLA:GPU bf16: not calibrated for CPU fp32. "
        f"'names' saves {cfg.train.remat_names}.",
    ])
    return {"repeats": repeats, "rows": rows, "markdown": md}


# ============================================================================ e. mixed precision

def precision(lab: Lab, steps: int, wanted: list[str] | None) -> dict:
    from jaxpar.measure.memory import compiled_memory, zero_formula
    from jaxpar.parallel.memory import config_memory

    chosen = [(dtype, label) for dtype, label in PRECISIONS if wanted is None or dtype in wanted]
    batches = lab.batches(steps)
    runs: dict[str, dict[str, Any]] = {}
    for dtype, label in chosen:
        built = lab.variant("auto-fsdp", fsdp=lab.n, dtype=dtype)
        losses, times = lab.run(built, batches)
        mem = compiled_memory(built.compiled, lab.platform)
        cfg = built.config
        ours = config_memory(cfg, lab.model_cfg, built.sizes, lab.platform)    # the strategy's prediction
        formula = zero_formula(lab.psi, {"params": lab.n, "grads": lab.n, "optimizer": lab.n})
        runs[dtype] = {"label": label, "losses": losses, "step_ms": _median_ms(times), "argument": mem.argument,
                       "temp": mem.temp, "state_formula": formula["state"],
                       "temp_predicted": ours.total - ours.state}
    table = []
    ref = runs.get("float32")
    tail = max(1, steps // 10)
    for _dtype, r in runs.items():
        dev = max_rel_dev(r["losses"], ref["losses"]) if ref else None
        r["max_rel_dev_vs_fp32"] = dev
        r["final_mean"] = float(np.mean(r["losses"][-tail:]))
        table.append([r["label"], f"{r['losses'][0]:.4f}", f"{r['final_mean']:.4f}",
                      "-" if dev is None else f"{dev:.2e}",
                      fmt_bytes(r["argument"]), fmt_bytes(r["state_formula"]), ratio(r["argument"], r["state_formula"]),
                      fmt_bytes(r["temp"]), fmt_bytes(r["temp_predicted"]), ratio(r["temp"], r["temp_predicted"]),
                      f"{r['step_ms']:.1f}", ratio(r["step_ms"], ref["step_ms"]) if ref else "-"])
    md = "\n".join([
        f"## e. Mixed precision (auto fsdp={lab.n}, {steps} steps, the same batches of the real corpus)",
        "",
        md_table(["compute dtype", "loss step 1", f"loss, mean of last {tail}", "max rel. deviation vs fp32",
                "arguments (compiled)", "predicted 12Ψ/N", "ratio", "temp (compiled)",
                "temp: jaxpar's prediction", "ratio", "step ms (median)", "vs fp32"], table),
        "",
        "The stored state is the same in every precision (fp32 master params and Adam moments: 12Ψ/N); the "
        "compute dtype changes only the temporaries. Predicted temp is the strategy's memory model "
        "(jaxpar.parallel.memory: activations at 4 bytes in fp32, 2 in bf16 and float8, which also keeps its fp8 "
        "matmul inputs), fitted on XLA:GPU bf16 compiles: not calibrated for CPU. XLA:CPU keeps some bf16 "
        "work in fp32 and has no fp8 matmul units, so only a GPU run says what the dtypes save.",
    ])
    return {"steps": steps, "runs": runs, "markdown": md}


# ============================================================================ the whole lab


def run_lab(config, out: str | Path | None = None, *, steps: int = 10, precision_steps: int = 60,
            remat_repeats: int = 10, precisions: list[str] | None = None, parts: tuple[str, ...] = PARTS,
            log=print) -> dict:
    """Run parts a-e (or those in `parts`) on every local device; write the run directory; return every number."""
    start = time.perf_counter()
    parts = tuple(chosen_parts(parts, PARTS))
    for name, value in (("--steps", steps), ("--precision-steps", precision_steps),
                        ("--remat-repeats", remat_repeats)):
        if value < 1:
            raise ConfigError(name, f"is {value}; must be at least 1")
    if precisions is not None:
        unknown = [p for p in precisions if p not in {d for d, _ in PRECISIONS}]
        if unknown:
            raise ConfigError("--precisions", f"unknown {', '.join(unknown)}; valid: "
                              f"{', '.join(d for d, _ in PRECISIONS)}")
    devices = jax.devices()
    if len(devices) < 2:
        raise ConfigError("--cpu-devices", f"the lab compares strategies over several devices but JAX has "
                          f"{len(devices)}; on CPU pass --cpu-devices 8")
    lab = Lab(config, devices, log)
    out = run_directory(out, "zero", config, log=log)
    m = lab.model_cfg
    header = lab.sheet_header(
        "Lab 02: DDP, ZeRO-1/2/3 and FSDP",
        f"Model: {lab.psi:,} params (d_model {m.d_model}, {m.layers} layers, vocab {m.vocab_size})")
    results = {**lab.facts(), "params": lab.psi, "params_blocks": lab.counts["blocks"]}
    plan = {"equivalence": lambda: equivalence(lab, steps), "memory": lambda: memory(lab),
            "communication": lambda: communication(lab), "remat": lambda: remat(lab, remat_repeats),
            "precision": lambda: precision(lab, precision_steps, precisions)}
    return run_parts("zero", out, [Part(name, plan[name]) for name in parts], results, [header],
                     PLOTS, start=start, compiles=lab.compiles, log=log)


# ============================================================================ command line

def run_from_args(args) -> int:
    """`jaxpar lab zero` and run.py: the CPU device count must already be set (before JAX started)."""
    config = load_config(args.config)
    apply_overrides(config, args.overrides)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()] if args.precisions else None
    run_lab(config, args.out, steps=args.steps, precision_steps=args.precision_steps,
            remat_repeats=args.remat_repeats, precisions=precisions,
            parts=args.parts)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/*/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

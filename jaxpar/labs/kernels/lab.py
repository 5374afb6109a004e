"""Lab 08 (course module 5): fused kernels and compilation: same numbers, less memory, fewer compiles.

Four parts, every measured number beside its prediction (experiments/08_kernels/README.md is the lab sheet):

a. agreement    each kernel against its pure-jnp reference (values and gradients, fp32 and bf16), and
                the model trained with model.attention=xla/pallas (+ fused norm, chunked loss) against
                the dot run: one device, fsdp=8, tensor=4 x data=2, 5 steps, fp32; then the kernels inside
                every hand-written strategy (ZeRO, manual TP, pipelines, manual EP: labs/kernels/strategies.py).
b. memory       compiled temp bytes of the train step at three sequence lengths, dot vs flash attention,
                remat none vs full, against Korthikanti's formula with and without the 5·a·s/h term;
                the chunked cross-entropy's saving against the [B, S, V] fp32 bytes it avoids.
c. compilation  the default config's step compiled cold and warm from the persistent cache (fresh
                processes); compile time vs depth with the layer scan and unrolled.
d. GPU          the benchmarks' tables (benchmarks/attention.py, benchmarks/mfu.py) when a results
                directory from a GPU run is given; otherwise marked open.

On CPU the Pallas kernels run interpreted: the numerics are the kernels', the speed is not.
Files in the run directory: report.md, results.json, memory.png, compile.png.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs.arguments import kernels as add_arguments
from jaxpar.labs.base.report import md_table
from jaxpar.labs.base.runner import Part, run_directory, run_parts, standalone_main
from jaxpar.labs.kernels.strategies import counting_batches, relative_error, strategy_agreement
from jaxpar.units import MIB

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
LOSS_TOLERANCE = 1e-4
KERNELS = ["model.attention=pallas", "model.norm=pallas", "model.loss=chunked"]
SMALL_BLOCKS = ["model.attention_block_q=16", "model.attention_block_kv=16", "model.loss_chunk=8"]


def _mib(x) -> str:
    return f"{x / MIB:.2f} MiB"


def _rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _grads(fn, args, cotangent):
    out = fn(*args)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent), tuple(range(len(args))))(*args)
    return (out, *grads)


# ============================================================================ a. agreement

def kernel_agreement() -> dict:
    """Every kernel against its reference: max relative error of the value and of each gradient."""
    from jaxpar.kernels.cross_entropy import chunked_cross_entropy, cross_entropy_reference
    from jaxpar.kernels.flash_attention import attention_reference, flash_attention
    from jaxpar.kernels.rms_norm import rms_norm, rms_norm_reference
    from jaxpar.model.ops import Ops

    rows: list[dict[str, Any]] = []
    cases = (("float32", (2, 40, 4, 2, 64), True), ("float32", (1, 48, 4, 1, 128), True),
             ("bfloat16", (1, 64, 4, 2, 128), True), ("bfloat16", (2, 40, 8, 2, 64), True),
             ("float32", (1, 40, 2, 2, 16), False))
    for dtype, (B, S, H, KV, Dh), causal in cases:
        dt = jnp.dtype(dtype)
        args = (_rand((B, S, H, Dh), dt, 0), _rand((B, S, KV, Dh), dt, 1), _rand((B, S, KV, Dh), dt, 2))
        cot = _rand((B, S, H, Dh), jnp.float32, 3)
        got = jax.jit(lambda *a: _grads(lambda *x: flash_attention(*x, causal=causal, block_q=16, block_k=32),  # noqa: B023 (called in this iteration)
                                        a, cot))(*args)  # noqa: B023 (called in this iteration)
        want = jax.jit(lambda *a: _grads(lambda *x: attention_reference(*x, causal=causal), a, cot))(*args)  # noqa: B023 (called in this iteration)
        errors = [relative_error(g, w) for g, w in zip(got, want)]
        rows.append({"kernel": f"flash attention ({'causal' if causal else 'not causal'})", "dtype": dtype,
                     "shape": f"B{B} S{S} H{H} KV{KV} Dh{Dh}", "parts": "out, dq, dk, dv", "errors": errors})
    for dtype, shape in (("float32", (4, 33, 96)), ("bfloat16", (3, 40, 256))):
        dt = jnp.dtype(dtype)
        norm_args = (_rand(shape, dt, 0), 1 + 0.1 * _rand(shape[-1:], jnp.float32, 1))
        cot = _rand(shape, jnp.float32, 2)
        got = jax.jit(lambda *a: _grads(lambda x, s: rms_norm(x, s, 1e-5), a, cot))(*norm_args)  # noqa: B023 (called in this iteration)
        want = jax.jit(lambda *a: _grads(lambda x, s: rms_norm_reference(x, s, 1e-5), a, cot))(*norm_args)  # noqa: B023 (called in this iteration)
        rows.append({"kernel": "fused RMSNorm", "dtype": dtype, "shape": "x".join(map(str, shape)),
                     "parts": "y, dx, dscale", "errors": [relative_error(g, w) for g, w in zip(got, want)]})
    x, head = _rand((2, 37, 16), jnp.float32, 0), _rand((16, 64), jnp.float32, 1)
    targets = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 37)), jnp.int32)
    pieces = lambda fn: jax.jit(jax.value_and_grad(lambda x, h: fn(x, h, targets, Ops()), (0, 1)))(x, head)
    (lg, gg), (lw, gw) = pieces(lambda *a: chunked_cross_entropy(*a, chunk=8)), pieces(cross_entropy_reference)
    rows.append({"kernel": "chunked cross-entropy (chunk 8)", "dtype": "float32", "shape": "B2 S37 D16 V64",
                 "parts": "loss, dx, dhead",
                 "errors": [relative_error(lg, lw), *(relative_error(g, w) for g, w in zip(gg, gw))]})
    for r in rows:
        r["tolerance"] = TOLERANCE[r["dtype"]]
        r["within"] = max(r["errors"]) <= r["tolerance"]
    table = md_table(["kernel", "dtype", "shape", "parts", "max rel. error (measured)", "tolerance", "within"],
                   [[r["kernel"], r["dtype"], r["shape"], r["parts"], ", ".join(f"{e:.1e}" for e in r["errors"]),
                     f"{r['tolerance']:.0e}", "yes" if r["within"] else "**NO**"] for r in rows])
    return {"rows": rows, "markdown": table}


def _strategy(overrides, devices, vocab):
    from jaxpar.parallel.registry import build_strategy
    config = load_config(None)
    apply_overrides(config, overrides)
    return build_strategy(config, devices, vocab)


def model_agreement(base: list[str], vocab: int, steps: int, log) -> dict:
    """Losses of the first `steps` steps with each attention choice and mesh vs the dot run on one device."""
    n = len(jax.devices())
    runs = [("dot", "one device", ["mesh.data=1"], 1), ("xla", "one device", ["mesh.data=1", "model.attention=xla"], 1),
            ("pallas + fused norm + chunked loss", "one device", ["mesh.data=1", *KERNELS], 1)]
    if n >= 8:
        runs += [("pallas + fused norm + chunked loss", "fsdp=8", ["mesh.data=1", "mesh.fsdp=8", *KERNELS], 8),
                 ("pallas + fused norm + chunked loss", "tensor=4 x data=2",
                  ["mesh.data=2", "mesh.tensor=4", *KERNELS], 8)]
    results: list[dict[str, Any]] = []
    for label, mesh, overrides, devices in runs:
        strategy = _strategy([*base, *overrides], jax.devices()[:devices], vocab)
        batches = counting_batches(strategy.config.train.batch_size, strategy.config.data.seq_len, vocab, steps)
        state, losses = strategy.init_state(), []
        start = time.perf_counter()
        for batch in batches:
            state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
            losses.append(float(metrics["loss"]))
        results.append({"ops": label, "mesh": mesh, "losses": losses, "seconds": time.perf_counter() - start})
        log(f"  {label} on {mesh}: {', '.join(f'{v:.5f}' for v in losses)}")
    oracle = results[0]["losses"]
    for r in results:
        r["max_rel_dev"] = relative_error(r["losses"], oracle) if r is not results[0] else 0.0
        r["within"] = r["max_rel_dev"] <= LOSS_TOLERANCE
    table = md_table(["ops", "mesh", "loss step 1", f"loss step {steps}", "max rel. deviation vs dot, one device",
                    "tolerance", "within"],
                   [[r["ops"], r["mesh"], f"{r['losses'][0]:.5f}", f"{r['losses'][-1]:.5f}", f"{r['max_rel_dev']:.1e}",
                     f"{LOSS_TOLERANCE:.0e}", "yes" if r["within"] else "**NO**"] for r in results])
    return {"runs": results, "markdown": table}


# ============================================================================ b. memory

def step_memory(overrides: list[str], vocab: int) -> dict:
    """Compiled temp bytes of one device's train step, and the strategy's prediction for it (jaxpar.parallel.memory,
    the dry run's and the planner's model: gradients + activations kept + working set)."""
    from jaxpar.measure.memory import compiled_memory
    from jaxpar.parallel.memory import config_memory

    strategy = _strategy(["mesh.data=1", *overrides], jax.devices()[:1], vocab)
    config, cfg = strategy.config, strategy.model_cfg
    compiled = strategy.lower_step().compile()
    sizes = {axis: int(size) for axis, size in strategy.mesh.shape.items()}
    ours = config_memory(config, cfg, sizes, "cpu")
    return {"temp": compiled_memory(compiled, "cpu").temp, "predicted": ours.total - ours.state,
            "activations": ours.activations, "grads": ours.gradients}


def memory(base: list[str], vocab: int, seq_lens, log) -> dict:
    rows = []
    for remat in ("none", "full"):
        for attention in ("dot", "pallas"):
            for s in seq_lens:
                overrides = [*base, f"data.seq_len={s}", f"model.max_seq_len={max(seq_lens)}", f"train.remat={remat}",
                             f"model.attention={attention}", "model.attention_block_q=64",
                             "model.attention_block_kv=64"]
                m = step_memory(overrides, vocab)
                rows.append({"attention": attention, "remat": remat, "seq_len": s, **m})
                log(f"  {attention:6s} remat {remat:4s} S={s}: temp {_mib(m['temp'])} "
                    f"(predicted {_mib(m['predicted'])})")
    table = md_table(["attention", "remat", "S", "temp (compiled)",
                      "temp: jaxpar's prediction (grads + activations + working set)", "ratio"],
                   [[r["attention"], r["remat"], r["seq_len"], _mib(r["temp"]), _mib(r["predicted"]),
                     f"{r['temp'] / r['predicted']:.2f}"] for r in rows])
    quadratic = []
    for remat in ("none", "full"):
        for attention in ("dot", "pallas"):
            own = [r for r in rows if r["attention"] == attention and r["remat"] == remat]
            # the prediction's own S² coefficient, fitted through the same three lengths
            predicted = _s2_coefficient([{"seq_len": r["seq_len"], "temp": r["predicted"]} for r in own])
            quadratic.append({"attention": attention, "remat": remat, "measured": _s2_coefficient(own),
                              "predicted": predicted, "growth": own[-1]["temp"] / own[0]["temp"]})
    span = seq_lens[-1] / seq_lens[0]
    fit = md_table(["attention", "remat", f"temp growth over S x{span:.0f}", "S² coefficient, fitted (bytes/S²)",
                  "S² coefficient, jaxpar's prediction", "ratio"],
                 [[q["attention"], q["remat"], f"{q['growth']:.2f}x", f"{q['measured']:.1f}", f"{q['predicted']:.0f}",
                   f"{q['measured'] / q['predicted']:.2f}" if abs(q["predicted"]) > 1e-6 else "-"] for q in quadratic])
    note = ("The S² coefficient is fitted exactly through the three lengths (temp = α + β·S + γ·S²): the dot "
            "attention's γ is the [S, S] scores and probabilities kept for the backward pass; flash attention's "
            "is ~0 (what is left grows linearly). jaxpar's prediction is the strategy's memory model "
            "(jaxpar.parallel.memory), fitted on XLA:GPU bf16 compiles (its fixed 0.95 GB of XLA:GPU buffers is "
            "charged on GPU only): in fp32 on CPU it is not calibrated, and its ratios are reported as they come.")
    return {"rows": rows, "quadratic": quadratic, "markdown": table + "\n\n" + fit + "\n\n" + note}


def _s2_coefficient(rows) -> float:
    """γ of temp = α + β·S + γ·S² through the first, middle and last measurements (bytes per S²)."""
    (s1, t1), (s2, t2), (s3, t3) = [(r["seq_len"], r["temp"]) for r in (rows[0], rows[len(rows) // 2], rows[-1])]
    return ((t3 - t2) / (s3 - s2) - (t2 - t1) / (s2 - s1)) / (s3 - s1)


def loss_memory(base: list[str], vocab: int, log) -> dict:
    """The train step with full vs chunked cross-entropy on a config where the logits dominate."""
    out, chunk = {}, 16
    for loss in ("full", "chunked"):
        out[loss] = step_memory([*base, f"model.loss={loss}", f"model.loss_chunk={chunk}"], vocab)
        log(f"  loss {loss}: temp {_mib(out[loss]['temp'])}")
    probe = _strategy(["mesh.data=1", *base], jax.devices()[:1], vocab)
    B, S = probe.config.train.batch_size, probe.config.data.seq_len
    logits_bytes = B * S * vocab * 4
    saved = out["full"]["temp"] - out["chunked"]["temp"]
    # fp32 logits and their gradient, less one chunk's, less the head input's gradient the chunked loss keeps
    predicted = 2 * 4 * B * vocab * (S - min(chunk, S)) - 4 * B * S * probe.model_cfg.d_model
    table = md_table(["", "bytes"], [
        ["[B, S, V] fp32 logits", _mib(logits_bytes)],
        ["temp, full logits (compiled)", _mib(out["full"]["temp"])],
        ["temp, chunked (compiled)", _mib(out["chunked"]["temp"])],
        ["saved (measured)", f"{_mib(saved)} = {saved / logits_bytes:.2f} x the logits"],
        ["saved (predicted: logits + their gradient - one chunk's - dx kept)", _mib(predicted)],
        ["measured / predicted", f"{saved / predicted:.2f}"]])
    return {"B": B, "S": S, "V": vocab, "logits_bytes": logits_bytes, "temp": {k: v["temp"] for k, v in out.items()},
            "saved": saved, "predicted_saved": predicted, "done": saved >= 0.5 * logits_bytes, "markdown": table}


# ============================================================================ c. compilation

def compilation(devices: int, depths, log) -> dict:
    from jaxpar.measure.compilation import loss_and_grad_compile, step_compile_in_fresh_process
    from jaxpar.model.transformer import ModelConfig

    with tempfile.TemporaryDirectory(prefix="jaxpar-cache-") as cache:
        cold = step_compile_in_fresh_process(None, [f"mesh.data={devices}"], cache, devices=devices)
        warm = step_compile_in_fresh_process(None, [f"mesh.data={devices}"], cache, devices=devices)
    log(f"  default step, data={devices}: cold {cold['compile_s']:.2f} s, warm {warm['compile_s']:.2f} s")
    config = load_config(None)
    depth_rows = []
    for layers in depths:
        apply_overrides(config, [f"model.layers={layers}"])
        cfg = ModelConfig.from_config(config.model, 1024)
        for unrolled in (False, True):
            t = loss_and_grad_compile(cfg, batch=4, seq_len=config.data.seq_len, unrolled=unrolled)
            depth_rows.append({"layers": layers, "unrolled": unrolled, **t})
            log(f"  {layers} layers {'unrolled' if unrolled else 'scanned '}: compile {t['compile_s']:.2f} s")
    cache_md = md_table(["default config step", "trace + lower (s)", "XLA compile (s)", "cache files after"], [
        ["cold (empty cache)", f"{cold['lower_s']:.2f}", f"{cold['compile_s']:.2f}", cold["cache_files_after"]],
        ["warm (fresh process, same cache)", f"{warm['lower_s']:.2f}", f"{warm['compile_s']:.2f}",
         warm["cache_files_after"]],
        ["warm / cold", f"{warm['lower_s'] / cold['lower_s']:.2f}",
         f"{warm['compile_s'] / cold['compile_s']:.3f}", ""]])
    depth_md = md_table(["layers", "scanned: compile (s)", "unrolled: compile (s)", "unrolled / scanned",
                       "HLO text scanned / unrolled (KiB)"],
                      [[L, f"{s['compile_s']:.2f}", f"{u['compile_s']:.2f}", f"{u['compile_s'] / s['compile_s']:.2f}",
                        f"{s['hlo_bytes'] / 1024:.0f} / {u['hlo_bytes'] / 1024:.0f}"]
                       for L in depths for s in depth_rows if s["layers"] == L and not s["unrolled"]
                       for u in depth_rows if u["layers"] == L and u["unrolled"]])
    return {"cold": cold, "warm": warm, "depth": depth_rows,
            "markdown": cache_md + "\n\nCompile time of value_and_grad of the loss vs depth (default config "
                                   "dims, batch 4):\n\n" + depth_md}


# ============================================================================ d. GPU tables

def gpu_tables(results_dir: str | None) -> dict:
    if not results_dir:
        return {"measured": False, "markdown": "Open: no GPU was lent for this run. `benchmarks/attention.py` and "
                                               "`benchmarks/mfu.py` are prepared for one short call on a GPU; pass "
                                               "their --out directory as --gpu-results to put their tables here."}
    parts = []
    for name in ("attention.md", "mfu.md"):
        path = Path(results_dir) / name
        parts.append(path.read_text() if path.is_file() else f"({name} missing in {results_dir})")
    return {"measured": True, "markdown": "\n\n".join(parts)}


# ============================================================================ plots

VARIANTS = ((("dot", "none"), "#c44e52"), (("pallas", "none"), "#4c72b0"), (("dot", "full"), "#dd8452"),
            (("pallas", "full"), "#55a868"))


@styled
def plot_memory(result: dict, path: Path):
    """Train-step temp against S for each attention x remat: compiled (solid) beside jaxpar's prediction (dashed),
    in MiB like the lab's tables."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    fig = figure(8, 5.8)
    ax = fig.add_subplot()
    for (attention, remat), color in VARIANTS:
        rows = [r for r in result["rows"] if r["attention"] == attention and r["remat"] == remat]
        s = [r["seq_len"] for r in rows]
        name = "flash (Pallas)" if attention == "pallas" else "dot (XLA)"
        ax.plot(s, [r["temp"] / MIB for r in rows], "o-", color=color, label=f"{name}, remat {remat}")
        ax.plot(s, [r["predicted"] / MIB for r in rows], "--", color=color, alpha=0.7)
    ax.plot([], [], "k-", label="solid: compiled temp")
    ax.plot([], [], "k--", label="dashed: jaxpar's prediction (fitted on XLA:GPU bf16)")
    ax.set(xlabel="sequence length S", ylabel="temp per device (MiB)", xscale="log", yscale="log",
           title="Train step temp: dot vs flash attention (attention x remat)")
    ax.set_xticks(sorted({r["seq_len"] for r in result["rows"]}))
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    legend_below(ax, ncols=2, gap=0.16)
    return save(fig, path)


@styled
def plot_compile(result: dict, path: Path):
    fig = figure(7, 4.8)
    ax = fig.add_subplot()
    rows = result["depth"]
    for unrolled, label in ((False, "layer scan: one layer compiled, looped"),
                            (True, "unrolled: every layer compiled")):
        own = [r for r in rows if r["unrolled"] == unrolled]
        ax.plot([r["layers"] for r in own], [r["compile_s"] for r in own], "o-", label=label)
    ax.set(xlabel="layers", ylabel="XLA compile time (s, measured)", title="Compile time vs depth")
    ax.set_xticks(sorted({r["layers"] for r in rows}))
    legend_below(ax, gap=0.16)
    return save(fig, path)


PLOTS = {"memory.png": ("memory", plot_memory), "compile.png": ("compilation", plot_compile)}


# ============================================================================ the whole lab

QUICK_LAYOUTS = ("1f1b, pipe=4",)   # --quick: the kernels inside a pipeline schedule (the tests run zero3)


def run_lab(out=None, *, steps: int = 5, seq_lens=(128, 256, 512), depths=(2, 4, 8, 16),
            gpu_results: str | None = None, quick: bool = False, log=print) -> dict:
    if steps < 1:
        raise ConfigError("--steps", f"is {steps}; must be at least 1")
    if len(seq_lens) < 3 or any(s < 16 for s in seq_lens) or sorted(set(seq_lens)) != list(seq_lens):
        raise ConfigError("--seq-lens", f"{seq_lens}: give at least three increasing lengths >= 16")
    if gpu_results and not Path(gpu_results).is_dir():
        raise ConfigError("--gpu-results", f"'{gpu_results}' is not a directory written by the benchmarks' --out")
    start = time.perf_counter()
    out = run_directory(out, "kernels", log=log)
    devices = jax.devices()
    tiny = ["train.warmup_steps=1", "model.d_model=64", "model.layers=2", "model.heads=4", "model.kv_heads=4",
            "model.mlp_dim=128", "model.max_seq_len=64", "data.seq_len=32", "train.batch_size=16"]
    results = {"devices": len(devices), "platform": devices[0].platform, "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d")}
    header = [f"# Lab 08: fused kernels and compilation, {len(devices)} x {devices[0].platform}",
              (f"jax {jax.__version__}, {results['date']}; Pallas kernels interpreted on CPU. Measured values come "
               "from the compiled programs and the clock, predictions from the formulas named beside them.")]
    parts = [
        Part("agreement: kernels", lambda: kernel_agreement(), "agreement_kernels",
             "## a. Numerical agreement: kernels vs pure-jnp references"),
        Part("agreement: model", lambda: model_agreement([*tiny, *SMALL_BLOCKS], 512, steps, log), "agreement_model",
             "## a. Numerical agreement: the model, 5 steps, fp32"),
        Part("agreement: strategies",
             lambda: strategy_agreement([*tiny, *SMALL_BLOCKS, "model.layers=4"], 512, steps, LOSS_TOLERANCE, log,
                                        QUICK_LAYOUTS if quick else None),
             "agreement_strategies", "## a. The kernels inside every hand-written strategy (4 layers), fp32"),
        Part("memory", lambda: memory([*tiny, "train.batch_size=2"], 512, list(seq_lens), log), None,
             "## b. Activation memory: dot vs flash attention (train step temp, one device, fp32)"),
        Part("loss memory", lambda: loss_memory([*tiny, "data.seq_len=128", "model.max_seq_len=128",
                                                 "train.batch_size=8"], 16384, log), "loss_memory",
             "## b. Chunked cross-entropy memory"),
        Part("compilation", lambda: compilation(min(8, len(devices)), list(depths), log), None,
             "## c. Compilation: persistent cache and depth"),
        Part("gpu", lambda: gpu_tables(gpu_results), None, "## d. GPU benchmarks")]
    return run_parts("kernels", out, parts, results, header, PLOTS, start=start, log=log)


def _ints(text: str, field: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(field, f"'{text}' is not a comma-separated list of integers") from None


def run_from_args(args) -> int:
    run_lab(args.out, steps=args.steps, seq_lens=_ints(args.seq_lens, "--seq-lens"),
            depths=_ints(args.depths, "--depths"), gpu_results=args.gpu_results, quick=args.quick)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/*/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

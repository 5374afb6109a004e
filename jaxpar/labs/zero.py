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
import copy
import dataclasses
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, load_config, model_vocab_size, to_json
from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs import report
from jaxpar.labs.arguments import zero as add_arguments
from jaxpar.labs.report import max_rel_dev, md_table, standalone_main, write_report
from jaxpar.parallel.zero import STAGE_NAMES
from jaxpar.units import byte_unit, fmt_bytes, ratio

TOLERANCE = 1e-4          # max relative loss deviation from the oracle (tests/test_zero.py uses the same)
REMATS = ("none", "full", "dots", "names")
PRECISIONS = (("float32", "fp32"), ("bfloat16", "bf16 (fp32 master weights)"), ("float8", "fp8"))
MANUAL = ("ddp", "zero1", "zero2", "zero3")


# ============================================================================ building and running one step

@dataclasses.dataclass
class Built:
    """One strategy's trainer and its compiled step (compiled once: run, timed and inspected)."""

    key: str
    label: str
    config: object
    trainer: object
    compiled: object
    compile_s: float
    sizes: dict

    @property
    def hlo(self) -> str:
        return self.compiled.as_text()


class Lab:
    def __init__(self, config, devices, out: Path, log=print):
        from jaxpar.data.pipeline import build_token_data, train_dataset
        from jaxpar.model.counting import param_count
        from jaxpar.model.transformer import ModelConfig

        self.base, self.devices, self.n, self.out, self.log = config, devices, len(devices), out, log
        self.platform = devices[0].platform
        self.data = build_token_data(config.data)
        self.model_cfg = ModelConfig.from_config(config.model, model_vocab_size(config, self.data.stats["vocab_size"], 1))
        self.counts = param_count(self.model_cfg)
        self.psi = self.counts["total"]
        B = config.train.batch_size
        self._stream = iter(train_dataset(self.data.train, B, config.data.shuffle_seed, slice(0, B)))
        self._batches: list[np.ndarray] = []
        self.builds: dict[tuple, Built] = {}
        self._initial = None
        self._strategies: list[Built] | None = None

    def batches(self, count: int) -> list[np.ndarray]:
        """The first `count` training batches: the same list for every strategy and precision."""
        while len(self._batches) < count:
            self._batches.append(np.asarray(next(self._stream)))
        return self._batches[:count]

    def variant(self, key: str, *, impl="auto", data=1, fsdp=1, remat=None, dtype="float32", layers=None) -> Built:
        """Configure, build and compile one strategy (cached by its settings); `impl` is parallel.data."""
        from jaxpar.mesh import make_mesh
        from jaxpar.model.transformer import ModelConfig
        from jaxpar.parallel.registry import make_trainer

        remat = remat or self.base.train.remat
        layers = layers or self.base.model.layers
        settings = (impl, data, fsdp, remat, dtype, layers, jax.config.jax_default_matmul_precision)
        if settings in self.builds:
            return self.builds[settings]
        config = copy.deepcopy(self.base)
        apply_overrides(config, [f"parallel.data={impl}", f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                                 "mesh.pipe=1", "mesh.expert=1", "mesh.tensor=1", f"model.layers={layers}",
                                 f"train.remat={remat}", f"train.compute_dtype={dtype}"])
        mesh = make_mesh(config, self.devices[:data * fsdp])
        model_cfg = ModelConfig.from_config(config.model, self.model_cfg.vocab_size)
        trainer = make_trainer(config, model_cfg, mesh)
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = trainer.lower_step().compile()
        built = Built(key, _label(impl, data, fsdp), config, trainer, compiled, time.perf_counter() - start,
                      {name: int(size) for name, size in mesh.shape.items()})
        self.log(f"  compiled {built.label} (remat {remat}, {dtype}) in {built.compile_s:.1f} s")
        self.builds[settings] = built
        return built

    def initial_state(self, built: Built):
        """The initial train state in `built`'s layout. Every trainer initialises the same values (same
        seed, same init), so it is made once, kept on the host and placed per layout: one init
        compile instead of one per strategy."""
        if self._initial is None:
            self._initial = jax.device_get(built.trainer.init_state())
        return jax.device_put(self._initial, built.trainer.state_shardings)

    def run(self, built: Built, batches) -> tuple[list[float], list[float]]:
        """Train from the initial state over `batches`: per-step losses and step times (blocked)."""
        state = self.initial_state(built)
        losses, times = [], []
        with jax.set_mesh(built.trainer.mesh):
            for batch in batches:
                tokens = jax.device_put(batch, built.trainer.batch_sharding)
                start = time.perf_counter()
                state, metrics = built.compiled(state, tokens)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
                losses.append(float(metrics["loss"]))
        del state
        return losses, times

    def manual(self, impl: str, **settings) -> Built:
        return self.variant(impl, impl=impl, data=self.n, **settings)

    def strategies(self) -> list[Built]:
        """single device (the oracle), auto data=N, auto fsdp=N, manual DDP and ZeRO-1/2/3: the executables
        of part a (made there, on accelerators at matmul precision 'highest'), which parts b and c read."""
        if self._strategies is None:
            self._strategies = [self.variant("single"), self.variant("auto-data", data=self.n),
                                self.variant("auto-fsdp", fsdp=self.n), *(self.manual(s) for s in MANUAL)]
        return self._strategies


def _label(impl, data, fsdp) -> str:
    if impl != "auto":
        return f"manual {STAGE_NAMES[impl]}"
    if data * fsdp == 1:
        return "single device"
    return f"auto data={data}" if data > 1 else f"auto fsdp={fsdp}"


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
    runs = {}
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
        activation_estimate,
        compiled_memory,
        gradient_held,
        shard_counts,
        state_bytes,
        zero_formula,
    )

    rows = {}
    for built in lab.strategies():
        cfg, sizes, trainer = built.config, built.sizes, built.trainer
        shards = shard_counts(cfg, sizes)
        formula = zero_formula(lab.psi, shards)            # jaxpar's dtypes: fp32 params 4, grads 4, Adam 8
        # what the compiled executable takes in, leaf by leaf: its input shardings x the global shapes
        in_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                trainer.abstract_state, built.compiled.input_shardings[0][0])
        compiled_state = state_bytes(in_state)
        mem = compiled_memory(built.compiled, lab.platform)
        batch_bytes = cfg.train.batch_size // (sizes["data"] * sizes["fsdp"]) * (cfg.data.seq_len + 1) * 4
        micro = cfg.train.batch_size // cfg.train.microbatches // (sizes["data"] * sizes["fsdp"])
        acts = activation_estimate(layers=lab.model_cfg.layers, seq_len=cfg.data.seq_len, micro_batch=micro,
                                   d_model=lab.model_cfg.d_model, heads=lab.model_cfg.heads,
                                   vocab_size=lab.model_cfg.vocab_size, compute_bytes=4, remat=cfg.train.remat)
        rows[built.key] = {
            "label": built.label, "shards": shards, "formula": formula, "compiled_state": compiled_state,
            "compiled": mem.as_dict(), "batch_bytes": batch_bytes, "activations_estimate": acts["total"],
            "arguments_check": compiled_state["state_total"] + batch_bytes == mem.argument,
            "temp_predicted": formula["grads"] + acts["total"],
        }
    state_rows, temp_rows = [], []
    for r in rows.values():
        f, c, m = r["formula"], r["compiled_state"], r["compiled"]
        s = r["shards"]
        state_rows.append([r["label"], f"{s['params']} / {s['grads']} / {s['optimizer']}",
                           fmt_bytes(f["params"]), fmt_bytes(c["params"]), ratio(c["params"], f["params"]),
                           fmt_bytes(f["optimizer"]), fmt_bytes(c["optimizer"]), ratio(c["optimizer"], f["optimizer"]),
                           fmt_bytes(m["argument"]), "yes" if r["arguments_check"] else "**no**"])
        temp_rows.append([r["label"], fmt_bytes(f["grads"]), fmt_bytes(r["activations_estimate"]), fmt_bytes(r["temp_predicted"]),
                          fmt_bytes(m["temp"]), ratio(m["temp"], r["temp_predicted"]), fmt_bytes(m["peak"])])
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
        "Gradients are not arguments: they live in the step's temporaries, with the activations. Predicted "
        "temp = grads (4Ψ / grad shards) + activations (Korthikanti et al., adapted: an estimate, fp32).",
        "",
        md_table(["strategy", "grads: formula", "activations: estimate", "temp: predicted", "temp: compiled",
                "ratio", "peak (compiled)"], temp_rows),
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
    rows = [[f"manual {STAGE_NAMES[s]}", fmt_bytes(mem[s].argument), fmt_bytes(mem[s].output), fmt_bytes(mem[s].temp), fmt_bytes(mem[s].peak),
             fmt_bytes(held[s])] for s in built]
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


# ============================================================================ c. communication

def _by_op(found) -> dict:
    out = defaultdict(lambda: {"instructions": 0, "runs": 0, "bytes": 0.0})
    for c in found:
        out[c.op]["instructions"] += 1
        out[c.op]["runs"] += c.runs_per_step
        out[c.op]["bytes"] += c.bytes_per_step
    return dict(out)


_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^)]*\)|\S+)\s+([\w\-]+)\((.*)$")


def reduce_then_slice(hlo_text: str, runs: dict[str, int] | None = None) -> dict:
    """Gradient all-reduces whose result is only sliced afterwards: a reduce-scatter spelled all-reduce + slice.

    For every non-scalar buffer an all-reduce produces (tuple elements through their
    get-tuple-element), look at its users: a user that keeps fewer elements and
    slices (a dynamic-slice, directly or inside the fusion it calls) means the device
    summed the whole buffer and kept a piece of it. `runs`: instruction name -> runs per
    step (`hlo.collectives`), to count the sliced bytes per step.
    """
    from jaxpar.measure.hlo import dtype_bytes, parse_shapes

    computations, current = {}, None
    instrs, users = {}, defaultdict(list)
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s", line)
            current = m.group(1) if m and line.rstrip().endswith("{") else None
            if current:
                computations[current] = []
            continue
        if current:
            computations[current].append(line)
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        operands = rest.split("metadata=")[0]
        instrs[name] = (shape, op, line, operands)
        for operand in re.findall(r"%([\w.\-]+)", operands):
            users[operand].append(name)
    slicing = {name for name, body in computations.items() if any("dynamic-slice(" in b for b in body)}

    def elements(shape):
        return sum(int(np.prod(d, dtype=np.int64)) for _, d in parse_shapes(shape))

    def is_slice(user, size):
        shape, op, _, operands = instrs[user]
        calls = re.search(r"calls=%?([\w.\-]+)", operands)
        sliced = op == "dynamic-slice" or (op == "fusion" and calls and calls.group(1) in slicing)
        return sliced and elements(shape) < size

    reduced, sliced, sliced_bytes, example, whole = 0, 0, 0.0, None, []
    for name, (shape, op, line, _) in instrs.items():
        if op not in ("all-reduce", "all-reduce-start"):
            continue
        parts = parse_shapes(shape)
        if len(parts) == 1:
            buffers = [(name, parts[0])]
        else:
            buffers = []
            for user in users[name]:
                index = re.search(r"index=(\d+)", instrs[user][3])
                if instrs[user][1] == "get-tuple-element" and index:
                    buffers.append((user, parts[int(index.group(1))]))
        for buffer, (dtype, dims) in buffers:
            size = int(np.prod(dims, dtype=np.int64))
            if size <= 1:
                continue
            reduced += 1
            cut = [u for u in users[buffer] if is_slice(u, size)]
            if not cut:
                whole.append(f"{dtype}[{','.join(map(str, dims))}]")
            else:
                sliced += 1
                sliced_bytes += size * dtype_bytes(dtype) * (runs or {}).get(name, 1)
                if example is None or size > example["elements"]:
                    example = {"elements": size, "all_reduce": _short(line), "user": _short(instrs[cut[0]][2])}
    reduce_scatters = sum(1 for shape, op, _, _ in instrs.values() if op in ("reduce-scatter", "reduce-scatter-start"))
    return {"all_reduced_buffers": reduced, "then_sliced": sliced, "sliced_bytes": sliced_bytes,
            "reduce_scatter_instructions": reduce_scatters, "example": example, "kept_whole": whole}


def _short(line: str, width: int = 230) -> str:
    text = re.sub(r",\s*metadata=\{.*$", "", line.strip())
    text = re.sub(r"/\*index=\d+\*/", "", text)
    return text if len(text) <= width else text[:width] + " ..."


def communication(lab: Lab) -> dict:
    from jaxpar.measure.hlo import collectives
    from jaxpar.parallel.registry import predicted_collective_bytes

    n = lab.n
    ring = (n - 1) / n
    W = 4 * lab.psi                                       # fp32 bytes of all params
    course = {"single": (0, "0"), "auto-data": (2, "2Ψ"), "ddp": (2, "2Ψ"), "zero1": (2, "2Ψ"),
              "zero2": (2, "2Ψ"), "zero3": (3, "3Ψ"), "auto-fsdp": (3, "3Ψ")}
    written = {"single": "none", "ddp": "all-reduce 2Ψ", "zero1": "reduce-scatter Ψ once + all-gather Ψ",
               "zero2": "reduce-scatter Ψ per layer + all-gather Ψ",
               "zero3": "3Ψ_layers + 2Ψ_rest (embed/head gathered once)",
               "auto-data": "dryrun: all-reduce 2Ψ",
               "auto-fsdp": "dryrun: gathers 2Ψ_L + head, the embedding looked up in place (tokens gathered, "
                            "activations all-to-all), " + ("all-reduce + slice 2(Ψ − embedding)" if lab.platform == "cpu"
                                                           else "reduce-scatter Ψ − embedding")}
    rows, found_by = {}, {}
    for built in lab.strategies():
        found = collectives(built.hlo, built.trainer.mesh)
        found_by[built.key] = found
        ops = _by_op(found)
        pred = predicted_collective_bytes(built.config, lab.model_cfg, built.sizes, lab.platform)
        factor, theory_text = course[built.key]
        rows[built.key] = {"label": built.label, "by_op": ops, "compiled_bytes": sum(o["bytes"] for o in ops.values()),
                           "course_bytes": factor * ring * W, "course": theory_text,
                           "written_bytes": sum(pred.values()), "written": written[built.key]}
    table = []
    for r in rows.values():
        ops = ", ".join(f"{op} x{o['runs']}" for op, o in sorted(r["by_op"].items())) or "none"
        table.append([r["label"], ops, fmt_bytes(r["compiled_bytes"]), f"{r['course']} = {fmt_bytes(r['course_bytes'])}",
                      ratio(r["compiled_bytes"], r["course_bytes"]), f"{r['written']} = {fmt_bytes(r['written_bytes'])}",
                      ratio(r["compiled_bytes"], r["written_bytes"])])
    auto_fsdp = next(b for b in lab.strategies() if b.key == "auto-fsdp")
    xla = reduce_then_slice(auto_fsdp.hlo,
                            {c.name: c.runs_per_step for c in found_by["auto-fsdp"]})
    auto, hand = rows["auto-fsdp"]["by_op"], rows["zero3"]["by_op"]
    side = []
    for op in sorted(set(auto) | set(hand)):
        a, h = auto.get(op), hand.get(op)
        side.append([op, *(f"{x['instructions']} / {x['runs']} / {fmt_bytes(x['bytes'])}" if x else "-" for x in (a, h))])
    side.append(["**total**", fmt_bytes(rows["auto-fsdp"]["compiled_bytes"]), fmt_bytes(rows["zero3"]["compiled_bytes"])])
    if xla["then_sliced"]:
        chose = (f"XLA's SPMD partitioner on {lab.platform} reduced {xla['all_reduced_buffers']} gradient-sized "
                 f"buffers with all-reduce, and {xla['then_sliced']} of them ({fmt_bytes(xla['sliced_bytes'])} per step) are "
                 "only sliced afterwards: each device sums the *whole* gradient of a weight and keeps its 1/N "
                 "(a dynamic-slice at an offset from partition-id, fused into the next op). That is a "
                 "reduce-scatter spelled all-reduce + slice, and it costs 2(N-1)/N instead of (N-1)/N of the "
                 f"buffer. The other {xla['all_reduced_buffers'] - xla['then_sliced']} "
                 f"({', '.join(sorted(set(xla['kept_whole'])))}) are kept whole: gradients of replicated "
                 "parameters (the norm scales, which jaxpar's rules do not shard). "
                 f"The compiled program has {xla['reduce_scatter_instructions']} reduce-scatter "
                 "instructions, although XLA:CPU runs them fine: the manual ZeRO-3 asks for them explicitly "
                 "(psum_scatter) and gets them.")
    else:
        chose = (f"No all-reduce + slice pattern found; the compiled program has "
                 f"{xla['reduce_scatter_instructions']} reduce-scatter instructions (XLA:GPU's partitioner "
                 "turns all-reduce + dynamic-slice into reduce-scatter).")
    excerpt = []
    if xla["example"]:
        excerpt = ["", "The largest such pair in the auto FSDP HLO (metadata cut):", "", "```",
                   xla["example"]["all_reduce"], xla["example"]["user"], "```"]
    md = "\n".join([
        f"## c. Communication per device per step (ring model, fp32 on the wire, N = {n})",
        "",
        f"Ψ = {lab.psi:,} params = {fmt_bytes(W)} in fp32; scanned layers Ψ_L = {lab.counts['blocks']:,}, "
        f"the rest (embedding, head, final norm) Ψ_o = {lab.psi - lab.counts['blocks']:,}. "
        "Course theory: DDP, ZeRO-1, ZeRO-2 ≈ 2Ψ, ZeRO-3 ≈ 3Ψ, times (N-1)/N x 4 bytes. "
        "'As written' is what jaxpar's code does (zero.py's docstring; the auto rows from "
        "the strategy's `predict`).",
        "",
        md_table(["strategy", "collectives (runs/step)", "compiled", "course theory", "ratio",
                "jaxpar as written", "ratio"], table),
        "",
        "ZeRO-1 and ZeRO-2 send the same bytes (the paper's P_os and P_os+g); ZeRO-1 reduce-scatters once after "
        "the backward pass, ZeRO-2 inside it, layer by layer (the memory part shows what that saves).",
        "",
        "### What XLA chose for you: automatic FSDP beside the hand-written ZeRO-3",
        "",
        "instructions / runs per step / bytes per device per step:",
        "",
        md_table(["op", f"auto fsdp={n}", "manual ZeRO-3"], side, "lrr"),
        "",
        chose,
        *excerpt,
    ])
    return {"rows": rows, "xla_auto_fsdp": xla, "markdown": md}


# ============================================================================ d. activation checkpointing

def remat(lab: Lab, repeats: int) -> dict:
    """remat none/full/dots/names on the auto FSDP step: temp bytes, FLOPs, interleaved step times."""
    from jaxpar.measure.flops import compiled_flops
    from jaxpar.measure.memory import activation_estimate, compiled_memory

    builts = {policy: lab.variant("auto-fsdp", fsdp=lab.n, remat=policy) for policy in REMATS}
    batch = lab.batches(1)[0]
    any_built = builts["none"]
    state = lab.initial_state(any_built)                 # the same shardings for all four: one state goes round
    tokens = jax.device_put(batch, any_built.trainer.batch_sharding)
    times = {p: [] for p in REMATS}
    with jax.set_mesh(any_built.trainer.mesh):
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
        acts = activation_estimate(layers=lab.model_cfg.layers, seq_len=cfg.data.seq_len, micro_batch=micro,
                                   d_model=lab.model_cfg.d_model, heads=lab.model_cfg.heads,
                                   vocab_size=lab.model_cfg.vocab_size, compute_bytes=4, remat=policy)
        rows[policy] = {"temp": mem.temp, "activations_estimate": acts["total"], "estimate_note": acts["note"],
                        "flops": flops, "step_ms": 1e3 * statistics.median(times[policy]),
                        "times_ms": [1e3 * t for t in times[policy]]}
    base = rows["none"]
    table = [[p, fmt_bytes(r["temp"]), ratio(r["temp"], base["temp"]), fmt_bytes(r["activations_estimate"]),
              ratio(r["temp"] - base["temp"], r["activations_estimate"] - base["activations_estimate"])
              if p == "full" else "-",
              f"{r['flops']:.3g}", ratio(r["flops"], base["flops"]), f"{r['step_ms']:.1f}",
              ratio(r["step_ms"], base["step_ms"])] for p, r in rows.items()]
    md = "\n".join([
        f"## d. Activation checkpointing (auto fsdp={lab.n}, fp32, {repeats} interleaved steps per policy)",
        "",
        md_table(["remat", "temp (compiled)", "vs none", "activations: estimate",
                "Δtemp / Δestimate", "FLOPs/device (compiled, loop-corrected)", "predicted time ratio (FLOPs)",
                "step ms (median, measured)", "measured time ratio"], table),
        "",
        "Predicted time ratio = compiled FLOPs / those of remat none (recomputation is extra FLOPs); "
        "measured = median step time / that of none, with the four policies run in turn so that load on "
        "the machine hits them alike. No pass/fail: small steps on CPU are dominated by fixed overheads. "
        f"Estimate: {rows['full']['estimate_note']}; 'dots'/'names' are not modelled (no-remat upper bound). "
        f"'names' saves {cfg.train.remat_names}.",
    ])
    return {"repeats": repeats, "rows": rows, "markdown": md}


# ============================================================================ e. mixed precision

def precision(lab: Lab, steps: int, wanted: list[str] | None) -> dict:
    from jaxpar.measure.memory import activation_estimate, compiled_memory, zero_formula
    from jaxpar.parallel.step import activation_dtype

    chosen = [(dtype, label) for dtype, label in PRECISIONS if wanted is None or dtype in wanted]
    batches = lab.batches(steps)
    runs = {}
    for dtype, label in chosen:
        built = lab.variant("auto-fsdp", fsdp=lab.n, dtype=dtype)
        losses, times = lab.run(built, batches)
        mem = compiled_memory(built.compiled, lab.platform)
        cfg = built.config
        # activations are stored in the compute dtype; float8 keeps bfloat16 activations (FP8 only inside matmuls)
        acts = activation_estimate(layers=lab.model_cfg.layers, seq_len=cfg.data.seq_len,
                                   micro_batch=cfg.train.batch_size // cfg.train.microbatches // lab.n,
                                   d_model=lab.model_cfg.d_model, heads=lab.model_cfg.heads,
                                   vocab_size=lab.model_cfg.vocab_size,
                                   compute_bytes=np.dtype(activation_dtype(dtype)).itemsize,
                                   remat=cfg.train.remat)["total"]
        formula = zero_formula(lab.psi, {"params": lab.n, "grads": lab.n, "optimizer": lab.n})
        runs[dtype] = {"label": label, "losses": losses, "step_ms": _median_ms(times), "argument": mem.argument,
                       "temp": mem.temp, "state_formula": formula["state"],
                       "temp_predicted": formula["grads"] + acts}
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
                "predicted grads + activations", "ratio", "step ms (median)", "vs fp32"], table),
        "",
        "The stored state is the same in every precision (fp32 master params and Adam moments: 12Ψ/N); the "
        "compute dtype changes only the temporaries. Predicted temp counts activations at 4 bytes (fp32) or "
        "2 (bf16; float8 keeps bf16 activations and casts to fp8 inside the matmuls). XLA:CPU keeps some bf16 "
        "work in fp32 and has no fp8 matmul units, so only a GPU run says what the dtypes save.",
    ])
    return {"steps": steps, "runs": runs, "markdown": md}


# ============================================================================ plots

def plot_equivalence(result: dict, path: Path):
    return report.plot_equivalence(path, [(r["label"], r["losses"], None if key == "single" else
                                           result["runs"]["single"]["label"]) for key, r in result["runs"].items()],
                                   result["tolerance"])


def _strategy_ticks(ax, rows) -> None:
    ax.set_xticks(np.arange(len(rows)), [r["label"].replace("manual ", "").replace(" ", "\n", 1) for r in rows])


@styled
def plot_memory(result: dict, path: Path):
    """Per strategy, the prediction (solid) beside the compiled step (hatched): state and temporaries."""
    rows = list(result["rows"].values())
    state = np.array([r["formula"]["params"] + r["formula"]["optimizer"] for r in rows])
    temp = np.array([r["temp_predicted"] for r in rows])
    args = np.array([r["compiled"]["argument"] for r in rows])
    ctemp = np.array([r["compiled"]["temp"] for r in rows])
    unit, scale = byte_unit([*(state + temp), *(args + ctemp)])
    fig = figure(10, 5.6)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.38
    ax.bar(x - w / 2, state / scale, w, color="#4c72b0", label="predicted state: params + Adam (ZeRO formula)")
    ax.bar(x - w / 2, temp / scale, w, bottom=state / scale, color="#dd8452",
           label="predicted temp: grads (formula) + activations (estimate)")
    ax.bar(x + w / 2, args / scale, w, color="#4c72b0", hatch="//", edgecolor="k", alpha=0.6,
           label="compiled arguments: params + Adam + batch")
    ax.bar(x + w / 2, ctemp / scale, w, bottom=args / scale, color="#dd8452", hatch="//", edgecolor="k", alpha=0.6,
           label="compiled temp (memory_analysis)")
    _strategy_ticks(ax, rows)
    ax.set(ylabel=f"{unit} per device", title="Memory per device: predicted (left bar) vs compiled (right bar)")
    legend_below(ax, ncols=2, gap=0.2)
    return save(fig, path)


@styled
def plot_communication(result: dict, path: Path):
    """Per strategy, the compiled collectives by op (stacked) beside the course's and jaxpar's formulas."""
    rows = [r for r in result["rows"].values() if r["label"] != "single device"]
    ops = sorted({op for r in rows for op in r["by_op"]})
    unit, scale = byte_unit([r[k] for r in rows for k in ("compiled_bytes", "course_bytes", "written_bytes")])
    fig = figure(10, 5.6)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.27
    bottom = np.zeros(len(rows))
    for op in ops:
        vals = np.array([r["by_op"].get(op, {}).get("bytes", 0.0) for r in rows]) / scale
        ax.bar(x - w, vals, w, bottom=bottom, label=f"compiled: {op}")
        bottom += vals
    ax.bar(x, np.array([r["course_bytes"] for r in rows]) / scale, w, color="0.75", hatch="..", edgecolor="0.3",
           label="course formula: 2Ψ (DDP, ZeRO-1/2), 3Ψ (ZeRO-3, FSDP)")
    ax.bar(x + w, np.array([r["written_bytes"] for r in rows]) / scale, w, color="0.4",
           label="formula for jaxpar's code as written")
    _strategy_ticks(ax, rows)
    ax.set(ylabel=f"{unit} sent per device per step",
           title="Collectives per step: compiled (left) vs the formulas (middle, right)")
    legend_below(ax, ncols=2, gap=0.2)
    return save(fig, path)


REMAT_MEANING = {"none": "keeps every activation", "full": "recomputes the whole layer",
                 "dots": "keeps matmul outputs", "names": "keeps the named tensors"}


@styled
def plot_remat(result: dict, path: Path):
    """Each remat policy (what jax.checkpoint keeps for the backward pass) as a point: time vs temp."""
    unit, scale = byte_unit([r["temp"] for r in result["rows"].values()])
    fig = figure(8, 5.5)
    ax = fig.add_subplot()
    for (policy, r), marker in zip(result["rows"].items(), "osD^v"):
        ax.scatter(r["step_ms"], r["temp"] / scale, s=90, marker=marker,
                   label=f"{policy}: {REMAT_MEANING.get(policy, '')}")
    ax.margins(0.15)
    legend_below(ax, ncols=2, gap=0.18)
    ax.set(xlabel="step time, median (ms, measured)", ylabel=f"temp per device ({unit}, compiled)",
           title="Activation checkpointing (remat policy): memory vs time")
    return save(fig, path)


def plot_precision(result: dict, path: Path):
    runs = result["runs"]
    ref = runs["float32"]["label"] if "float32" in runs else None
    return report.plot_equivalence(path, [(r["label"], r["losses"], None if r["label"] == ref else ref)
                                          for r in runs.values()], None,
                                   title="Compute dtypes on the same batches: loss and deviation from fp32",
                                   reference="reference")


PLOTS = {"equivalence.png": ("equivalence", plot_equivalence), "memory.png": ("memory", plot_memory),
         "communication.png": ("communication", plot_communication), "remat.png": ("remat", plot_remat),
         "precision.png": ("precision", plot_precision)}


# ============================================================================ the whole lab

def run_lab(config, out: str | Path | None = None, *, steps: int = 10, precision_steps: int = 60,
            remat_repeats: int = 10, precisions: list[str] | None = None, log=print) -> dict:
    """Run parts a-e on every local device; write the run directory; return every number."""
    start = time.perf_counter()
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
    out = Path(out or f"runs/lab-zero-{time.strftime('%Y%m%d-%H%M%S')}")
    log(f"lab zero: {len(devices)} x {devices[0].platform} devices, run directory {out}")
    lab = Lab(config, devices, out, log)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(to_json(config))
    m = lab.model_cfg
    header = "\n".join([
        f"# Lab 02: DDP, ZeRO-1/2/3 and FSDP: config {config.name}, {len(devices)} x {devices[0].platform}",
        "",
        f"jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. Model: {lab.psi:,} params "
        f"(d_model {m.d_model}, {m.layers} layers, vocab {m.vocab_size}), batch {config.train.batch_size} x "
        f"{config.data.seq_len} tokens, real corpus '{config.data.corpus}'. Measured values come from the "
        "compiled program or the clock; predicted values from the formulas named beside them.",
    ])
    results = {"config": config.name, "devices": len(devices), "platform": devices[0].platform,
               "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "params": lab.psi,
               "params_blocks": lab.counts["blocks"]}
    parts = [header]
    log(header + "\n")
    for name, fn in (("equivalence", lambda: equivalence(lab, steps)), ("memory", lambda: memory(lab)),
                     ("communication", lambda: communication(lab)), ("remat", lambda: remat(lab, remat_repeats)),
                     ("precision", lambda: precision(lab, precision_steps, precisions))):
        t0 = time.perf_counter()
        log(f"[{name}]")
        result = fn()
        result["seconds"] = time.perf_counter() - t0
        results[name] = result
        parts.append(result["markdown"])
        log(result["markdown"] + f"\n\n({name}: {result['seconds']:.1f} s)\n")
    footer = write_report(out, parts, results, start,
                          {k: results[k]["seconds"] for k in ("equivalence", "memory", "communication", "remat",
                                                               "precision")},
                          compiles=(len(lab.builds), sum(b.compile_s for b in lab.builds.values())))
    log(footer)
    report.draw_plots(results, out, PLOTS)     # after results.json: a failed plot can be redrawn
    log(f"wrote {out / 'report.md'}, results.json and 5 plots")
    return results


# ============================================================================ command line

def run_from_args(args) -> int:
    """`jaxpar lab zero` and run.py: the CPU device count must already be set (before JAX started)."""
    config = load_config(args.config)
    apply_overrides(config, args.overrides)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()] if args.precisions else None
    run_lab(config, args.out, steps=args.steps, precision_steps=args.precision_steps,
            remat_repeats=args.remat_repeats, precisions=precisions)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/*/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

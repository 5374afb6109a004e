"""Lab 03 (pipeline parallelism): schedules as tables, their bubble, measured; memory vs m; p2p bytes; a 7B dry run.

Seven parts, every number beside its prediction (experiments/03_pipeline/README.md is the lab sheet):

a. tables       the bubble of every schedule's table (parallel/schedules.py) against (p-1)/(m+p-1),
                (p-1)/(v*m+p-1) and (p-1)/(3m+p-1) (parallel/schedules.py), exact fractions, and the tables drawn.
b. equivalence  every schedule, the circular pipeline and 3D layouts against the single-device run
                (fp32, same batches): max relative deviation of losses and gradient norms.
c. timeline     one profiled step per hand-written schedule on the CPU mesh: each stage's busy time per tick
                (the tick's switch in the trace), drawn as the schedule picture with F/B/W coloured; the
                measured idle fraction beside the table's bubble, and beside the lock-step model of the
                table with each action's measured duration.
d. memory       compiled temp (activations, stash, gradient buffers) per stage at m = p, 2p, 4p with a fixed
                microbatch: GPipe and the circular pipeline keep every microbatch, 1F1B and ZB-H1 p.
e. p2p bytes    collective-permute bytes per step over `pipe` (compiled HLO) against 2(K-1)·m·b·s·h·e
                (K = p·v model stages) and the table's own sends.
f. dry run      configs/arabic_7b.py with pipe=4 x tensor=8 x fsdp=2 on 64 devices (a subprocess: the CPU device
                count is fixed when JAX starts): memory per stage, bytes per axis, predicted bubble.
g. dualpipev    DeepSeek's V-shaped schedule (torchtitan's ScheduleDualPipeV): each table's idle ticks per stage
                against the published (PP/2-1)(F&B+B-3W) and its activations against PP+1; DualPipeV and manual
                TP x FSDP inside pipelines against the single device.
h. pipedream    PipeDream-2BW (asynchronous, one step of weight staleness) against synchronous 1F1B from the same
                initial state: the loss curves and their gap (not an equivalence: staleness is the design).
i. moe          MoE in every schedule, expert parallelism inside the stages, accumulation and rules, each
                against one device accumulating the same microbatches (labs/pipeline_moe.py).

Files in the run directory: report.md, results.json, tables.png, timeline.png, memory.png, bytes.png,
dryrun_7b/ (dryrun.md, dryrun.json), pipedream.png. `--parts` runs a subset.
"""
from __future__ import annotations

import copy
import gzip
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, load_config, to_json
from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs.arguments import PIPELINE_PARTS as PARTS
from jaxpar.labs.arguments import pipeline as add_arguments
from jaxpar.labs.pipeline_moe import moe_pipelines
from jaxpar.labs.report import draw_plots, integer_steps, md_table, standalone_main, write_report
from jaxpar.measure import hlo
from jaxpar.measure.executed import executed_collectives
from jaxpar.parallel.pipeline import B_FIRST, B_MID, F_FIRST, F_LAST, F_MID, IDLE, W
from jaxpar.parallel.schedules import bubble_fraction, build, dualpipe_idle, p2p_bytes, validate
from jaxpar.parallel.schedules import dualpipev as dualpipev_table
from jaxpar.units import byte_unit, fmt_bytes

TOLERANCE = 1e-4
VOCAB = 512
FAST = {"xla_backend_optimization_level": 0}      # equivalence and memory: same HLO, ~2.5x faster compiles
REPO = Path(__file__).resolve().parents[2]
# the lab's model: 8 layers (2 per stage at p=4), big enough that a tick's compute shows in a CPU profile
LAB_MODEL = ["model.layers=8", "model.d_model=128", "model.heads=4", "model.kv_heads=2", "model.mlp_dim=256",
             "data.seq_len=64", "train.warmup_steps=1", "train.weight_decay=0.1"]
MICRO = 4                                         # rows per pipeline microbatch (fixed, so memory tracks m)
KIND = {F_FIRST: "F", F_MID: "F", F_LAST: "F", B_FIRST: "B", B_MID: "B", W: "W", IDLE: None}
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


# ============================================================================ building and running

class Lab:
    def __init__(self, config, out: Path, log=print):
        self.base, self.out, self.log = config, out, log
        self._built: dict = {}
        self._initial = None

    def config(self, overrides: list[str]):
        config = copy.deepcopy(self.base)
        apply_overrides(config, overrides)
        return config

    def trainer(self, overrides: list[str], devices: int):
        from jaxpar.parallel.registry import build_trainer
        return build_trainer(self.config(overrides), jax.devices()[:devices], VOCAB)

    def compiled(self, overrides: list[str], devices: int, fast: bool = True):
        """(trainer, compiled step), compiled once per settings."""
        key = (tuple(overrides), devices, fast)
        if key not in self._built:
            trainer = self.trainer(overrides, devices)
            start = time.perf_counter()
            with jax.set_mesh(trainer.mesh):
                lowered = trainer.lower_step()
                step = lowered.compile(compiler_options=FAST) if fast else lowered.compile()
            self.log(f"  compiled {' '.join(o for o in overrides if 'pipe' in o or 'mesh' in o)} "
                     f"in {time.perf_counter() - start:.1f} s")
            self._built[key] = (trainer, step)
        return self._built[key]

    def initial(self, trainer):
        if trainer.config.parallel.pipe == "pipedream-2bw":   # its optimizer state is its own pytree; same params
            return trainer.init_state()
        if self._initial is None:
            self._initial = jax.device_get(self.trainer(["mesh.data=1"], 1).init_state())
        return jax.device_put(self._initial, trainer.state_shardings)

    def batches(self, config, steps: int):
        rng = np.random.default_rng(0)
        rows, length = config.train.batch_size, config.data.seq_len + 1
        out = []
        for _ in range(steps):   # rows counting up by a row's own stride: learnable
            start, stride = rng.integers(0, VOCAB, (rows, 1)), rng.integers(1, 4, (rows, 1))
            out.append(((start + stride * np.arange(length)) % VOCAB).astype(np.int32))
        return out

    def run(self, trainer, step, steps: int):
        state, losses, norms = self.initial(trainer), [], []
        for batch in self.batches(trainer.config, steps):
            with jax.set_mesh(trainer.mesh):
                state, metrics = step(state, jax.device_put(batch, trainer.batch_sharding))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        return losses, norms


def _pipe(schedule: str, p: int, m: int, v: int = 1, data: int = 1, fsdp: int = 1, tensor: int = 1) -> list[str]:
    return [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.pipe={p}", f"mesh.tensor={tensor}",
            f"parallel.pipe={schedule}", f"parallel.pipe_microbatches={m}", f"parallel.pipe_virtual={v}",
            f"train.batch_size={MICRO * m * data * fsdp}"]


# ============================================================================ a. tables

TABLE_CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def tables(lab: Lab) -> dict:
    rows, sweep = [], []
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            for name, v in TABLE_CASES:
                s = build(name, p, m, v)
                validate(s)
                formula = bubble_fraction(name, p, m, v)
                sweep.append({"schedule": name, "p": p, "m": m, "v": v, "ticks": s.ticks,
                              "table": float(s.bubble()), "formula": float(formula),
                              "exact": s.bubble() == formula, "in_flight": max(s.in_flight())})
                if p == 4 and m == 8:
                    rows.append([name, p, m, v, s.ticks, str(s.bubble()), str(formula), f"{float(s.bubble()):.4f}",
                                 "yes" if s.bubble() == formula else "NO", max(s.in_flight()), s.in_flight_bound])
    pictures = {name: build(name, 4, 8, v).picture() for name, v in TABLE_CASES}
    exact = all(r["exact"] for r in sweep)
    md = "\n".join([
        "## a. Schedules as tables: bubble = idle cells / all cells (every action one tick)", "",
        md_table(["schedule", "p", "m", "v", "ticks", "bubble (table)", "formula", "decimal", "equal",
                "max in flight", "claimed bound"], rows), "",
        f"Over p in (2, 4, 8) x m in (p, 2p, 4p) ({len(sweep)} tables) every table's bubble equals its formula "
        f"exactly: {'yes' if exact else 'NO'}. Formulas: GPipe and 1F1B (p-1)/(m+p-1); interleaved "
        "(p-1)/(v·m+p-1) in chunk ticks; ZB-H1 (p-1)/(3m+p-1) with t_F = t_B = t_W. In flight: chunk-microbatches "
        "whose activations a stage holds at once (1F1B: p on stage 0; GPipe: m).", "",
        "The p=4, m=8 tables (`F3` = forward of microbatch 3, `B2.1` = backward of microbatch 2 on chunk 1):", "",
        *[f"```\n{name}\n{picture}\n```" for name, picture in pictures.items()]])
    return {"p4_m8": rows, "sweep": sweep, "all_exact": exact, "pictures": pictures, "markdown": md}


# ============================================================================ b. equivalence

EQUIVALENCE = [
    ("GPipe p=4 m=8", _pipe("gpipe", 4, 8), 4),
    ("1F1B p=4 m=8", _pipe("1f1b", 4, 8), 4),
    ("interleaved p=2 v=2 m=4", _pipe("interleaved", 2, 4, 2), 2),
    ("interleaved p=4 v=2 m=8", _pipe("interleaved", 4, 8, 2), 4),
    ("ZB-H1 p=4 m=8", _pipe("zb-h1", 4, 8), 4),
    ("circular p=4 m=8", _pipe("circular", 4, 8), 4),
    ("circular p=2 v=2 m=4", _pipe("circular", 2, 4, 2), 2),
    ("data=2 x pipe=2 x tensor=2, 1F1B m=4", _pipe("1f1b", 2, 4, data=2, tensor=2), 8),
    ("fsdp=2 x pipe=2 x tensor=2, ZB-H1 m=4", _pipe("zb-h1", 2, 4, fsdp=2, tensor=2), 8),
]


def equivalence(lab: Lab, steps: int) -> dict:
    result = equivalence_of(lab, EQUIVALENCE, steps)
    md = "\n".join([f"## b. Equivalence with one device ({steps} steps, fp32, batches of {MICRO} rows per microbatch)",
                    "", result["table"]])
    return {"cases": result["cases"], "markdown": md}


def equivalence_of(lab: Lab, cases, steps: int) -> dict:
    """Each (label, overrides, devices) against one device over the same batches: {"cases", "table"}."""
    rows, out = [], {}
    for label, overrides, devices in cases:
        trainer, step = lab.compiled(overrides, devices)
        oracle_t, oracle_s = lab.compiled(["mesh.data=1", f"train.batch_size={trainer.config.train.batch_size}"], 1)
        want_losses, want_norms = lab.run(oracle_t, oracle_s, steps)
        losses, norms = lab.run(trainer, step, steps)
        dev = max(abs(g / w - 1) for g, w in zip(losses, want_losses))
        dev_norm = max(abs(g / w - 1) for g, w in zip(norms, want_norms))
        out[label] = {"losses": losses, "oracle": want_losses, "max_rel_loss": dev, "max_rel_grad_norm": dev_norm}
        rows.append([label, f"{losses[0]:.4f} -> {losses[-1]:.4f}", f"{dev:.1e}", f"{dev_norm:.1e}",
                     "yes" if max(dev, dev_norm) <= TOLERANCE else "NO"])
    table = md_table(["layout", "loss", "max rel. dev. loss", "max rel. dev. grad norm", f"within {TOLERANCE:g}"],
                     rows)
    return {"cases": out, "table": table}


# ============================================================================ c. timeline

TIMELINE = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def _tick_ops(hlo_text: str) -> tuple[set[str], set[str]]:
    """(instructions of the tick's switch branches, transitively; the tick's collective-permutes) of a compiled
    step. The switch is the conditional with 3 or more branches (idle, F, B, W); the tick's permutes are those
    beside it in the loop body (the chunk re-deal of v > 1 permutes outside the loop)."""
    instructions, _ = hlo.parse_module(hlo_text)
    names, calls, switch, body = defaultdict(set), defaultdict(set), None, None
    for ins in instructions:
        names[ins.computation].add(ins.name)
        calls[ins.computation].update(re.findall(
            r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)", ins.line))
        for listed in re.findall(r"branch_computations=\{([^}]*)\}", ins.line):
            branches = re.findall(r"%?([\w.\-]+)", listed)
            calls[ins.computation].update(branches)
            if ins.opcode == "conditional" and len(branches) >= 3:
                switch, body = branches, ins.computation
    if switch is None:
        raise ValueError("no tick switch in the compiled step")
    seen, stack = set(), list(switch)
    while stack:
        computation = stack.pop()
        if computation not in seen:
            seen.add(computation)
            stack.extend(calls[computation])
    permutes = {ins.name for ins in instructions
                if ins.opcode.startswith("collective-permute") and ins.computation == body}
    return {name for c in seen for name in names[c]}, permutes


def _union(intervals) -> float:
    total, end = 0.0, -np.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _profile_ticks(trainer, step, state, batch, ticks: int) -> dict[int, list[dict]]:
    """Profile one step. Per pipe stage and tick: the time its F/B/W work ran (the union of the device's trace
    events inside the switch's branches, whatever thread ran them) and where the tick ended (its last permute)."""
    action_ops, permutes = _tick_ops(step.as_text())
    position = {d.id: np.unravel_index(i, trainer.mesh.devices.shape)[2]
                for i, d in enumerate(trainer.mesh.devices.flat)}
    with tempfile.TemporaryDirectory() as directory:
        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = 3          # on CPU, XLA's ops are host events
        with jax.set_mesh(trainer.mesh):
            jax.profiler.start_trace(directory, profiler_options=options, create_perfetto_trace=True)
            state, _ = step(state, batch)
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
        with gzip.open(sorted(Path(directory).rglob("*.trace.json.gz"))[-1]) as f:
            events = json.load(f)["traceEvents"]
    by_stage = defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args and "device_ordinal" in args:
            by_stage[int(position[int(args["device_ordinal"])])].append(e)
    out = {}
    for stage, evs in by_stage.items():
        sends = sorted(e["ts"] + e["dur"] for e in evs if e["args"]["hlo_op"] in permutes)
        per_tick = len(sends) // ticks
        if per_tick == 0 or len(sends) != per_tick * ticks:
            raise RuntimeError(f"stage {stage}: {len(sends)} permutes in the profile for {ticks} ticks")
        ends = sends[per_tick - 1::per_tick]
        work = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["args"]["hlo_op"] in action_ops)
        cells, begin = [], min(e["ts"] for e in evs)
        for end in ends:
            inside = [(a, min(b, end)) for a, b in work if begin <= a < end]
            cells.append({"start": min((a for a, _ in inside), default=begin), "busy": _union(inside),
                          "last": max((b for _, b in inside), default=begin), "end": end})
            begin = end
        out[stage] = cells
    return out


def timeline(lab: Lab, p: int, m: int, warmup: int) -> dict:
    out, rows = {}, []
    for name, v in TIMELINE:
        trainer, step = lab.compiled(_pipe(name, p, m, v), p, fast=False)
        schedule, program = trainer.schedule, trainer.program
        state = lab.initial(trainer)
        batches = [jax.device_put(b, trainer.batch_sharding) for b in lab.batches(trainer.config, warmup + 1)]
        with jax.set_mesh(trainer.mesh):
            for b in batches[:warmup]:
                state, _ = step(state, b)
            jax.block_until_ready(state)
        T = schedule.ticks
        cells = _profile_ticks(trainer, step, state, batches[-1], T)
        if sorted(cells) != list(range(p)):
            raise RuntimeError(f"{name}: profile holds stages {sorted(cells)}, expected {p}")
        start = min(c[0]["start"] for c in cells.values())
        end = max(c[-1]["end"] for c in cells.values())
        boxes, busy, by_kind = [], 0.0, defaultdict(list)
        for s in range(p):
            for t, cell in enumerate(cells[s]):
                kind = KIND[int(program.table["branch"][t, s])]
                if kind is None:
                    continue
                busy += cell["busy"]
                by_kind[kind].append(cell["busy"])
                boxes.append({"stage": s, "tick": t, "kind": kind, "start_ms": (cell["start"] - start) / 1e3,
                              "ms": (cell["last"] - cell["start"]) / 1e3, "busy_ms": cell["busy"] / 1e3})
        span = end - start
        measured = 1 - busy / (p * span)
        formula = float(bubble_fraction(name, p, m, v))
        # the lock-step model: each tick lasts as long as its slowest cell, each cell its kind's median time
        median = {k: float(np.median(d)) for k, d in by_kind.items()}
        tick_len = [max((median[KIND[int(c)]] for c in program.table["branch"][t] if KIND[int(c)]), default=0.0)
                    for t in range(T)]
        model = 1 - sum(median[KIND[int(c)]] for c in program.table["branch"].flat if KIND[int(c)]) / (p * sum(tick_len))
        out[name] = {"p": p, "m": m, "v": v, "ticks": T, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
                     "measured_idle": measured, "table_bubble": float(schedule.bubble()), "formula": formula,
                     "lockstep_model_idle": model, "median_ms": {k: x / 1e3 for k, x in median.items()},
                     "boxes": boxes}
        rows.append([name, f"p={p} m={m}" + (f" v={v}" if v > 1 else ""), T, f"{span / 1e3:.1f}",
                     " / ".join(f"{k} {median[k] / 1e3:.2f}" for k in "FBW" if k in median),
                     f"{formula:.3f}", f"{measured:.3f}", f"{measured / formula:.2f}", f"{model:.3f}",
                     f"{measured / model:.2f}"])
        lab.log(f"  {name}: measured idle {measured:.3f} vs formula {formula:.3f}")
    md = "\n".join([
        f"## c. Measured timeline (one profiled step on {p} CPU devices, after {warmup} warm-up steps)", "",
        md_table(["schedule", "", "ticks", "step span (ms)", "median action (ms)", "bubble (formula = table)",
                "measured idle", "measured / formula", "lock-step model", "measured / model"], rows), "",
        "Measured idle = 1 - (sum over stages and ticks of the time the stage's F, B or W work ran) / (stages x "
        "span of the tick loop). A cell's work is every trace event of that device, on whatever thread, from an "
        "instruction inside the tick switch's branches (read from the compiled HLO), between the stage's permutes "
        "that close the previous tick and this one. The formula counts every action as one tick; on the mesh a "
        "tick lasts as long as its slowest stage (B costs about 2 F, the first and last stages also embed or take "
        "the loss), and the permutes, slot copies and gradient adds between switches count as idle. The lock-step "
        "model replays the table with each kind's median measured time. Virtual CPU devices share the host's "
        "cores (and the profiler records every op): read the ratios, not the milliseconds."])
    return {"schedules": out, "markdown": md}


# ============================================================================ d. memory

MEMORY = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("circular", 1)]


def memory(lab: Lab, p: int) -> dict:
    from jaxpar.measure.memory import compiled_memory
    out, rows = {}, []
    for name, v in MEMORY:
        series = []
        for m in (p, 2 * p, 4 * p):
            trainer, step = lab.compiled(_pipe(name, p, m, v), p)
            cm = compiled_memory(step, "cpu")
            stash = None
            if hasattr(trainer, "program"):
                kept = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in trainer.stage_functions.kept)
                taps = sum(int(np.prod((trainer.chunk_layers, *s.shape))) * np.dtype(s.dtype).itemsize
                           for site in trainer.stage_functions.sites.values() for s in (site.x, site.y))
                stash = trainer.program.slots["stash"] * kept + trainer.program.slots["wstash"] * taps
            series.append({"m": m, "temp": cm.temp, "peak": cm.peak, "argument": cm.argument, "stash": stash,
                           "slots": dict(trainer.program.slots) if hasattr(trainer, "program") else None})
        base = series[0]["temp"]
        out[name] = {"v": v, "series": series, "growth_4p": series[-1]["temp"] / base}
        for r in series:
            rows.append([name + (f" v={v}" if v > 1 else ""), r["m"], fmt_bytes(r["temp"]), f"{r['temp'] / base:.2f}",
                         "-" if r["stash"] is None else fmt_bytes(r["stash"]),
                         "-" if r["stash"] is None else fmt_bytes(r["temp"] - r["stash"]),
                         "-" if r["slots"] is None else r["slots"]["stash"], fmt_bytes(r["peak"])])
    flat = out["1f1b"]["growth_4p"]
    grows = out["gpipe"]["growth_4p"]
    md = "\n".join([
        f"## d. Compiled activation memory per stage as m grows (p={p}, {MICRO} rows per microbatch)", "",
        md_table(["schedule", "m", "compiled temp", "temp / temp at m=p", "stash (predicted: slots x residuals)",
                "temp - stash", "stash slots", "peak"], rows), "",
        f"1F1B's temp at m=4p is {flat:.3f}x its m=p value (flat: within +-15%: "
        f"{'yes' if abs(flat - 1) <= 0.15 else 'NO'}); GPipe's grows {grows:.2f}x (at least 2.5x: "
        f"{'yes' if grows >= 2.5 else 'NO'}); ZB-H1 {out['zb-h1']['growth_4p']:.3f}x, circular "
        f"{out['circular']['growth_4p']:.2f}x. Compiled temp = XLA:CPU's temp buffers: the stash, the receive "
        "buffers, the gradient accumulators and one tick's working set (arguments and outputs apart). Predicted "
        "stash = the table's slots x one microbatch's residuals (jax.vjp's, weights left out) + ZB's taps. Every "
        "stage runs the same SPMD program: the buffers are sized for the busiest stage (stage 0)."])
    return {"schedules": out, "onefoneb_growth": flat, "gpipe_growth": grows, "markdown": md}


# ============================================================================ e. p2p bytes

def _permute_pairs(hlo_text: str) -> dict[str, int]:
    pairs = {}
    for m in re.finditer(r"%(\S+) = [^\n]*?collective-permute(?:-start)?\([^\n]*?source_target_pairs=\{(.*?)\}\}",
                         hlo_text):
        pairs[m.group(1)] = m.group(2).count("{")
    return pairs


def p2p(lab: Lab, p: int, m: int) -> dict:
    rows, out = [], {}
    for name, v in MEMORY:
        trainer, step = lab.compiled(_pipe(name, p, m, v), p)
        text = step.as_text()
        pairs = _permute_pairs(text)
        found = (executed_collectives(text, trainer.mesh, trainer.program, 0) if hasattr(trainer, "program")
                 else hlo.collectives(text, trainer.mesh))
        compiled = sum(c.result_bytes * c.runs_per_step * pairs.get(c.name, 1) for c in found
                       if c.op == "collective-permute")
        cfg = trainer.config
        e = 4
        K = p * v
        formula = p2p_bytes(K, m, MICRO, cfg.data.seq_len, cfg.model.d_model, e)
        a = MICRO * cfg.data.seq_len * cfg.model.d_model * e
        useful = None
        if hasattr(trainer, "program"):
            table = trainer.program.table["branch"]
            chunk = trainer.program.table["chunk"]
            stage = np.arange(p)[None, :]
            k = chunk * p + stage
            sends = ((np.isin(table, (F_FIRST, F_MID)) & (k < K - 1)).sum()
                     + (np.isin(table, (B_MID,)) & (k > 0)).sum())
            useful = int(sends) * a
        out[name] = {"compiled": compiled, "formula": formula, "table_sends": useful, "v": v}
        rows.append([name + (f" v={v}" if v > 1 else ""), fmt_bytes(formula), "-" if useful is None else fmt_bytes(useful),
                     fmt_bytes(compiled), f"{compiled / formula:.2f}"])
    md = "\n".join([
        f"## e. Point-to-point bytes per step over `pipe` (p={p}, m={m}, b={MICRO}, fp32)", "",
        md_table(["schedule", "formula 2(K-1)·m·b·s·h·e", "the table's sends", "compiled (HLO permutes)",
                "compiled / formula"], rows), "",
        "Summed over all stages: each collective-permute's buffer x its runs per step x its source-target pairs. "
        "The table's sends (every F but the last model stage's, every B but the first's) equal the formula. The "
        "lock-step SPMD executor moves a buffer in each direction on every tick, bubbles included, so it sends "
        "2·ticks·(p-1) buffers for 2(p-1)·m useful ones; an MPMD runtime (torch.distributed.pipelining) sends "
        "only the useful ones. The circular pipeline rolls every stage's buffer each iteration, forward and "
        "backward (XLA splits the backward roll in two)."])
    return {"schedules": out, "markdown": md}


# ============================================================================ f. dry run of the 7B

def dryrun_7b(lab: Lab, out: Path) -> dict:
    from jaxpar.measure.targets import gpu_plugin_problem
    config = REPO / "configs" / "arabic_7b.py"
    if not config.is_file():
        return {"markdown": "## f. Dry run of the 7B\n\nconfigs/arabic_7b.py is not here (an installed package "
                            "without the repository): skipped."}
    target = out / "dryrun_7b"
    sets = ["mesh.data=1", "mesh.pipe=4", "mesh.tensor=8", "mesh.fsdp=2", "parallel.pipe=1f1b",
            "parallel.pipe_microbatches=16"]
    argv = [sys.executable, "-m", "jaxpar.cli", "dryrun", "--config", str(config), "--devices", "64",
            "--out", str(target), *[x for s in sets for x in ("--set", s)]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=REPO, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the 7B dry run failed: {result.stderr.strip()[-2000:]}")
    report = json.loads((target / "dryrun.json").read_text())
    pipe = report["pipeline"]
    p, m = pipe["stages"], pipe["microbatches"]
    rows = [[axis, fmt_bytes(row["bytes"]), fmt_bytes(row["predicted_bytes"]) if row["predicted_bytes"] else "-",
             f"{row['bytes'] / row['predicted_bytes']:.3f}" if row["predicted_bytes"] else "-"]
            for axis, row in sorted(report["collectives"]["by_axis"].items())]
    cm = report["memory"]["compiled"]
    gpu = gpu_plugin_problem()
    bubbles = {name: float(bubble_fraction(name, p, m, v)) for name, v in (("1f1b", 1), ("interleaved", 2),
                                                                            ("zb-h1", 1))}
    md = "\n".join([
        "## f. Dry run: configs/arabic_7b.py, pipe=4 x tensor=8 x fsdp=2 on 64 CPU devices, 1F1B m=16", "",
        f"Compiled for the CPU target in {report['timing']['compile_s']:.1f} s. Memory per stage (each stage's "
        f"program): arguments {fmt_bytes(cm['argument'])} (params and Adam state: fp32, 1/64 of the blocks and 1/16 of "
        f"the embedding and head each), temp {fmt_bytes(cm['temp'])}, peak {fmt_bytes(cm['peak'])} ({cm['peak_method']}); "
        f"stash of {pipe['stash_slots']} microbatches (b = {256 // 2 // m} rows x 4096 tokens, remat full).", "",
        md_table(["mesh axis", "compiled bytes / device / step", "predicted", "ratio"], rows), "",
        f"Predicted bubble (formula = table): 1F1B {pipe['bubble_formula']:.4f} ({pipe['ticks']} ticks); with the "
        f"same p and m, interleaved v=2 would be {bubbles['interleaved']:.4f} and ZB-H1 {bubbles['zb-h1']:.4f}. "
        f"The tensor bytes are the busiest stage's Megatron all-reduces: 2 per layer per forward, 2 (+1 recomputed "
        f"under remat full) per backward, of b·s·h each. Deviceless H100: "
        + ("not run: " + gpu if gpu else "see dryrun_7b_h100/") + ".",
        "", f"Full report: {target.name}/dryrun.md."])
    return {"report": {k: report[k] for k in ("memory", "collectives", "pipeline", "timing")},
            "bubbles": bubbles, "gpu": gpu, "markdown": md}


# ============================================================================ plots

KIND_MEANING = {"F": "F: forward", "B": "B: backward (input gradients; all gradients outside ZB-H1)",
                "W": "W: weight gradients (ZB-H1)"}


def _draw(ax, boxes, p, title, x_label):
    for box in boxes:
        ax.broken_barh([(box["x"], box["w"])], (p - 1 - box["stage"] - 0.4, 0.8), color=COLOURS[box["kind"]],
                       edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(p), [f"stage {p - 1 - i}" for i in range(p)])
    ax.grid(False)
    ax.set_title(title)
    ax.set_xlabel(x_label)


@styled
def plot_timeline(result: dict, path: Path):
    """Each schedule's table (left, in ticks) beside what the CPU mesh ran (right, profiler, in ms)."""
    from matplotlib.patches import Patch
    schedules = result["schedules"]
    fig = figure(10, 2.4 * len(schedules) + 1.2)
    for i, (name, r) in enumerate(schedules.items()):
        table = build(name, r["p"], r["m"], r["v"])
        cells = [{"stage": s, "kind": row[s].kind, "x": t, "w": 1} for t, row in enumerate(table.grid)
                 for s in range(r["p"]) if row[s] is not None]
        _draw(fig.add_subplot(len(schedules), 2, 2 * i + 1), cells, r["p"],
              f"{name} table: bubble {r['formula']:.3f} (formula)", "tick" if i == len(schedules) - 1 else "")
        measured = [{**b, "x": b["start_ms"], "w": b["ms"]} for b in r["boxes"]]
        _draw(fig.add_subplot(len(schedules), 2, 2 * i + 2), measured, r["p"],
              f"{name} measured: idle share {r['measured_idle']:.3f}", "ms" if i == len(schedules) - 1 else "")
    kinds = sorted({b["kind"] for r in schedules.values() for b in r["boxes"]} | {"F", "B"}, key="FBW".index)
    fig.legend([Patch(color=COLOURS[k]) for k in kinds] + [Patch(facecolor="white", edgecolor="0.5")],
               [KIND_MEANING[k] for k in kinds] + ["blank: idle (the bubble)"], loc="outside lower center", ncols=2)
    fig.suptitle("Pipeline schedules: the table (left) vs the CPU mesh's profile (right)")
    return save(fig, path)


@styled
def plot_tables(result: dict, path: Path):
    fig = figure(8, 5.2)
    ax = fig.add_subplot(1, 1, 1)
    markers = {"gpipe": {"marker": "o", "ms": 14, "mfc": "none", "mew": 2}, "1f1b": {"marker": "o", "ms": 6}}
    for name, v in TABLE_CASES:
        points = [r for r in result["sweep"] if r["schedule"] == name and r["p"] == 4]
        (dots,) = ax.plot([r["m"] for r in points], [r["table"] for r in points], ls="none",
                          **markers.get(name, {"marker": "s"}),
                          label=f"{name}" + (f" v={v}" if v > 1 else "")
                          + (" (overlapping gpipe: the same bubble)" if name == "1f1b" else ""))
        ms = range(4, 17)
        ax.plot(ms, [float(bubble_fraction(name, 4, x, v)) for x in ms], "-", alpha=0.5, color=dots.get_color())
    ax.plot([], [], "ko", label="points: the schedule's table")
    ax.plot([], [], "k-", alpha=0.5, label="lines: the formula")
    ax.set(xlabel="microbatches m (p = 4 stages)", ylabel="bubble fraction (idle share of stage-ticks)",
           title="Bubble of each schedule: tables on their formulas")
    legend_below(ax, ncols=2, gap=0.16)
    integer_steps(ax)
    return save(fig, path)


@styled
def plot_memory(result: dict, path: Path):
    unit, scale = byte_unit([s["temp"] for r in result["schedules"].values() for s in r["series"]])
    fig = figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for name, r in result["schedules"].items():
        ax.plot([s["m"] for s in r["series"]], [s["temp"] / scale for s in r["series"]], "o-",
                label=name + (f" v={r['v']}" if r.get("v", 1) > 1 else ""))
    ax.set(xlabel="microbatches m (fixed microbatch size)", ylabel=f"compiled temp per stage ({unit})",
           title="Activation memory vs m: 1F1B stays flat, GPipe grows")
    legend_below(ax, ncols=4, gap=0.16)
    return save(fig, path)


@styled
def plot_bytes(result: dict, path: Path):
    rows = result["schedules"]
    names = list(rows)
    unit, scale = byte_unit([rows[n][k] for n in names for k in ("formula", "compiled")])
    fig = figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [rows[n]["formula"] / scale for n in names], 0.4, color="0.6", hatch="..", edgecolor="0.3",
           label="formula 2(K-1)·m·b·s·h·e (K = p·v model stages)")
    ax.bar(x + 0.2, [rows[n]["compiled"] / scale for n in names], 0.4, label="compiled permutes (HLO)")
    ax.set_xticks(x, [n + (f" v={rows[n]['v']}" if rows[n].get("v", 1) > 1 else "") for n in names])
    ax.set(ylabel=f"{unit} per step over pipe", title="Point-to-point bytes between stages per step")
    legend_below(ax, gap=0.12)
    return save(fig, path)


PLOTS = {"tables.png": ("tables", plot_tables), "timeline.png": ("timeline", plot_timeline),
         "memory.png": ("memory", plot_memory), "bytes.png": ("p2p", plot_bytes)}


# ============================================================================ g. DualPipeV

DUALPIPEV_EQUIVALENCE = [
    ("DualPipeV p=4 m=8", _pipe("dualpipev", 4, 8, 2), 4),
    ("DualPipeV p=2 m=4, manual TP x FSDP: fsdp=2 x tensor=2", _pipe("dualpipev", 2, 4, 2, fsdp=2, tensor=2)
     + ["parallel.tensor=manual"], 8),
    ("1F1B p=2 m=4, manual TP: data=2 x tensor=2", _pipe("1f1b", 2, 4, data=2, tensor=2)
     + ["parallel.tensor=manual"], 8),
]


def dualpipev(lab: Lab, steps: int) -> dict:
    rows, sweep = [], []
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            s = build("dualpipev", p, m)
            validate(s)
            published = dualpipe_idle(2 * p, f_and_b=3, b=2, w=1)
            idle, peak = s.idle_ticks(), max(s.in_flight())
            unblocked = dualpipev_table(p, m, blocks=False)
            validate(unblocked)
            sweep.append({"p": p, "m": m, "ticks": s.ticks, "idle": idle, "published_idle": published,
                          "in_flight": peak, "published_in_flight": 2 * p + 1, "bubble": float(s.bubble()),
                          "zb_h1_bubble": float(build("zb-h1", p, m).bubble()),
                          "idle_without_blocks": unblocked.idle_ticks(),
                          "exact": idle == [published] * p and peak == 2 * p + 1})
            rows.append([p, 2 * p, m, s.ticks, ", ".join(map(str, sorted(set(idle)))), f"{published:g}", peak,
                         2 * p + 1, f"{float(s.bubble()):.4f}", f"{float(build('zb-h1', p, m).bubble()):.4f}",
                         ", ".join(map(str, sorted(set(unblocked.idle_ticks())))),
                         "yes" if sweep[-1]["exact"] else "NO"])
    cases = equivalence_of(lab, DUALPIPEV_EQUIVALENCE, steps)
    md = "\n".join([
        "## g. DualPipeV: DeepSeek's V as a table (torchtitan: `ScheduleDualPipeV`)", "",
        "2p model stages on p stages in a V (stage s holds model stages s and 2p-1-s); every F, B (input gradient) "
        "and W one tick; an overlapped F&B pair is one block (it starts when both inputs are there; what it sends "
        "leaves when it is done), so F&B = F+B = 3, B (full) = 2, W = 1 ticks. Published (DeepSeek-V3 report, "
        "deepseek-ai/DualPipe): bubble (PP/2-1)(F&B+B-3W) per device, activations PP+1, PP = 2p.", "",
        md_table(["p", "PP", "m", "ticks", "idle ticks per stage (table)", "published", "max in flight (table)",
                  "PP+1", "bubble fraction", "ZB-H1's", "idle without blocks", "equal"], rows), "",
        "Without blocks (the same per-stage orders, each action sending as soon as it is done) a stage idles only "
        "the V's fill; the blocks cost the rest. In ticks DualPipeV's bubble fraction is ZB-H1's "
        "(p-1)/(3m+p-1); what DualPipe adds on a GPU, the F&B overlap of compute with the EP all_to_alls, "
        "a tick table does not model.", "",
        f"```\ndualpipev p=4 m=8\n{build('dualpipev', 4, 8).picture()}\n```", "",
        f"Against one device, {steps} steps, fp32:", "", cases["table"]])
    return {"sweep": sweep, "all_exact": all(r["exact"] for r in sweep), "cases": cases["cases"], "markdown": md}


# ============================================================================ h. PipeDream-2BW

def pipedream(lab: Lab, steps: int) -> dict:
    curves = {}
    for name in ("1f1b", "pipedream-2bw"):
        trainer, step = lab.compiled(_pipe(name, 4, 8), 4)
        curves[name] = lab.run(trainer, step, steps)[0]
    sync, stale = np.array(curves["1f1b"]), np.array(curves["pipedream-2bw"])
    gap = stale - sync
    marks = sorted({0, 1, 4, 9, steps // 2, steps - 1} & set(range(steps)))
    rows = [[i + 1, f"{sync[i]:.4f}", f"{stale[i]:.4f}", f"{gap[i]:+.4f}", f"{gap[i] / sync[i]:+.2%}"] for i in marks]
    below = lambda curve, level: next((i + 1 for i, x in enumerate(curve) if x <= level), None)
    level = float(sync[0] - 0.5 * (sync[0] - sync[-1]))
    md = "\n".join([
        f"## h. PipeDream-2BW against synchronous 1F1B: p=4, m=8, {steps} steps from the same initial state", "",
        "PipeDream-2BW keeps two weight versions so that no stage waits for a flush: W(t+1) = W(t) - lr·g(W(t-1)), "
        "one step of staleness (parallel/pipedream.py; the first step applies nothing). It does not reproduce one "
        "device, by design. PyTorch counterparts: DeepSpeed's pipeline engine runs the synchronous PipeDream-Flush "
        "(1F1B, `TrainSchedule`); the asynchronous 2BW is the PipeDream authors' own code.", "",
        md_table(["step", "1F1B loss", "2BW loss", "2BW - 1F1B", "relative"], rows), "",
        f"Steps to halve the 1F1B run's loss drop (to {level:.4f}): 1F1B {below(sync, level)}, "
        f"2BW {below(stale, level)}. Mean gap over the last half: {float(gap[steps // 2:].mean()):+.4f}."])
    return {"steps": steps, "losses": curves, "gap": gap.tolist(), "markdown": md}


@styled
def plot_pipedream(result: dict, path: Path):
    fig = figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for name, curve in result["losses"].items():
        ax.plot(range(1, len(curve) + 1), curve, "-", label=name)
    ax.set(xlabel="step", ylabel="training loss (cross-entropy, nats)",
           title="PipeDream-2BW (weights one step stale) against synchronous 1F1B")
    legend_below(ax, ncols=2, gap=0.16)
    integer_steps(ax)
    return save(fig, path)


# the figure is drawn after its part: PLOTS is complete only once every plot function exists
PLOTS["pipedream.png"] = ("pipedream", plot_pipedream)


# ============================================================================ the whole lab


def run_lab(overrides: list[str], out: str | Path | None = None, *, steps: int = 5, warmup: int = 2,
            parts: tuple[str, ...] = PARTS, pipedream_steps: int = 60, log=print) -> dict:
    start = time.perf_counter()
    if steps < 1 or warmup < 1 or pipedream_steps < 2:
        raise ConfigError("--steps" if steps < 1 else "--warmup" if warmup < 1 else "--pipedream-steps",
                          "must be at least 1 (--pipedream-steps: 2)")
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        raise ConfigError("--parts", f"unknown {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    if len(jax.devices()) < 8:
        raise ConfigError("--cpu-devices", f"the lab needs 8 devices (3D layouts) but JAX has {len(jax.devices())}; "
                          "on CPU pass --cpu-devices 8")
    config = load_config(str(REPO / "configs" / "test.py")) if (REPO / "configs" / "test.py").is_file() else None
    if config is None:
        from jaxpar.config import base_config
        config = base_config()
        config.lock()
    apply_overrides(config, LAB_MODEL + list(overrides))
    out = Path(out or f"runs/lab-pipeline-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(to_json(config))
    lab = Lab(config, out, log)
    p, m = 4, 8
    c = config.model
    header = "\n".join([
        f"# Lab 03: pipeline parallelism on {len(jax.devices())} x {jax.devices()[0].platform}", "",
        f"jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. Model: d_model {c.d_model}, {c.layers} layers, "
        f"{c.heads} heads, vocab {VOCAB}, seq {config.data.seq_len}; synthetic batches of {MICRO} rows per "
        "pipeline microbatch. Measured values come from the compiled program, the profiler or the clock; "
        "predicted ones from the formulas named beside them."])
    log(header + "\n")
    results = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "devices": len(jax.devices())}
    report = [header]
    plan = {"tables": lambda: tables(lab), "equivalence": lambda: equivalence(lab, steps),
            "timeline": lambda: timeline(lab, p, m, warmup), "memory": lambda: memory(lab, p),
            "p2p": lambda: p2p(lab, p, m), "dryrun": lambda: dryrun_7b(lab, out),
            "dualpipev": lambda: dualpipev(lab, steps), "pipedream": lambda: pipedream(lab, pipedream_steps),
            "moe": lambda: moe_pipelines(lab, steps)}
    steps_plan = [(name, plan[name]) for name in PARTS if name in parts]
    for name, fn in steps_plan:
        t0 = time.perf_counter()
        log(f"[{name}]")
        result = fn()
        result["seconds"] = time.perf_counter() - t0
        results[name] = result
        report.append(result["markdown"])
        log(result["markdown"] + f"\n\n({name}: {result['seconds']:.1f} s)\n")
    footer = write_report(out, report, results, start, {k: results[k]["seconds"] for k, _ in steps_plan})
    log(footer)
    draw_plots(results, out, PLOTS)     # after results.json: a failed plot can be redrawn
    log(f"wrote {out / 'report.md'}, results.json and the plots")
    return results


# ============================================================================ command line

def run_from_args(args) -> int:
    parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    run_lab(args.overrides, args.out, steps=args.steps, warmup=args.warmup, parts=parts,
            pipedream_steps=args.pipedream_steps)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/*/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

"""Lab 04 (pipeline), part c: the schedules on a profiled step, tick by tick: the measured bubble beside
the formula and a model built from the measured per-kind op times."""
import gzip
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from jaxpar.labs.base.report import md_table
from jaxpar.labs.pipeline.build import KIND, Lab, _pipe
from jaxpar.measure import hlo
from jaxpar.parallel.schedules import bubble_fraction

TIMELINE = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def _tick_ops(hlo_text: str) -> tuple[set[str], set[str]]:
    """(instructions of the tick's switch branches, transitively; the tick's sends) of a compiled step. The switch
    is the conditional with 3 or more branches (idle, F, B, W). A tick sends over the pairs its table names, each
    set of pairs a branch of a switch of its own (parallel/pipeline_executor.py), so the tick's sends are the
    collective-permutes beside the action switch in the loop body and the conditionals there whose branches hold
    one (the chunk re-deal of v > 1 permutes outside the loop)."""
    instructions, _ = hlo.parse_module(hlo_text)
    names, calls, conditionals = defaultdict(set), defaultdict(set), []
    for ins in instructions:
        names[ins.computation].add(ins.name)
        calls[ins.computation].update(re.findall(
            r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)", ins.line))
        for listed in re.findall(r"branch_computations=\{([^}]*)\}", ins.line):
            branches = re.findall(r"%?([\w.\-]+)", listed)
            calls[ins.computation].update(branches)
            if ins.opcode == "conditional":
                conditionals.append((ins, branches))
    switch = next(((ins, b) for ins, b in conditionals if len(b) >= 3), None)
    if switch is None:
        raise ValueError("no tick switch in the compiled step")
    (action, body), actions = (switch[0].name, switch[0].computation), switch[1]

    def reached(roots) -> set[str]:
        seen, stack = set(), list(roots)
        while stack:
            computation = stack.pop()
            if computation not in seen:
                seen.add(computation)
                stack.extend(calls[computation])
        return seen

    permuting = {ins.computation for ins in instructions if ins.opcode.startswith("collective-permute")}
    sends = {ins.name for ins in instructions
             if ins.computation == body and ins.opcode.startswith("collective-permute")}
    sends |= {ins.name for ins, b in conditionals if ins.computation == body and ins.name != action
              and reached(b) & permuting}
    return {name for c in reached(actions) for name in names[c]}, sends


def _union(intervals) -> float:
    total, end = 0.0, -np.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _profile_ticks(strategy, step, state, batch, ticks: int) -> dict[int, list[dict]]:
    """Profile one step. Per pipe stage and tick: the time its F/B/W work ran (the union of the device's trace
    events inside the switch's branches, whatever thread ran them) and where the tick ended (its last permute)."""
    action_ops, permutes = _tick_ops(step.as_text())
    position = {d.id: np.unravel_index(i, strategy.mesh.devices.shape)[2]
                for i, d in enumerate(strategy.mesh.devices.flat)}
    with tempfile.TemporaryDirectory() as directory:
        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = 3          # on CPU, XLA's ops are host events
        with jax.set_mesh(strategy.mesh):
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
            raise RuntimeError(f"stage {stage}: {len(sends)} sends in the profile for {ticks} ticks")
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
    for name, v in lab.few(TIMELINE, 1):
        strategy, step = lab.compiled(_pipe(name, p, m, v), p, fast=False)
        schedule, program = strategy.schedule, strategy.program
        state = lab.initial(strategy)
        batches = [jax.device_put(b, strategy.batch_sharding) for b in lab.batches(strategy.config, warmup + 1)]
        with jax.set_mesh(strategy.mesh):
            for b in batches[:warmup]:
                state, _ = step(state, b)
            jax.block_until_ready(state)
        T = schedule.ticks
        cells = _profile_ticks(strategy, step, state, batches[-1], T)
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
        tick_len = [max((median[kind] for c in program.table["branch"][t] if (kind := KIND[int(c)])), default=0.0)
                    for t in range(T)]
        model = 1 - sum(median[kind] for c in program.table["branch"].flat
                        if (kind := KIND[int(c)])) / (p * sum(tick_len))
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

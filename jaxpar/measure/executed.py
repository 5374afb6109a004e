"""The collectives a step executes, which are not always those its HLO lists once per loop trip.

A pipeline step (parallel/pipeline.py) runs a `lax.switch` per tick: the static count runs every branch
on every tick, a stage runs each only on the ticks its table gives it (`part_ticks`). The compiled
instructions carry the tick part they belong to in their `pipeline_<part>` scope.

The compiler may copy a tick: XLA:GPU's while-loop double buffering (on in jaxpar's GPU flags, env.py) unrolls
the tick loop twice, so each send has two instructions that run half the ticks each, and a loop with an odd trip
count gets one trip peeled out of it. The copies of one instruction together run once per tick, so a stage's
runs are shared out over the copies, never worked out per copy from its own trip count.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from jaxpar.measure import hlo
from jaxpar.parallel.pipeline_program import Program, part_ticks


def tick_parts(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the innermost `pipeline_<part>` scope it was traced under (F, B, head, send_down_2...)."""
    scopes = dict(re.findall(r'%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"', hlo_text))
    out = {}
    for name, scope in scopes.items():
        parts = [p[len("pipeline_"):] for p in scope.split("/") if p.startswith("pipeline_")]
        if parts:
            out[name] = parts[-1]
    return out


def _copies(found: list[hlo.Collective], parts: dict[str, str], ticks) -> dict[tuple, list[int]]:
    """The tick parts' collectives grouped into copies of one instruction: same part, op, shapes and groups (two
    distinct instructions alike in all of these fall into one group, which changes no total)."""
    groups: defaultdict[tuple, list[int]] = defaultdict(list)
    for i, c in enumerate(found):
        part = parts.get(c.name)
        if part in ticks:
            groups[(part, c.op, c.shapes, c.replica_groups)].append(i)
    return groups


def executed_collectives(hlo_text: str, mesh, program: Program, stage: int):
    """`measure.hlo.collectives` of a pipeline step, with the runs of the collectives inside a tick's parts
    set to what `stage` executes: the static count runs every branch of the tick's switches on every tick
    (a send's branch: the ticks on which `stage` is one of its senders). Copies of an instruction (an unrolled or
    peeled tick loop) share the runs by their static counts; which copy runs which tick is not read."""
    parts = tick_parts(hlo_text)
    ticks = part_ticks(program)
    out = hlo.collectives(hlo_text, mesh)
    for (part, *_), members in _copies(out, parts, ticks).items():
        static = [out[i].runs_per_step for i in members]
        total = sum(static)                                  # ticks x tick loop runs x instructions in the group
        executed = total * int(ticks[part][stage]) // program.ticks
        shares = [n * executed // total if total else 0 for n in static]
        for k in range(executed - sum(shares)):              # what rounding down left: under one run per copy
            shares[k] += 1
        for i, runs in zip(members, shares):
            out[i] = dataclasses.replace(out[i], runs_per_step=runs)
    return out


def step_collectives(strategy, hlo_text: str) -> list:
    """The compiled step's collectives: a pipeline strategy's per mesh axis as the stage that sends the most over
    that axis executes them (stages differ: the first and last send half a middle stage's activations, the first
    runs the embedding's), any other's as `hlo.collectives` counts them."""
    program = getattr(strategy, "program", None)
    if program is None:
        return hlo.collectives(hlo_text, strategy.mesh)
    per_stage = [executed_collectives(hlo_text, strategy.mesh, program, s) for s in range(program.schedule.stages)]
    out = []
    for axis in dict.fromkeys(c.axis_label for c in per_stage[0]):
        on_axis = [[c for c in found if c.axis_label == axis] for found in per_stage]
        out += max(on_axis, key=lambda found: sum(c.bytes_per_step for c in found))
    return out

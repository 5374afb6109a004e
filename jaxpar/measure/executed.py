"""The collectives a step executes, which are not always those its HLO lists once per loop trip.

A pipeline step (parallel/pipeline.py) runs a `lax.switch` per tick: the static count runs every branch
on every tick, a stage runs each only on the ticks its table gives it (`part_ticks`). The compiled
instructions carry the tick part they belong to in their `pipeline_<part>` scope.
"""
from __future__ import annotations

import dataclasses
import re

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


def executed_collectives(hlo_text: str, mesh, program: Program, stage: int):
    """`measure.hlo.collectives` of a pipeline step, with the runs of the collectives inside a tick's parts
    set to what `stage` executes: the static count runs every branch of the tick's switches on every tick
    (a send's branch: the ticks on which `stage` is one of its senders)."""
    parts = tick_parts(hlo_text)
    ticks = part_ticks(program)
    out = []
    for c in hlo.collectives(hlo_text, mesh):
        if parts.get(c.name) in ticks:
            runs = c.runs_per_step // program.ticks * int(ticks[parts[c.name]][stage])
            c = dataclasses.replace(c, runs_per_step=runs)
        out.append(c)
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

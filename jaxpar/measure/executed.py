"""The collectives a step executes, which are not always those its HLO lists once per loop trip.

A pipeline step (parallel/pipeline.py) runs a `lax.switch` per tick: the static count runs every branch
on every tick, a stage runs each only on the ticks its table gives it (`part_ticks`). The compiled
instructions carry the tick part they belong to in their `pipeline_<part>` scope.

The compiler may copy a tick: XLA:GPU's while-loop double buffering (on in jaxpar's GPU flags, env.py) unrolls
the tick loop twice, so each send has two instructions that run half the ticks each, and a loop with an odd trip
count gets one trip peeled out of it. The copies of one instruction together run once per tick, so a stage's
runs are shared out over the copies, never worked out per copy from its own trip count. Where two routes send over
the same pairs (interleaved at p=2: down and up), XLA:GPU may merge their branches into one computation, whose
clones keep one route's scope: a send is known by its pairs (`Program.sends`), its scope only says it is a send.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

from jaxpar.measure import hlo
from jaxpar.measure.hlo_module import parse_module
from jaxpar.parallel.pipeline_executor import AXIS
from jaxpar.parallel.pipeline_program import Program, part_ticks


def tick_parts(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the innermost `pipeline_<part>` scope it was traced under (F, B, head, send_down_2...).

    An instruction without a scope (XLA:GPU's combined all-reduce has none) takes its computation's part where the
    computation holds that part alone: every other scope there is an op of one of its outer scopes (`shard_map`; the
    tick branch's RoPE tables, which XLA may place in the computation of the branch's part)."""
    instructions, _ = parse_module(hlo_text)
    out, unscoped = {}, []
    scopes: defaultdict[str, set[str]] = defaultdict(set)     # computation -> the scopes of its instructions
    for ins in instructions:
        found = re.search(r'metadata=\{op_name="([^"]*)"', ins.line)
        if found is None:
            unscoped.append(ins)
            continue
        scopes[ins.computation].add(found.group(1))
        part = _innermost_part(found.group(1))
        if part:
            out[ins.name] = part
    for ins in unscoped:
        part = _sole_part(scopes[ins.computation])
        if part is not None:
            out[ins.name] = part
    return out


def _innermost_part(scope: str) -> str | None:
    parts = [p[len("pipeline_"):] for p in scope.split("/") if p.startswith("pipeline_")]
    return parts[-1] if parts else None


def _sole_part(scopes: set[str]) -> str | None:
    """The part a computation's scopes hold, where they hold one alone and any other scope is an op of an outer one."""
    inside = {scope: part for scope in scopes if (part := _innermost_part(scope)) is not None}
    outer_only = all(any(scope.startswith(o.rsplit("/", 1)[0] + "/") for scope in inside) for o in scopes - set(inside))
    return next(iter(inside.values())) if len(set(inside.values())) == 1 and outer_only else None


def _send_parts(program: Program) -> dict[frozenset, tuple[str, ...]]:
    """A set of (source, target) stage pairs -> the sends `send_<route>_<k>` over just those pairs."""
    out: defaultdict[frozenset, tuple[str, ...]] = defaultdict(tuple)
    for route, patterns in program.sends.items():
        for k, pairs in enumerate(patterns[1:], start=1):
            out[frozenset((int(s), int(t)) for s, t in pairs)] += (f"send_{route}_{k}",)
    return out


def _stage_pairs(c: hlo.Collective, mesh) -> frozenset:
    """A permute's pairs as stages (the devices' pipe coordinates; without a mesh, device k is stage k)."""
    if mesh is None:
        return frozenset(c.pairs)
    stage = np.indices(mesh.devices.shape)[list(mesh.axis_names).index(AXIS)].ravel()
    return frozenset((int(stage[s]), int(stage[t])) for s, t in c.pairs)


def _copies(found: list[hlo.Collective], parts: dict[str, str], ticks, program: Program, mesh) -> dict[tuple, list]:
    """The tick parts' collectives grouped into copies of one instruction: same parts, op, shapes and groups; a
    send's parts are every send over its pairs (two distinct instructions alike in all of these fall into one group,
    which changes no total)."""
    sends = _send_parts(program)
    groups: defaultdict[tuple, list[int]] = defaultdict(list)
    for i, c in enumerate(found):
        part = parts.get(c.name)
        if part is None or part not in ticks:
            continue
        candidates = sends.get(_stage_pairs(c, mesh), (part,)) if part.startswith("send_") else (part,)
        groups[(candidates, c.op, c.shapes, c.replica_groups)].append(i)
    return groups


def executed_collectives(hlo_text: str, mesh, program: Program, stage: int):
    """`measure.hlo.collectives` of a pipeline step, with the runs of the collectives inside a tick's parts
    set to what `stage` executes: the static count runs every branch of the tick's switches on every tick
    (a send's branch: the ticks on which `stage` is one of its senders). Copies of an instruction (an unrolled or
    peeled tick loop) share the runs by their static counts; which copy runs which tick is not read."""
    parts = tick_parts(hlo_text)
    ticks = part_ticks(program)
    out = hlo.collectives(hlo_text, mesh)
    for (candidates, *_), members in _copies(out, parts, ticks, program, mesh).items():
        static = [out[i].runs_per_step for i in members]
        total = sum(static)                    # ticks x tick loop runs x the candidates' instructions
        on_stage = sum(int(ticks[part][stage]) for part in candidates)
        executed = total * on_stage // (program.ticks * len(candidates))
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

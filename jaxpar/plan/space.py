"""The space of candidate strategies the planner enumerates (a `Candidate`: parallel/theory.py).

A candidate is a point in (mesh sizes data x fsdp x tensor x pipe x expert, how `data`
is implemented, microbatches, pipeline schedule, remat policy, compute precision,
attention kernel). `enumerate_candidates` lists every one a model and a cluster allow:
each axis size divides what it splits (heads, kv_heads, the MLP, the vocabulary for
`tensor`; d_model for `fsdp`; layers for `pipe`; experts for `expert`; the global batch
for data x fsdp x expert x microbatches). Whether jaxpar has a strategy that runs a
candidate is the registry's: each axis' implementations are those its strategies offer the planner, and an
axis a registered strategy adds (jaxpar/strategies.py) is enumerated at every size that divides the devices,
with each implementation offered, where a registered strategy runs the combination.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from jaxpar.model.counting import ModelShape
from jaxpar.parallel.registry import planned, runs
from jaxpar.parallel.theory import VIRTUAL, Candidate
from jaxpar.strategies import added_axes

REMATS = ("none", "dots", "full")
PRECISIONS = ("bfloat16", "float8", "float32")
ATTENTIONS = ("dot", "flash")      # dot: jaxpar's einsum attention (S x S scores); flash: a fused kernel
# Left out of the space, because the planner cannot predict it (deviceless H100 compiles of the 7B): jaxpar's fp8
# matmuls (per-tensor current scaling, model/fp8.py) under tensor parallelism compiled to 3.5x the tensor-axis
# bytes of bf16 and 14-32% more memory than parallel/memory.py's fp8 terms; inside a pipeline stage they keep less than
# those terms say (remat dots kept what remat full keeps: 40.7 GiB where the model said 70).
FP8_NOT_MODELLED = "fp8 with tensor > 1 or pipe > 1: not modelled, not ranked"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MIN_CONTEXT_ROWS = 4096     # context parallelism is offered while each device keeps at least this many positions


def context_choices(devices: int, seq_len: int) -> list[int]:
    """Context sizes c for `seq_len`-token sequences (ring, parallel/context.py): powers of two dividing the
    devices, cutting the sequence into 2c equal chunks, leaving each device MIN_CONTEXT_ROWS positions or more
    (a choice: shorter slices give the ring's hops little attention to hide behind); always 1."""
    return [c for c in (2**k for k in range(devices.bit_length())) if devices % c == 0 and
            (c == 1 or (seq_len % (2 * c) == 0 and seq_len // c >= MIN_CONTEXT_ROWS))]


def mesh_choices(shape: ModelShape, devices: int, global_batch: int, seq_len: int = 0) -> list[dict[str, int]]:
    """Every (data, fsdp, tensor, pipe, expert, context) whose product is `devices` and whose sizes divide what they
    split (`seq_len` 0: no context axis)."""
    return [{**sizes, "context": context} for context in context_choices(devices, seq_len)
            for sizes in _mesh_choices(shape, devices // context, global_batch)
            if context == 1 or sizes["pipe"] == sizes["expert"] == 1]     # what parallel/context.py composes with


def _mesh_choices(shape: ModelShape, devices: int, global_batch: int) -> list[dict[str, int]]:
    out = []
    for tensor in divisors(devices):
        if shape.heads % tensor or shape.kv_heads % tensor or shape.mlp_dim % tensor or shape.vocab % tensor:
            continue
        if shape.experts and shape.expert_mlp_dim % tensor:
            continue
        for pipe in divisors(devices // tensor):
            if shape.layers % pipe:
                continue
            for expert in divisors(devices // (tensor * pipe)):
                if expert > 1 and (not shape.experts or shape.experts % expert):
                    continue
                rest = devices // (tensor * pipe * expert)
                for fsdp in divisors(rest):
                    data = rest // fsdp
                    if shape.d_model % fsdp or global_batch % (data * fsdp * expert):
                        continue
                    out.append({"data": data, "fsdp": fsdp, "tensor": tensor, "pipe": pipe, "expert": expert})
    return out


def microbatch_choices(rows: int, pipe: int, schedule: str) -> list[int]:
    """Microbatch counts for `rows` sequences per data shard: powers of two (and rows itself) dividing rows;
    a pipeline needs at least `pipe` of them (interleaved: a multiple of pipe)."""
    counts = sorted({m for m in [2**k for k in range(16)] + [rows] if m <= rows and rows % m == 0})
    if pipe == 1:
        return counts
    return [m for m in counts if m >= pipe and (schedule != "interleaved" or m % pipe == 0)]


def added_choices(devices: int) -> list[tuple[tuple[str, int, str], ...]]:
    """The settings of the added axes: each unused, or (axis, size, implementation) for every size > 1 dividing the
    devices and every implementation offered the planner; [()] when no strategy adds an axis."""
    offered = planned()
    out: list[tuple[tuple[str, int, str], ...]] = [()]
    for axis in added_axes():
        used = [((axis, size, impl),) for size in divisors(devices)[1:] for impl in offered[axis] if impl != "auto"]
        out = [(*prior, *entry) for prior in out for entry in [(), *used]]
    return [c for c in out if devices % math.prod(size for _, size, _ in c) == 0]


def enumerate_candidates(shape: ModelShape, devices: int, global_batch: int, *, seq_len: int = 0,
                         **space) -> list[Candidate]:
    """The strategy space: every mesh x microbatches x schedule x remat x precision x attention allowed, and
    each axis' implementations the registered strategies offer the planner (`registry.planned`); `space`:
    `built_in_candidates`' narrowing."""
    out = []
    for added in added_choices(devices):
        rest = devices // math.prod(size for _, size, _ in added)
        found = built_in_candidates(shape, rest, global_batch, seq_len=seq_len, whole=devices, **space)
        out += [dataclasses.replace(c, added=added) for c in found] if added else found
    return [c for c in out if not c.added or runs(c.impls)]


def built_in_candidates(shape: ModelShape, devices: int, global_batch: int, *, remats=REMATS,
                        precisions=("bfloat16", "float8"), attentions=ATTENTIONS, schedules=None,
                        data_impls=None, seq_len: int = 0, whole: int = 0) -> list[Candidate]:
    """The space over the built-in axes on `devices` (of a mesh of `whole` devices, default the same)."""
    offered = planned()
    schedules = schedules or tuple(s for s in offered["pipe"] if s != "auto")
    data_impls = data_impls or offered["data"]
    out = []
    for sizes in mesh_choices(shape, devices, global_batch, seq_len):
        rows = global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
        pipe = sizes["pipe"]
        only_data = sizes["data"] > 1 and sizes["data"] == (whole or devices)   # the ZeRO strategies: data alone
        impls = [i for i in data_impls if i == "auto" or only_data]
        for schedule in (schedules if pipe > 1 else ("",)):
            if schedule == "interleaved" and (shape.layers // pipe) % VIRTUAL:
                continue
            for m in microbatch_choices(rows, pipe, schedule):
                for impl, remat, precision, attention in itertools.product(impls, remats, precisions, attentions):
                    if precision == "float8" and (sizes["tensor"] > 1 or pipe > 1):
                        continue          # not modelled: see FP8_NOT_MODELLED
                    out.append(Candidate(**sizes, microbatches=m, schedule=schedule, remat=remat,  # type: ignore[arg-type]  # sizes: the int mesh axes
                                         precision=precision, attention=attention, data_impl=impl,
                                         context_impl="ring" if sizes["context"] > 1 else "auto"))
    return out

"""The fraction of each layout's communication that XLA:GPU hides, per mesh axis, measured from compiled
schedules: `jaxpar lab overlap` compiles the 7B on 64 H100s (deviceless) and replays each schedule
(jaxpar/measure/overlap.py); its `measured_fractions` are recorded in overlap_measured.json beside this file.

A layout is keyed by all of it (`layout_key`): every mesh axis in use with its implementation, sequence
parallelism, parallel.tensor_overlap, parallel.prefetch and gradient buckets, so hand-written tensor
parallelism, collective matmul and ZeRO-3 prefetch each get their own figure, not XLA's. A layout the
table lacks borrows, per axis, the figure of the closest recorded layout that is part of it (every
token of the recorded key is in the candidate's, so no overlap technique it does not use is credited),
preferring the one sharing most; none: the planner's assumed OVERLAP (steptime.py).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

PATH = Path(__file__).with_name("overlap_measured.json")
MESH_AXES = ("data", "fsdp", "tensor", "pipe", "expert")


def layout_key(cand) -> str:
    """The whole layout of a candidate, e.g. 'data=auto tensor=manual sequence tensor_overlap=collective_matmul'."""
    tokens = [f"{axis}={cand.impls[axis]}" for axis in MESH_AXES if cand.sizes[axis] > 1]
    if cand.tensor > 1 and cand.sequence:
        tokens.append("sequence")
    if cand.tensor > 1 and cand.tensor_overlap not in ("", "none"):
        tokens.append(f"tensor_overlap={cand.tensor_overlap}")
    if cand.prefetch:
        tokens.append("prefetch")
    if cand.grad_buckets:
        tokens.append(f"buckets={cand.grad_buckets}")
    return " ".join(tokens)


@functools.cache
def measured() -> tuple:
    """((layout key, axis), hidden fraction) pairs of the recorded compiles; () when none are recorded."""
    if not PATH.exists():
        return ()
    table = json.loads(PATH.read_text())["hidden_fraction"]
    return tuple(sorted(((layout, axis), float(f)) for layout, axes in table.items() for axis, f in axes.items()))


def hidden_fraction(table: tuple, layout: str, axis: str) -> float | None:
    """The recorded fraction of `layout` on `axis`, else the closest recorded part of it (module docstring)."""
    wanted = set(layout.split())
    best: tuple | None = None
    for (key, recorded_axis), fraction in table:
        if recorded_axis != axis:
            continue
        if key == layout:
            return fraction
        tokens = set(key.split())
        if tokens <= wanted:
            rank = (len(tokens), key)           # the most of the layout; ties: the same key every time
            if best is None or rank > best[0]:
                best = (rank, fraction)
    return None if best is None else best[1]


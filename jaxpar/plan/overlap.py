"""The fraction of each strategy's communication that XLA:GPU hides, per mesh axis, measured from compiled
schedules: `jaxpar lab overlap` compiles the 7B on 64 H100s (deviceless) and replays each schedule
(jaxpar/measure/overlap.py); its `measured_fractions` are recorded in overlap_measured.json beside this file.

The planner (steptime.py) uses a measured fraction for the flows of a (strategy, axis) the table holds,
in place of the assumed OVERLAP of the hideable flows; the rest keep the assumption. Strategy keys are
the candidate's `data_impl` ("auto": XLA's layouts; "zero3": the hand-written ZeRO-3 over `data`), with
"+tensor" when the candidate splits tensors (its fsdp collectives then overlap differently).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

PATH = Path(__file__).with_name("overlap_measured.json")


@functools.cache
def measured() -> tuple:
    """((strategy, axis), hidden fraction) pairs of the recorded compiles; () when none are recorded."""
    if not PATH.exists():
        return ()
    table = json.loads(PATH.read_text())["hidden_fraction"]
    return tuple(sorted(((strategy, axis), float(f)) for strategy, axes in table.items() for axis, f in axes.items()))


def hidden_fraction(table: tuple, strategy: str, axis: str) -> float | None:
    for key, fraction in table:
        if key == (strategy, axis):
            return fraction
    return None

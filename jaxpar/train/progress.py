"""Each training step's own time, observed without stalling the device.

The loop hands every step over right after dispatching it, and the clock then waits
for the step before it: one step always stays queued behind the running one, so the
host's work (the next batch, the guard) overlaps the device's. A step's time runs
from when the step before it finished (or from its dispatch, if that came later) to
when it finished. Before host work that belongs to no step (evaluation, saving,
logging) the loop calls `wait`, so that work never counts in a step.

Each step's end is also kept as wall-clock time (`ended`, seconds since the epoch): metrics.jsonl
records it as the step's `time`, not the time its logging interval was written.

The first step a process runs compiles: it gets no step time (the loop reports it
as the compile time). `on_finished(step)` runs as each step finishes: it moves the
progress bar every step, which is what gives the bar a real ETA.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class StepClock:
    def __init__(self, on_finished: Callable[[int], None] | None = None):
        self.on_finished = on_finished
        self._in_flight: tuple[int, Any, float] | None = None   # (step, outputs, dispatched at)
        self._last_finished: float | None = None   # perf_counter time the previous step was seen finished
        self._times: dict[int, float | None] = {}
        self.ended: dict[int, float] = {}   # step -> time.time() when it was seen finished; the loop pops them

    def dispatched(self, step: int, outputs, at: float) -> None:
        """`step` was dispatched at `at` (perf_counter) and yields `outputs`; waits for the step before it."""
        self.wait()
        self._in_flight = (step, outputs, at)

    def wait(self) -> None:
        """Wait for the step in flight, if any, and record its time."""
        if self._in_flight is None:
            return
        step, outputs, at = self._in_flight
        self._in_flight = None
        jax.block_until_ready(outputs)
        finished = time.perf_counter()
        self.ended[step] = time.time()
        last = self._last_finished
        self._times[step] = None if last is None else finished - max(at, last)
        self._last_finished = finished
        if self.on_finished:
            self.on_finished(step)

    def take(self) -> dict[int, float | None]:
        """{step: seconds} of the steps finished since the last call (None: the compiling step).

        In a multi-process run every process takes process 0's times, so that all of them
        report the same throughput and MFU for the same global steps.
        """
        self.wait()
        times, self._times = self._times, {}
        if jax.process_count() > 1 and times:
            steps = sorted(times)
            values = np.array([np.nan if times[s] is None else times[s] for s in steps], np.float32)
            values = np.asarray(multihost_utils.broadcast_one_to_all(values))
            times = {s: None if np.isnan(v) else float(v) for s, v in zip(steps, values)}
        return times

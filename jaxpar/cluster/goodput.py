"""Goodput: the share of a job's wall time spent on training steps that count.

Wall time runs from the job's first start to now, across restarts. It splits into
productive time (steps whose result the run keeps) and badput:

  startup_compile  process start, data, state init, the first (compiling) step
  checkpoint       the blocking part of checkpoint saves (and the final wait)
  restart          time between a failure and the restart, plus the re-done steps:
                   steps a crashed attempt ran after its last checkpoint
  data_wait        the loop waiting for its next batch
  other            evaluation, logging, sampling: whatever the rest leaves

Process 0 keeps a ledger in the run directory (goodput.json) so that a restarted
attempt can reclassify the time of the attempts before it. `restarts` counts
restarts of the job (`jaxpar launch --max-restarts`, Slurm requeues).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

BADPUT = ("startup_compile", "checkpoint", "restart", "data_wait", "other")
ENV_ATTEMPT_START = "JAXPAR_ATTEMPT_START"   # epoch seconds the launcher started this attempt
ENV_RESTARTS = "JAXPAR_RESTART_COUNT"        # set by `jaxpar launch`; Slurm sets SLURM_RESTART_COUNT


def restart_count(environ=os.environ) -> int:
    """How many times this job was restarted before this attempt (0 on its first start)."""
    return max(int(environ.get(ENV_RESTARTS) or 0), int(environ.get("SLURM_RESTART_COUNT") or 0))


_process_started_a_run = False


def attempt_start(entered: float, environ=os.environ) -> float:
    """When this attempt started: the launcher's start of the processes, else this process's start time;
    for a second run in one process (tests, notebooks), `entered` (when `train` was called)."""
    global _process_started_a_run
    first, _process_started_a_run = not _process_started_a_run, True
    if not first:
        return entered
    if environ.get(ENV_ATTEMPT_START):
        return float(environ[ENV_ATTEMPT_START])
    try:   # Linux: /proc/<pid> is created with the process
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return time.time()


class Goodput:
    """Time accounting for one attempt, on top of what earlier attempts left in the ledger."""

    def __init__(self, ledger: Path | None, resume_step: int | None, *, write: bool, now=time.time,
                 entered: float | None = None, start: float | None = None):
        self.path, self.write, self.now = ledger, write, now
        self.start = start if start is not None else attempt_start(entered if entered is not None else now())
        self.restarts = restart_count()
        self.seconds = {"productive": 0.0, **{k: 0.0 for k in BADPUT}}
        self.step = resume_step or 0
        self.productive_at = {self.step: 0.0}   # cumulative productive seconds of this attempt at saved steps
        self.redone_steps = 0
        self.timeline: list[list[float]] = []
        self.job_start = self.start
        self.committed: dict = {}   # earlier attempts' seconds, reclassified
        previous = json.loads(ledger.read_text()) if resume_step is not None and ledger and ledger.exists() else None
        if previous and resume_step is not None:
            self._take_over(previous, resume_step)

    def _take_over(self, previous: dict, resume_step: int) -> None:
        """Carry the earlier attempts' time over: what they did after `resume_step` becomes restart time."""
        self.job_start = previous["job_start"]
        self.timeline = previous.get("timeline", [])
        committed = previous["committed"]
        last = previous["attempt"]
        kept = _productive_at(last["productive_at"], resume_step)
        for key, value in last["seconds"].items():
            committed[key] = committed.get(key, 0.0) + value
        committed["productive"] -= last["seconds"]["productive"] - kept
        gap = max(0.0, self.start - last["updated"])
        if last.get("finished"):   # a finished run continued later (more steps): the pause is not lost time
            self.job_start += gap
            gap = 0.0
        committed["restart"] += last["seconds"]["productive"] - kept + gap
        self.committed = committed
        self.redone_steps = previous.get("redone_steps", 0) + max(0, last["step"] - resume_step)

    def add(self, bucket: str, seconds: float) -> None:
        self.seconds[bucket] += seconds

    def stepped(self, step: int) -> None:
        self.step = step

    def saved(self, step: int) -> None:
        self.productive_at[step] = self.seconds["productive"]

    def totals(self) -> dict:
        """The job so far: wall time, productive time, goodput and the badput split (seconds)."""
        now = self.now()
        seconds = {k: self.committed.get(k, 0.0) + v for k, v in self.seconds.items()}
        wall = now - self.job_start
        accounted = sum(v for k, v in seconds.items() if k != "other")
        seconds["other"] = max(0.0, wall - accounted)
        return {"wall_s": wall, "productive_s": seconds["productive"],
                "goodput": seconds["productive"] / wall if wall > 0 else 0.0,
                "badput_s": {k: seconds[k] for k in BADPUT}, "restarts": self.restarts,
                "redone_steps": self.redone_steps}

    def flush(self, finished: bool = False) -> dict:
        """Write the ledger (process 0) and return the totals; called at every log interval and save.

        `finished`: the run reached its last step (a later resume is a continuation, not a restart).
        """
        totals = self.totals()
        self.timeline.append([round(self.now() - self.job_start, 3), self.step, round(totals["productive_s"], 3),
                              self.restarts])
        if self.write and self.path is not None:
            ledger = {"job_start": self.job_start, "committed": self.committed,
                      "redone_steps": self.redone_steps, "timeline": self.timeline,
                      "attempt": {"start": self.start, "updated": self.now(), "step": self.step,
                                  "seconds": self.seconds, "finished": finished,
                                  "productive_at": {str(k): v for k, v in self.productive_at.items()}}}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(ledger))
            tmp.replace(self.path)   # atomic: a crash never leaves half a ledger
        return totals


def _productive_at(marks: dict, step: int) -> float:
    """Productive seconds an attempt had spent up to `step` (its newest mark at or before it)."""
    kept = [(int(s), v) for s, v in marks.items() if int(s) <= step]
    return max(kept)[1] if kept else 0.0

"""Preemption: SIGTERM or SIGUSR1 means "save and leave", not "die".

A batch system announces the end of an allocation with a signal (Slurm's
`--signal=B:USR1@90` through the batch script, Kubernetes' SIGTERM before the grace
period ends). The loop finishes its current step, writes a checkpoint, and exits with
EXIT_PREEMPTED; the next start of the job resumes from that checkpoint.

Every process must stop at the same step or the ones that go on wait forever in a
collective. In a multi-process job JAX's own preemption service does this: it turns
SIGTERM into a notice that `reached_preemption_sync_point` reports on every process
at the same step. SIGUSR1 is passed on to it as SIGTERM. A single process just sets a flag.
"""
from __future__ import annotations

import os
import signal

import jax
from jax.experimental import multihost_utils

from jaxpar.env import EXIT_PREEMPTED


class Preempted(Exception):
    """The run saved a checkpoint after a preemption signal and stopped; the message is one line."""

    exit_code = EXIT_PREEMPTED


class Preemption:
    """Install the signal handlers for the life of a training loop (main thread only)."""

    def __init__(self):
        self.requested = False
        self.multi_process = jax.process_count() > 1
        self._previous = {}
        for sig in (signal.SIGUSR1,) if self.multi_process else (signal.SIGUSR1, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:   # not the main thread (e.g. a test runs the loop in a thread)
                pass

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        if self.multi_process and signum != signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)   # JAX's preemption notifier listens for SIGTERM

    def reached(self, step: int) -> bool:
        """True on every process at the same step once any of them was signalled."""
        if self.multi_process:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

"""Preemption: SIGTERM or SIGUSR1 means "save and leave", not "die".

A batch system announces the end of an allocation with a signal (Slurm's
`--signal=B:USR1@90` through the batch script, Kubernetes' SIGTERM before the grace
period ends). The loop finishes its current step, writes a checkpoint, and exits with
EXIT_PREEMPTED; the next start of the job resumes from that checkpoint.

The notice can come at any moment, also while the job starts (importing, joining the other
processes, loading data, restoring, compiling): `jaxpar train` listens from its first line
(`listen_from_start`, before any heavy import). Until `train` is about to write the run
directory nothing exists to save or tidy, so a notice then ends the process at once with
EXIT_PREEMPTED (`_exit_now`; in a multi-process job only until the process joins the job).
After that, `train` looks again before its first step; a notice there also saves nothing,
as nothing new exists to save. While it restores or initialises the state and compiles and runs the
first step, nothing new exists either, yet the main thread sits in XLA for seconds to
minutes and a Python signal handler runs only when it comes back: `exits_at_once` watches
from a thread (the signal's byte on `signal.set_wakeup_fd`; in a multi-process job also a
peer's word that it left, `agreement.announce_leaving`) and ends the process with
EXIT_PREEMPTED at once, the compile abandoned, not awaited.

Every process must stop at the same step (a collective save needs all of them) or the ones that go on
wait forever in a collective. In a multi-process job jaxpar's own handler takes the signals on every
process as on one (JAX's preemption service is switched off: its sync point was measured to miss
notices), and the processes agree once per step, through the job's coordinator, whether any of them got
a notice (train/agreement.py): every process learns of a notice to any process at the same step. Once
the save is durable process 0 records it for `jaxpar launch` (`ENV_PREEMPTION_RECORD`), which then exits
75 even when a process was killed on its way out. A single process just sets a flag.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpar.env import ENV_PREEMPTION_RECORD, EXIT_PREEMPTED
from jaxpar.train.agreement import JobAgreement, PeerLeft, announce_leaving, peer_left

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# After a preemption save process 0 waits this long before it exits: it hosts JAX's distributed service, and a
# peer still on its way out when the service goes is aborted (exit 134, not 75: Slurm would not requeue the job).
PEERS_LEAVE_FIRST_S = 1.0
WATCH_POLL_S = 0.1

_early: dict[str, Any] = {"requested": False, "previous": {}, "exit_at_once": False}   # listen_from_start


class Preempted(Exception):
    """The run stopped after a preemption signal (saving first if it had anything new); the message is one line."""

    exit_code = EXIT_PREEMPTED


def during_start_up(stage: str) -> Preempted:
    return Preempted(f"preempted during start-up ({stage}); nothing new to save, nothing saved; "
                     "start the run again to continue it")


def listen_from_start(exit_at_once: bool = True) -> None:
    """From now on (the first line of `jaxpar train`, before any heavy import) a preemption notice ends the
    process with EXIT_PREEMPTED and one line; `exit_at_once=False` (main called in-process) records it for
    `Preemption`, which takes the notice and the handlers over."""
    def early(signum, frame):
        _early["requested"] = True
        if exit_at_once and not _joined():   # once joined, the processes of a job stop together (agreement.py)
            _exit_now()

    _early["exit_at_once"] = exit_at_once

    for sig in SIGNALS:
        try:
            _early["previous"].setdefault(sig, signal.signal(sig, early))
        except ValueError:   # not the main thread
            pass


def _joined() -> bool:
    """This process joined a multi-process job (jax.distributed is initialized)."""
    jax = sys.modules.get("jax")
    return jax is not None and hasattr(jax, "distributed") and jax.distributed.is_initialized()


def _exit_now(stage: str = "before the run directory was written") -> None:
    """End a process that has nothing new to save: one line, EXIT_PREEMPTED. Not an exception raised from the
    handler: that surfaces wherever the main thread is, and a library may swallow or rewrap it (measured: an
    ImportError from jaxlib's extension, an "Exception ignored" in a gc callback)."""
    sys.stdout.flush()
    print(during_start_up(stage), file=sys.stderr, flush=True)
    os._exit(EXIT_PREEMPTED)


def stop_listening() -> None:
    """Undo `listen_from_start` when no `Preemption` took over (the command ended before training)."""
    for sig, handler in _early["previous"].items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    _early.update(requested=False, previous={}, exit_at_once=False)


class Preemption:
    """Install the signal handlers for the life of a training run (main thread only); a context manager."""

    def __init__(self):
        import jax
        self.requested, _early["requested"] = _early["requested"], False
        self.multi_process = jax.process_count() > 1
        self.agreement = JobAgreement(jax.process_count()) if self.multi_process else None
        self.owns_process = bool(_early.get("exit_at_once"))   # the command is this process: it may end it
        # until the run directory is written, a notice to a single process ends it at once (see listen_from_start)
        self.exit_at_once = bool(_early.get("exit_at_once")) and not self.multi_process
        self._previous, _early["previous"] = dict(_early["previous"]), {}
        for sig in SIGNALS:   # a repeated notice (the launcher passes the group's signal on) only sets the flag again
            try:
                self._previous.setdefault(sig, signal.signal(sig, self._on_signal))
            except ValueError:   # not the main thread (e.g. a test runs the loop in a thread)
                pass

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        if self.exit_at_once:
            _exit_now()

    def reached(self, step: int | None = None) -> bool:
        """True on every process at the same call once any of them was signalled (`step`: for the reader).
        Raises `Preempted` when a peer left at once after a notice: nothing can be saved without it."""
        if self.agreement is None:
            return self.requested
        try:
            return self.agreement.any_notice(self.requested)
        except PeerLeft:
            where = "before the first step" if step is None else f"at step {step}"
            raise Preempted(f"preempted {where}: another process of the job left after a notice while it had "
                            "nothing new to save; nothing saved; start the run again to continue it") from None

    @contextlib.contextmanager
    def exits_at_once(self, stage: str, release: Callable[[], None]) -> Iterator[None]:
        """Within: nothing new exists since the last durable checkpoint (or none is needed), so a notice ends the
        process at once, from a thread, with EXIT_PREEMPTED after `release` (the run lock), on every process.
        In a job, process 0 (the host of JAX's service) leaves last. Only where the command is the process and
        this is the main thread; elsewhere the notice is acted on after the step, as before."""
        if not self.owns_process or threading.current_thread() is not threading.main_thread():
            yield
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        window, lock = {"open": True}, threading.Lock()
        watcher = threading.Thread(target=self._watch, args=(read_fd, window, lock, stage, release), daemon=True,
                                   name="jaxpar-preemption-watch")
        watcher.start()
        try:
            yield
        finally:
            with lock:   # from here on a notice is acted on after the step
                window["open"] = False
            signal.set_wakeup_fd(previous_fd)
            watcher.join()
            os.close(read_fd)
            os.close(write_fd)

    def _watch(self, read_fd: int, window: dict[str, bool], lock: threading.Lock, stage: str,
               release: Callable[[], None]) -> None:
        wanted = {int(sig) for sig in SIGNALS}
        while window["open"]:
            ready, _, _ = select.select([read_fd], [], [], WATCH_POLL_S)
            signalled = (bool(ready) and bool(wanted & set(os.read(read_fd, 64)))) or self.requested   # or before
            if not (signalled or (self.multi_process and peer_left())):
                continue
            with lock:
                if not window["open"]:
                    return
                if self.multi_process:
                    self._tell_the_job()
                release()
                _exit_now(stage)

    @staticmethod
    def _tell_the_job() -> None:
        """Tell every process that this one leaves (a peer waiting for it in the agreement leaves too), then, on
        process 0, give the peers time to leave before the coordinator they are connected to goes."""
        import jax
        announce_leaving(jax.process_index())
        if jax.process_index() == 0:
            time.sleep(PEERS_LEAVE_FIRST_S)

    def stop_if_requested(self, stage: str) -> None:
        """During start-up: raise `Preempted` (nothing saved: there is nothing new) once a notice came."""
        self.exit_at_once = False   # the run directory is written next: from now on a notice is acted on here
        if self.reached():
            raise during_start_up(stage)

    def leave_after_save(self, step: int) -> None:
        """After the preemption save of `step` (this process's part waited for): once every process is here the
        step is durable; process 0 records it for the launcher and, as the coordinator's host, leaves last."""
        import jax
        if self.multi_process:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("jaxpar-preempted")
        if jax.process_index() == 0:
            record = os.environ.get(ENV_PREEMPTION_RECORD)
            if record:
                Path(record).write_text(f"{step}\n")
            if self.multi_process:
                time.sleep(PEERS_LEAVE_FIRST_S)   # or a peer still exiting is aborted

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

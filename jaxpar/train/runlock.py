"""One run per run directory: an exclusive lock held for the run's whole life.

A requeued Slurm job or a restarted pod can start while the old one still runs; two
runs in one folder rotate each other's checkpoints away and log every step twice. The
lock is `flock` on `run.lock` in the run directory: the kernel releases it when its
holder exits in any way (a crash or kill -9 included), so a lock left by a dead process
is never in the way and needs no clean-up. The file records the holder (pid, host, start
time) only to name it when a second run is refused. In a multi-process job process 0
holds it for all. (flock is per host: on NFS, Linux maps it to NFS byte-range locks.)
Nothing here imports JAX.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from jaxpar.config import ConfigError

LOCK_FILE = "run.lock"


class RunLock:
    """`acquire(run_dir)` takes the lock or raises `ConfigError` naming its holder; `release()` (also on exit of the
    `with` block) lets it go. Acquiring again while held is a no-op."""

    def __init__(self) -> None:
        self.file: IO[str] | None = None
        self.run_dir: Path | None = None

    def acquire(self, run_dir: Path) -> None:
        if self.file is not None:
            return
        path = Path(run_dir) / LOCK_FILE
        file = open(path, "a+")   # noqa: SIM115 - held open for the run's life: the open file is the lock
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = _describe(file.read())
            file.close()
            raise ConfigError("--run-dir", f"'{run_dir}' is in use by another run ({holder}); wait for it to end "
                              "or stop it, or choose another --run-dir") from None
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}) + "\n")
        file.flush()
        self.file, self.run_dir = file, Path(run_dir)

    def release(self) -> None:
        if self.file is not None:
            self.file.close()   # closing the only descriptor releases the flock
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _describe(text: str) -> str:
    """The holder recorded in the lock file, as 'pid 123 on host h since 2026-12-02 06:30:00'."""
    try:
        holder = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["started"])))
        return f"pid {int(holder['pid'])} on host {holder['host']} since {started}"
    except (ValueError, KeyError, TypeError):
        return "its holder did not record itself yet"

"""Orbax checkpoints of the train state and the global data position, verified on restore.

Saves are asynchronous: the step loop continues while the previous state is
written. A crash mid-save leaves a temporary directory that Orbax ignores.

Every save also records a checksum of every array (jaxpar/train/checksum.py) and the
data position (step, sample index, global batch). A restore recomputes the
checksums; a step whose bytes changed, whose files are truncated or missing, or
that fails to read in any other way is reported in one line and the step before
it is tried. Orbax has no such fallback, and a damaged array file otherwise
restores silently (the run then trains on garbage) or raises a bare TensorStore
`Exception`. A step saved by this version carries a format marker in Orbax's step
metadata, so a step whose checksum record is missing or empty is damaged too; only
steps saved before checksums existed (no `meta` item, no marker) restore unchecked.

A save that cannot be written (read-only folder, full disk) ends the run with one
line naming the folder and the cause (`SaveFailed`, exit 74); the steps saved before
it are kept (Orbax rotates old steps only after a save has committed).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.train.checksum import checksums, mismatches

EXIT_SAVE_FAILED = 74    # EX_IOERR
FORMAT_KEY = "jaxpar_checkpoint_format"
FORMAT = 2               # 1: no checksums (no `meta` item); 2: every array's checksum in `meta`


class SaveFailed(Exception):
    """A checkpoint (or another file of the run directory) could not be written; the message is one line naming
    the folder and the cause."""

    exit_code = EXIT_SAVE_FAILED


def write_failed(err: OSError, run_dir: Path) -> Exception:
    """The one-line report of a failed write into `run_dir` (`err` itself when it concerns another file)."""
    name = Path(err.filename or "")
    if not err.filename or not name.absolute().is_relative_to(Path(run_dir).absolute()):
        return err
    cause = f"'{run_dir}' was deleted while the run used it" if not Path(run_dir).exists() else err.strerror
    return SaveFailed(f"run directory: cannot write {name}: {cause}; stopped")


class Checkpoints:
    def __init__(self, directory: Path, keep: int, notice=print):
        self.directory = Path(directory).absolute()
        self.notice = notice
        self.saving: int | None = None   # the step whose asynchronous save may still be running
        _quiet_orbax_error_logs()
        _silence_orbax_leftovers()   # a failed write's callbacks print before the failure reaches us
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True, create=True),
        )
        self.meta: dict | None = None   # the restored step's metadata
        self.damaged: list[int] = []    # newer steps that failed to restore

    def save(self, step: int, state, global_batch: int) -> None:
        """Save `state` after `step` steps; the data position is `step` global batches of `global_batch`.

        Raises `SaveFailed` when this save cannot start or the previous one failed."""
        self._probe(step)
        meta = {"step": step, "sample_index": step * global_batch, "global_batch": global_batch,
                "checksums": checksums(state)}
        self._orbax(step, self.manager.save, step, custom_metadata={FORMAT_KEY: FORMAT},
                    args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self.saving = step

    def _probe(self, step: int) -> None:
        """Fail before Orbax starts: a save whose temporary folder cannot be created leaves Orbax's
        background threads waiting for it forever, and the process would never exit."""
        try:
            os.rmdir(tempfile.mkdtemp(prefix=f".probe-{step}-", dir=self.directory))
        except OSError as err:
            raise self._failed(step, err) from None

    def _orbax(self, step: int, call, *args, **kwargs):
        """Run an Orbax call that may report a failed background save (of `self.saving`, else `step`)."""
        try:
            return call(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - TensorStore raises ValueError or bare Exception
            raise self._failed(self.saving or step, err) from None

    def _failed(self, step: int, err: Exception) -> SaveFailed:
        """The one-line report of a failed save; removes its partial files (space on a full disk)."""
        self.saving, self.manager = None, None   # Orbax's threads of a failed save may never end: not waited for
        if jax.process_index() == 0:
            self._remove_partial(step)
        kept = [s for s in _committed_steps(self.directory) if s != step]
        last = f"the last good checkpoint, step {kept[-1]}, is kept" if kept else "no earlier checkpoint exists"
        return SaveFailed(f"checkpoint: cannot save step {step} in {self.directory}: {_cause(err)}; "
                          f"stopped ({last})")

    def _remove_partial(self, step: int, settle_s: float = 0.2, limit_s: float = 10.0) -> None:
        """Remove the failed save's temporary folders until none reappears for `settle_s`: Orbax's threads of
        that save may still be writing into one while it is removed (seen once: the folder outlived a single
        pass). Gives up after `limit_s` (a later run's manager removes what is left)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            partials = list(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
            for partial in partials:
                shutil.rmtree(partial, ignore_errors=True)
            if not partials:
                time.sleep(settle_s)
                if not any(self.directory.glob(f"{step}.orbax-checkpoint-tmp*")):
                    return

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, abstract_state):
        """Restore the newest intact step onto `abstract_state`'s shardings; returns (step, state).

        Newer steps that fail are listed in `self.damaged` (training moves them aside with
        `set_aside_damaged`). Returns (None, None) when no step is intact. Changes no file.
        """
        damaged = []
        for step in reversed(self.steps()):
            items = {"state": ocp.args.StandardRestore(abstract_state)}
            if (self.directory / str(step) / "meta").is_dir():
                items["meta"] = ocp.args.JsonRestore()
            restored, failure = read_quietly(self.manager.restore, step, args=ocp.args.Composite(**items))
            if failure:
                reason = f"unreadable ({failure})"
            else:
                meta = dict(restored.items()).get("meta") or {}
                recorded = meta.get("checksums")
                if not recorded and not self._predates_checksums(step):
                    reason = "damaged (its checksum record is missing or empty)"
                elif not (bad := mismatches(restored["state"], recorded or {})):
                    if not recorded:
                        self.notice(f"checkpoint step {step} predates checksums: restored unchecked")
                    self.damaged = damaged
                    self.meta = {"step": step, **meta}
                    return step, restored["state"]
                else:
                    reason = f"damaged (checksum mismatch in {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})"
            damaged.append(step)
            self.notice(f"checkpoint step {step} is {reason}; trying an older one")
        return None, None

    def set_aside_damaged(self) -> None:
        """Move the damaged steps to `<run>/damaged-checkpoints/` (kept for inspection), so that the
        resumed run can save those step numbers again."""
        steps, self.damaged = self.damaged, []
        if not steps:
            return
        aside = self.directory.parent / "damaged-checkpoints"
        if jax.process_index() == 0:
            aside.mkdir(exist_ok=True)
            for step in steps:
                target = aside / str(step)
                if target.exists():
                    shutil.rmtree(target)
                shutil.move(str(self.directory / str(step)), target)
        multihost_utils.sync_global_devices("jaxpar-damaged-checkpoints-moved")
        self.manager.reload()
        self.notice(f"moved damaged step(s) {', '.join(map(str, steps))} to {aside}")

    def _predates_checksums(self, step: int) -> bool:
        """True for a step saved before checksums existed: Orbax's step metadata names no `meta` item and no
        format marker. A step without that metadata cannot prove its age, so it counts as checksummed."""
        try:
            metadata = self.manager.metadata(step)
        except Exception:  # noqa: BLE001 - unreadable metadata: no proof of an old format
            return False
        handlers, custom = metadata.item_handlers or {}, metadata.custom_metadata or {}
        return bool(handlers) and "meta" not in handlers and FORMAT_KEY not in custom

    def wait(self) -> None:
        self._orbax(self.saving or 0, self.manager.wait_until_finished)
        self.saving = None

    def close(self) -> None:
        """Wait for the last save and stop Orbax's threads (idempotent: also called when training fails).
        Raises `SaveFailed` when that save failed."""
        if self.manager is not None:
            self.wait()
            self.manager.close()
            self.manager = None


def read_quietly(read, *args, **kwargs):
    """Run `read(*args, **kwargs)`; returns (result, None), or (None, "ExceptionName: first line") when it fails.

    When one array of a restore fails, Orbax abandons the reads of the others. Freed later, they print
    tracebacks after jaxpar's one-line report: "Exception ignored in" for their coroutines, "Event loop
    is closed" (through sys.excepthook or the unraisable hook) for TensorStore callbacks landing on
    Orbax's closed loop, even seconds later, and asyncio's "Task/Future exception was never
    retrieved" and Python's "coroutine ... was never awaited" at exit. Once a read failed (or a `Checkpoints`
    exists: a failed write leaves the same), those are silenced for the rest of the process; anything else is
    reported as before."""
    try:
        return read(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - TensorStore raises bare Exception on truncated files
        _silence_orbax_leftovers()
        return None, f"{type(err).__name__}: {_first_line(err)}"


def _from_orbax(tb) -> bool:
    while tb is not None:
        if "/orbax/" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _on_closed_loop(error) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _silence_orbax_leftovers() -> None:
    if getattr(sys.unraisablehook, "silences_orbax_leftovers", False):
        return
    unraisable_hook, except_hook = sys.unraisablehook, sys.excepthook

    def quiet_unraisable(unraisable):
        if not (_on_closed_loop(unraisable.exc_value) or _from_orbax(unraisable.exc_traceback)):
            unraisable_hook(unraisable)

    def quiet_except(kind, error, tb):
        if not _on_closed_loop(error):
            except_hook(kind, error, tb)

    quiet_unraisable.silences_orbax_leftovers = True   # type: ignore[attr-defined]  # a marker read with getattr
    sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_except
    logging.getLogger("asyncio").addFilter(
        lambda record: "exception was never retrieved" not in str(record.msg))
    # an abandoned read's coroutine, freed at exit: "sys:1: RuntimeWarning: coroutine '...' was never awaited"
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


def _committed_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def _cause(err: Exception) -> str:
    """The operating system's reason when there is one ("No space left on device"), else the first line."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    code = re.search(r"os_error_code='?(\d+)", str(err))   # TensorStore: "... [os_error_code='28']"
    return os.strerror(int(code.group(1))) if code else f"{type(err).__name__}: {_first_line(err)}"


def _quiet_orbax_error_logs() -> None:
    """Orbax logs each failure of a background save with a traceback from every thread involved (hundreds of
    lines); the failure also reaches the main thread, which reports it in one line (`SaveFailed`)."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxTracebacks) for f in logger.filters):
        logger.addFilter(_OrbaxTracebacks())


class _OrbaxTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info and "/orbax/" in record.pathname)


def _first_line(err: Exception) -> str:
    text = str(err).split(". See full")[0].strip().splitlines()   # TensorStore appends a bound-method repr
    return text[0][:120] if text else ""

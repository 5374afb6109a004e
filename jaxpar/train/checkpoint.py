"""Orbax checkpoints of the train state and the global data position, verified on restore.

Saves are asynchronous: the step loop continues while the previous state is
written. A crash mid-save leaves a temporary directory that Orbax ignores.

Every save also records a checksum of every array (jaxpar/train/checksum.py) and the
data position (step, sample index, global batch). A restore recomputes the
checksums; a step whose bytes changed, whose files are truncated or missing, or
that fails to read in any other way is reported in one line and the step before
it is tried. Orbax has no such fallback, and a damaged array file otherwise
restores silently (the run then trains on garbage) or raises a bare TensorStore
`Exception`.
"""
from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.train.checksum import checksums, mismatches


class Checkpoints:
    def __init__(self, directory: Path, keep: int, notice=print):
        self.directory = Path(directory).absolute()
        self.notice = notice
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True, create=True),
        )
        self.meta: dict | None = None   # the restored step's metadata
        self.damaged: list[int] = []    # newer steps that failed to restore

    def save(self, step: int, state, global_batch: int) -> None:
        """Save `state` after `step` steps; the data position is `step` global batches of `global_batch`."""
        meta = {"step": step, "sample_index": step * global_batch, "global_batch": global_batch,
                "checksums": checksums(state)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, abstract_state):
        """Restore the newest intact step onto `abstract_state`'s shardings; returns (step, state).

        Newer steps that fail are listed in `self.damaged` (training moves them aside with
        `set_aside_damaged`). Returns (None, None) when no step is intact. Changes no file.
        """
        damaged = []
        for step in reversed(self.steps()):
            # Checkpoints written before checksums existed have no `meta` item: their state restores unchecked.
            items = {"state": ocp.args.StandardRestore(abstract_state)}
            if (self.directory / str(step) / "meta").is_dir():
                items["meta"] = ocp.args.JsonRestore()
            restored, failure = read_quietly(self.manager.restore, step, args=ocp.args.Composite(**items))
            if failure:
                reason = f"unreadable ({failure})"
            else:
                restored = {"meta": {"step": step}, **dict(restored.items())}
                bad = mismatches(restored["state"], restored["meta"].get("checksums", {}))
                if not bad:
                    self.damaged = damaged
                    self.meta = restored["meta"]
                    return step, restored["state"]
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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the last save and stop Orbax's threads (idempotent: also called when training fails)."""
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()
            self.manager = None


def read_quietly(read, *args, **kwargs):
    """Run `read(*args, **kwargs)`; returns (result, None), or (None, "ExceptionName: first line") when it fails.

    When one array of a restore fails, Orbax abandons the reads of the others. Freed later, they print
    tracebacks after jaxpar's one-line report: "Exception ignored in" for their coroutines, "Event loop
    is closed" (through sys.excepthook or the unraisable hook) for TensorStore callbacks landing on
    Orbax's closed loop, even seconds later, and asyncio's "Task/Future exception was never
    retrieved" at exit. Once a read failed, those are silenced for the rest of the process; anything else is
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

    quiet_unraisable.silences_orbax_leftovers = True
    sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_except
    logging.getLogger("asyncio").addFilter(
        lambda record: "exception was never retrieved" not in str(record.msg))


def _first_line(err: Exception) -> str:
    text = str(err).split(". See full")[0].strip().splitlines()   # TensorStore appends a bound-method repr
    return text[0][:120] if text else ""

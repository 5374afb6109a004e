"""Orbax checkpoints of the train state and the Grain iterator, with fallback on a bad step.

Saves are asynchronous: the step loop continues while the previous state is
written. A crash mid-save leaves a temporary directory that Orbax ignores; a
step that fails to restore (truncated or corrupted) is skipped in favour of
the one before it, since Orbax has no automatic fallback.
"""
from __future__ import annotations

from pathlib import Path

import grain
import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory: Path, keep: int):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True, create=True),
        )

    def save(self, step: int, state, data_iterator) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator)))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, abstract_state, data_iterator=None):
        """Restore the newest readable step onto `abstract_state`'s shardings; returns (step, state).

        With `data_iterator`, its position is restored in place too. Returns
        (None, None) when no step can be read.
        """
        for step in reversed(self.steps()):
            items = {"state": ocp.args.StandardRestore(abstract_state)}
            if data_iterator is not None:
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            except (FileNotFoundError, ValueError, KeyError) as err:
                print(f"checkpoint step {step} is unreadable ({type(err).__name__}); trying an older one")
                continue
            return step, restored["state"]
        return None, None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

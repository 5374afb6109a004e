"""Stop on bad numbers: a non-finite loss or gradient norm ends the run before it can save.

Large runs skip a few bad steps before giving up (`train.max_bad_steps`); a skipped
step's update is discarded. With `max_bad_steps=0` the loop never waits on a step it
just started: step s is checked once step s+1 has been dispatched, so the device stays
busy, and the step before a save is checked before the save. Either way no non-finite
state is ever saved, so checkpoint rotation never deletes the last good checkpoints.
"""
from __future__ import annotations

import math

import jax

EXIT_NON_FINITE = 3


class NonFiniteError(Exception):
    """Training produced a non-finite loss or gradient norm; the message is one line."""

    exit_code = EXIT_NON_FINITE


class NonFiniteGuard:
    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.bad_steps: list[int] = []
        self._unchecked: list[tuple[int, dict]] = []

    @property
    def skips(self) -> bool:
        """True when a bad step is undone instead of ending the run (the loop checks every step at once)."""
        return self.max_bad_steps > 0

    def after_step(self, step: int, metrics: dict) -> None:
        """Check the steps before `step` (already done, so no wait); `step` itself is checked next time."""
        earlier, self._unchecked = self._unchecked, [(step, metrics)]
        for s, m in earlier:
            self._check(s, m)

    def flush(self) -> None:
        """Check every step run so far (before a save, and at the end)."""
        pending, self._unchecked = self._unchecked, []
        for s, m in pending:
            self._check(s, m)

    def is_bad(self, step: int, metrics: dict) -> bool:
        """For skipping: True when `step` went bad (and may be skipped); raises once too many did."""
        bad = self._bad_values(metrics)
        if not bad:
            return False
        self.bad_steps.append(step)
        if len(self.bad_steps) > self.max_bad_steps:
            raise NonFiniteError(self._message(step, bad))
        return True

    def _check(self, step: int, metrics: dict) -> None:
        bad = self._bad_values(metrics)
        if bad:
            self.bad_steps.append(step)
            raise NonFiniteError(self._message(step, bad))

    @staticmethod
    def _bad_values(metrics: dict) -> dict[str, float]:
        values = jax.device_get({k: metrics[k] for k in ("loss", "grad_norm") if k in metrics})
        return {k: float(v) for k, v in values.items() if not math.isfinite(float(v))}

    def _message(self, step: int, bad: dict[str, float]) -> str:
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        skipped = f" after skipping {len(self.bad_steps) - 1} bad step(s)" if self.max_bad_steps else ""
        return (f"train: {what} at step {step}{skipped}; stopped without saving (the last checkpoints are "
                "kept); lower train.lr or raise train.max_bad_steps to skip such steps")

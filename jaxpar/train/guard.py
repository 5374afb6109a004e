"""Stop on bad numbers: a non-finite loss or gradient norm ends the run before it can save.

Large runs skip a few bad steps before giving up (`train.max_bad_steps`); a skipped
step's update is discarded. With `max_bad_steps=0` the loop never waits on a step it
just started: step s is checked once step s+1 has been dispatched, so the device stays
busy, and the step before a save is checked before the save.

The loss and gradient norm are computed before the update, so a finite step can still
write an exploded state (a learning rate of 1e30 turns finite gradients into parameters
of 1e29). The state itself is therefore checked before every save (`check_state`):
every parameter and optimizer moment must be finite and within STATE_LIMIT. No state
that fails is ever saved, so checkpoint rotation never deletes a good step in favour of
one that has not passed the guard.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

EXIT_NON_FINITE = 3
# No parameter or optimizer moment of a working run comes near this: weights start at ~0.02 and AdamW keeps
# them near 1, the moments follow the clipped gradient (|m| <= train.grad_clip, v <= its square). A state
# beyond it has exploded even while every number is still finite.
STATE_LIMIT = 1e8


@jax.jit
def _largest(leaves):
    # NaN when any element is NaN (XLA's max may skip NaNs), else the largest magnitude (inf included)
    return [jnp.where(jnp.isnan(x).any(), jnp.nan, jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in leaves]


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

    def check_state(self, step: int, state) -> None:
        """Raise unless every floating-point number of `state` (parameters, optimizer moments) is finite and
        |x| <= STATE_LIMIT; called before every save."""
        paths, leaves = zip(*[(path, x) for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
                              if jnp.issubdtype(x.dtype, jnp.floating)])
        for path, value in zip(paths, map(float, jax.device_get(_largest(list(leaves))))):
            if not value <= STATE_LIMIT:   # also NaN
                self.bad_steps.append(step)
                raise NonFiniteError(
                    f"train: the state after step {step} has exploded ({jax.tree_util.keystr(path)}: largest "
                    f"|x| {value:.3g}, allowed {STATE_LIMIT:g}); stopped without saving it (the last checkpoints "
                    "are kept); lower train.lr")

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

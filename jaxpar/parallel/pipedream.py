"""PipeDream-2BW's weight staleness (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
an optimizer wrapper, the numerics of an asynchronous pipeline without its flush.

PipeDream-2BW keeps two versions of the weights (double buffering): the microbatches of one step run
their forward and backward passes on the version one update old, while the newest one is produced,
so no stage waits for a flush. Its update rule is

    W(t+1) = W(t) - lr · grad f(W(t-1))

one step of delay. `delayed_gradient` applies exactly that: the gradient a step computes is kept in
the optimizer state and applied by the next step, so the update of step t+1 uses the gradient taken
at W(t) - the weights before the previous update. (The gradient of batch t is applied at step t+1:
the same sequence of updates with the batches shifted by one.) The first step applies nothing.
The state holds one more gradient-sized buffer, the second "B" of 2BW; its opt_state therefore has
its own pytree, and a checkpoint of this schedule restores only into this schedule.

What one SPMD program per step cannot show is the time saved: the next step's forwards filling this
step's drain need activations carried from one step to the next. Each step runs 1F1B's table.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class DelayedState(NamedTuple):
    inner: Any           # the wrapped optimizer's state
    previous: Any        # the last step's gradient, applied by the next step
    started: Any         # False until a gradient is waiting


def delayed_gradient(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` applied to the previous step's gradient (one step of staleness, PipeDream-2BW)."""

    def init(params):
        return DelayedState(inner.init(params), jax.tree.map(jnp.zeros_like, params), jnp.zeros((), bool))

    def update(grads, state, params=None):
        updates, inner_state = inner.update(state.previous, state.inner, params)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(state.started, n, o), new, old)
        updates = jax.tree.map(lambda u: jnp.where(state.started, u, jnp.zeros_like(u)), updates)
        return updates, DelayedState(keep(inner_state, state.inner), grads, jnp.ones((), bool))

    return optax.GradientTransformation(init, update)

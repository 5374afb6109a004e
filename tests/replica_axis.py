"""A toy strategy on a mesh axis of its own, `replica`, as docs/adding-a-strategy.md writes one: this file plus
one registry line, `NewAxis("replica", ReplicaStrategy)` (tests/test_new_axis.py adds it for its tests only).

Each `replica` group holds the same state and trains on the same batch (the axis splits nothing); after every
step the group averages its parameters with one all-reduce. The copies are equal, so the losses are the automatic
strategy's: the toy's point is the axis and its collective, not the arithmetic.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.theory import Flow

AXIS = "replica"


class ReplicaStrategy(AutoStrategy):
    """parallel.replica=mirror: the automatic step, then the parameters averaged over `replica`."""

    RUNS = {AXIS: ("mirror",)}

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        automatic = self.step_fn
        average = jax.shard_map(partial(jax.lax.pmean, axis_name=AXIS), mesh=mesh, in_specs=P(), out_specs=P(),
                                axis_names={AXIS})

        def step(state, tokens):
            state, metrics = automatic(state, tokens)
            return {**state, "params": average(state["params"])}, metrics

        self.step_fn = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, NamedSharding(mesh, P())),
                               donate_argnums=self.donate_argnums)

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        """The automatic strategy's flows, plus the average: a ring all-reduce of the fp32 parameters this device
        stores, 2(R-1)/R·4·Ψ_stored bytes (XLA combines the arrays' into one all-reduce)."""
        automatic = AutoStrategy.predict(shape, cand, global_batch, seq_len, platform)
        replicas = cand.sizes.get(AXIS, 1)
        if replicas == 1:
            return automatic
        sent = 2 * (replicas - 1) / replicas * 4 * automatic.stored["params"]
        average = Flow(AXIS, "all-reduce", sent, 1, False)
        return dataclasses.replace(automatic, flows=[*automatic.flows, average])

"""The hand-written pipeline's stage-owned state: the embedding lives on the first stage, the head and the final
norm on the last, as in Megatron, so no stage holds or all-reduces a copy it does not use.

SPMD gives every device the same shapes, so each such weight gets a leading slot axis of size p, sharded over
`pipe`: slot s is what stage s stores. `embed` [p, V, h] holds the embedding in the first stage's slot and the
head, as [V, h], in the last stage's (untied: the transposed `lm_head`, one V x h per device instead of two;
tied: a copy of the embedding). `final_norm` [p, h] and an MoE model's dense `blocks` [p, Ld, ...] sit in their
owner's slot; every other slot is zeros, gets zero gradients and stays zero. A stage's gradient is its own, so
nothing is summed over `pipe` but a tied embedding's, once per step between the first and the last stage (each
sends its part to the other: both copies then take the same update). Under DualPipeV's V the first and last
model stages share device 0: the head keeps its own `lm_head` [p, h, V] (untied) or reads the embedding's slot
(tied, no exchange at all).

Checkpoints keep the one canonical layout every strategy restores (`to_canonical` at save, `to_owned` at
restore). The tied copy counts once in the gradient's norm (`norm`); the final norm stays undecayed (`decays`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

AXIS = "pipe"


class StageOwned:
    """The layout for p stages: `first` and `last`, the devices that run model stage 0 and the last one."""

    def __init__(self, p: int, first: int, last: int, tied: bool, dense_blocks: bool):
        self.p, self.first, self.last, self.tied = p, first, last, tied
        self.head_in_embed = tied or first != last       # the head is the `embed` array's last slot
        self.exchange = tied and first != last           # the tied gradient, summed between first and last
        self.owners = {"embed": first, "final_norm": last, **({"blocks": first} if dense_blocks else {}),
                       **({} if self.head_in_embed else {"lm_head": last})}

    # ---------------------------------------------------------------- layouts
    def specs(self, canonical_specs: dict) -> dict:
        """The owned arrays' PartitionSpecs: the slot axis over `pipe`, the rest as the canonical array's."""
        slot = lambda s: P(AXIS, *s)
        return {k: jax.tree.map(slot, s, is_leaf=lambda x: isinstance(x, P)) if k in self.owners else s
                for k, s in canonical_specs.items() if k != "lm_head" or "lm_head" in self.owners}

    def _slots(self, w, filled: dict[int, jax.Array]):
        out = jnp.zeros((self.p, *w.shape), w.dtype)
        for s, value in filled.items():
            out = out.at[s].set(value)
        return out

    def to_owned(self, params: dict) -> dict:
        """Canonical params (or a moment of them) -> the stage-owned layout."""
        out = {k: w for k, w in params.items() if k not in self.owners and k != "lm_head"}
        for name, owner in self.owners.items():
            out[name] = jax.tree.map(lambda w, owner=owner: self._slots(w, {owner: w}), params[name])
        if self.head_in_embed:
            head = params["embed"] if self.tied else params["lm_head"].T
            out["embed"] = out["embed"].at[self.last].set(head)
        return out

    def to_canonical(self, owned: dict) -> dict:
        """The stage-owned layout -> canonical params (each weight from its owner's slot)."""
        out = {k: w for k, w in owned.items() if k not in self.owners}
        for name, owner in self.owners.items():
            out[name] = jax.tree.map(lambda w, owner=owner: w[owner], owned[name])
        if self.head_in_embed and not self.tied:
            out["lm_head"] = owned["embed"][self.last].T
        return out

    def state(self, state: dict, convert, keys: set[str]) -> dict:
        """`convert` applied to every params-shaped dict of a train state (the params, Adam's moments, a delayed
        gradient); `keys`: that dict's keys in the layout converted from."""
        is_params = lambda x: isinstance(x, dict) and set(x) == keys
        return jax.tree.map(lambda x: convert(x) if is_params(x) else x, state, is_leaf=is_params)

    # ---------------------------------------------------------------- the step
    def local(self, outer: dict) -> dict:
        """Inside the shard_map: this device's slot of each owned array ([1, ...] -> [...])."""
        return {k: jax.tree.map(lambda w: w[0], v) if k in self.owners else v for k, v in outer.items()}

    def exchange_tied(self, grads: dict) -> dict:
        """Tied: the first stage's lookup gradient and the last stage's head gradient, each added to the other's
        (one `ppermute` each way between those two stages; every other stage's slot is zero)."""
        if not self.exchange:
            return grads
        g = grads["embed"]
        other = jax.lax.ppermute(g, AXIS, [(self.first, self.last), (self.last, self.first)])
        return {**grads, "embed": g + other}

    def norm(self, grads: dict):
        """The global norm of the canonical gradient: a tied head's slot is a copy of the embedding's."""
        if self.exchange:
            keep = (jnp.arange(self.p) != self.last).astype(grads["embed"].dtype)
            grads = {**grads, "embed": grads["embed"] * keep.reshape(-1, *([1] * (grads["embed"].ndim - 1)))}
        return optax.tree.norm(grads)

    def decays(self, params: dict) -> dict:
        """AdamW's mask as the canonical layout's (more than one axis), not counting the slot axis."""
        return {k: jax.tree.map(lambda w, k=k: w.ndim - (k in self.owners) > 1, v) for k, v in params.items()}

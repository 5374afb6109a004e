"""Zero-bubble's split backward: B computes the input gradient now, W the weight gradients later.

A weight's gradient dW = x^T dy needs only what its matmul saw, the input x, and what
came back, the output gradient dy; nothing downstream waits for it. `deferred_ops`
swaps two `Ops` hooks so that each block matmul weight arrives with a zero "tap"
input beside it, and the matmul's backward returns the input gradient as usual but,
instead of dW, hands (x, dy) out as the tap's cotangent. A pipeline's B step
differentiates w.r.t. the stage input and the taps: it gets dx (to send upstream)
and the taps (to keep); its W step turns the kept taps into weight gradients with
the einsum's own transpose (`weight_grads`). The model is untouched.
(torch.distributed.pipelining does the same by splitting autograd's graph into
`stage_backward_input` and `stage_backward_weight`.)

Norm scales (1-D, elementwise) get their cheap gradients in B; every weight of 2 or
more dimensions in a block is consumed by exactly one matmul and is deferred, except an
MoE block's router and routed experts (their einsums and grouped matmuls are model/moe.py's
own, not `ops.matmul`), a collective matmul's column-parallel weights (their input is the
ring's chunks, parallel/collective_matmul.py) and, under collective matmul, an MoE block's shared experts (which
run SP's own collectives, `_untapped`): they get their gradients in B too.
"""
from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.model.moe import MoEOps
from jaxpar.model.ops import Ops


class Tapped(NamedTuple):
    """A block weight as its matmul sees it under the split backward."""

    name: str
    weight: Any
    tap: Any            # (zeros like x, zeros like the output); None while sites are recorded


class Site(NamedTuple):
    """How one block weight is used: its einsum and the shapes of its input and output (one layer)."""

    spec: str
    x: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def tapped_matmul(matmul, spec, x, w, tap):
    return matmul(spec, x, w)


def _tapped_fwd(matmul, spec, x, w, tap):
    return matmul(spec, x, w), (x, w)


def _tapped_bwd(matmul, spec, saved, dy):
    x, w = saved
    (dx,) = jax.vjp(lambda x: matmul(spec, x, w), x)[1](dy)
    return dx, jnp.zeros_like(w), (x, dy)          # dW deferred: (x, dy) leave through the tap


tapped_matmul.defvjp(_tapped_fwd, _tapped_bwd)


def deferred_names(blocks) -> tuple[str, ...]:
    """The block weights whose gradients W computes: every one with 2+ dimensions per layer that goes
    through `ops.matmul` (not the MoE router's or routed experts')."""
    return tuple(name for name, w in blocks.items()                     # [layers, ...] stacked
                 if w.ndim >= 3 and not name.startswith(("router", "expert_")))


def deferred_ops(base: Ops, sites: dict[str, Site]) -> Ops:
    """`base` with block weights wrapped in `Tapped` (when the blocks carry "taps") and matmuls that defer
    their weight gradient. Every tapped matmul records its `Site` in `sites` while being traced."""
    def fetch(name, weights):
        weights = base.fetch(name, weights)
        if name not in ("blocks", "moe_blocks") or "taps" not in weights:
            return weights
        taps = weights["taps"]
        return {k: Tapped(k, w, taps.get(k)) if k in taps else w for k, w in weights.items() if k != "taps"}

    def matmul(spec, x, w):
        if not isinstance(w, Tapped):
            return base.matmul(spec, x, w)
        if not isinstance(x, jax.Array):   # a collective matmul's chunks: no site, dW in B
            return base.matmul(spec, x, w.weight)
        y = base.matmul(spec, x, w.weight)
        sites[w.name] = Site(spec, jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
        if w.tap is None:
            return y
        return tapped_matmul(base.matmul, spec, x, w.weight, w.tap)

    ops = base.replace(fetch=fetch, matmul=matmul)
    if isinstance(base, MoEOps) and base.layer_ops is not None:   # collective matmul's MoE feed-forward: its dW in B
        layer_ops = base.layer_ops
        ops = ops.replace(layer_ops=lambda outer: _untapped(layer_ops(outer)))
    return ops


def _untapped(ops: Ops) -> Ops:
    """`ops` (an MoE block's feed-forward under collective matmul, model/moe.py `moe_layer_ops`: SP's own matmul)
    taking a Tapped weight as it is: no site is recorded, so its gradient comes in B."""
    return ops.replace(matmul=lambda spec, x, w: ops.matmul(spec, x, w.weight if isinstance(w, Tapped) else w))


def recording_taps(names) -> dict:
    """Taps that only record the sites (the first trace, before the tap shapes are known)."""
    return {name: None for name in names}


def zero_taps(sites: dict[str, Site], layers: int) -> dict:
    """Zero taps for `layers` stacked layers: (x, y) per deferred weight."""
    zeros = lambda s: jnp.zeros((layers, *s.shape), s.dtype)
    return {name: (zeros(site.x), zeros(site.y)) for name, site in sites.items()}


def weight_grads(matmul, sites: dict[str, Site], weights, taps) -> dict:
    """W: each deferred weight's gradient from its kept (x, dy), layer by layer, by the einsum's transpose."""
    def one(name):
        def layer(w, x, dy):
            return jax.vjp(lambda w: matmul(sites[name].spec, x, w), w)[1](dy)[0]
        x, dy = taps[name]
        return jax.vmap(layer)(weights[name], x, dy)
    return {name: one(name) for name in taps}

"""MoE layers inside manual Megatron TP (parallel/tensor.py): the experts' exchange over `expert`, and the
router under sequence parallelism. What `TensorStrategy` puts into its `MoEOps`.

expert x tensor  The batch is split over expert x data x fsdp. Each MoE layer's routed experts are
                 parallel/expert.py's all_to_all exchange, the same code, run inside tensor.py's shard_map:
                 a device holds E/N experts, each with 1/t of its hidden dimension (gate/up column-, down
                 row-parallel). Every tensor rank holds the same tokens, so each exchanges with the ranks of
                 its own tensor index. The exchange leaves the outputs partial over `tensor`; the all_to_all
                 back and the gates are linear, so Megatron's g after the layer (ops.row_out) adds them, and
                 f before it (ops.column_in, on the tokens and the gates) sums their gradients.
balance loss     f_i and P_i of the Switch loss are the whole batch's (`batch_mean` over the batch axes,
                 model/moe.py `router_outputs`): the loss equals one device's, each shard's gradient its own.
sequence         Under SP the router sees this rank's s/t tokens (Megatron-Core's layout): the expert ids are
                 all-gathered over `tensor` with the tokens and gates, the experts run on the whole sequence,
                 and the router's losses and statistics are averaged over the s/t parts (`SequenceShards.mean`:
                 all-reduce forward, identity backward, /t; the router's gradient, a replicated weight's, is
                 then summed over `tensor` as tensor.py does for the norms), so they equal one device's.
`moe_tensor_bytes`: the bytes these add on `tensor` (tensor.py's `predict` calls it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from jaxpar.model.moe import with_moe_ops
from jaxpar.parallel.expert import exchange_for
from jaxpar.parallel.megatron import SEQUENCE_DIM, reduce_from_parallel


@dataclass(frozen=True)
class SequenceShards:
    """The parts of each sequence the `axis` ranks hold under sequence parallelism (model/moe.py's `sequence`)."""

    axis: str
    size: int

    def gather(self, x):
        """[b, s/t, ...] -> [b, s, ...], no gradient (the expert ids)."""
        return jax.lax.all_gather(x, self.axis, axis=SEQUENCE_DIM, tiled=True)

    def local(self, x):
        """[b, s, ...] -> this rank's [b, s/t, ...]."""
        n = x.shape[SEQUENCE_DIM] // self.size
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axis) * n, n, axis=SEQUENCE_DIM)

    def mean(self, x):
        """The mean of a per-part mean over the parts: all-reduce forward, each part's 1/t share backward."""
        return reduce_from_parallel(x, self.axis) / self.size


def tensor_moe_ops(ops, moe_cfg, sizes: dict[str, int], batch_axes: tuple[str, ...], sequence: bool,
                   exchange: str = "auto"):
    """`ops` (Megatron's, over `tensor`) with the MoE pieces: the balance statistics over `batch_axes`, with
    mesh.expert > 1 the all_to_all exchange (sized by `exchange`, parallel.expert_exchange), under SP the
    router's view of the sequence's parts."""
    changes: dict[str, Any] = {}
    if batch_axes:
        changes["batch_mean"] = lambda x: jax.lax.pmean(x, batch_axes)
    if sizes["expert"] > 1:
        changes["routed_experts"] = exchange_for(moe_cfg, sizes["expert"], exchange=exchange)
    if sequence:
        changes["sequence"] = SequenceShards("tensor", sizes["tensor"])
    return with_moe_ops(ops, **changes)


def moe_tensor_bytes(shape, cand, b: int, s: int, e: int) -> float:
    """Bytes on `tensor` per microbatch that the MoE layers add to tensor.py's `layer_units` (which counts f and
    g around attention and around the routed experts), per MoE layer, T = mesh.tensor, k = top_k:
      gates     f on the fp32 gates [b, s, k]: 2(T-1)/T·4·b·s·k (TP: an all-reduce backward; SP: an all-gather
                forward, a reduce-scatter backward).
      shared    the shared experts' own f and g: 4u as a dense MLP's under TP; 2u under SP, where XLA merges
                their input's all-gathers with the routed experts' (the same tokens, the same gradient).
      SP        the expert ids' all-gather (T-1)/T·4·b·s·k and the router statistics' all-reduce (3 vectors of E,
                2 scalars) 2(T-1)/T·4·(3E+2). With remat (any policy but none) the backward's recomputed forward
                gathers the gates and the ids again and all-reduces one E vector again.
    Measured with remat none, full and dots (tests/test_tensor_moe.py checks none)."""
    moe, T = shape.moe, cand.tensor
    u, ring = (T - 1) / T * e * b * s * shape.d_model, 2 * (T - 1) / T
    per_layer = ring * 4 * b * s * moe.top_k
    if moe.shared_experts:
        per_layer += (2 if cand.sequence else 4) * u
    if cand.sequence:
        per_layer += (T - 1) / T * 4 * b * s * moe.top_k + ring * 4 * (3 * moe.experts + 2)
        if cand.remat != "none":
            per_layer += 2 * (T - 1) / T * 4 * b * s * moe.top_k + ring * 4 * moe.experts
    return shape.moe_layers * per_layer

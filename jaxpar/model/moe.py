"""Sparse Mixture-of-Experts feed-forward: a router sends each token to k of E expert MLPs.

An MoE layer (`moe_feed_forward`) is route -> routed experts -> auxiliary outputs; the
always-on shared experts of DeepSeek-MoE are a plain SwiGLU MLP that the block adds
(model/transformer.py), so they are not written twice.

Routers (`route`):
  softmax  softmax over the E router logits, keep the k largest (Switch: k=1, Mixtral: k=2);
           `normalize_top_k` renormalises the k gates to sum 1 (Mixtral), else they stay raw
           probabilities (Switch, DeepSeek-MoE).
  noisy    Shazeer et al. 2017: the top k of H = x·W_g + eps·softplus(x·W_noise), eps ~ N(0, 1),
           then as softmax. Training only: noise is drawn only when the training objective passes
           noise seeds (transformer.loss), never in evaluation or decoding.
  sigmoid  DeepSeek-V3: scores s = sigmoid(x·W_g); the k largest s + b are chosen and the gates are
           the scores s themselves. b, a per-expert bias, is moved after every step from the
           observed load (`bias_update`, applied by every strategy outside the gradient): it steers
           which experts are chosen and never enters a gate, so no gradient reaches it.

Dispatch (`routed_experts`; expert parallelism swaps it through `MoEOps`):
  dropless  the T·k assignments sorted by expert and one grouped matmul per weight
            (`jax.lax.ragged_dot`), then unsorted and combined with the gates: nothing is dropped.
  capacity  Switch/GShard: the batch is cut into groups of `group_sequences` sequences and each
            expert takes at most C = ceil(capacity_factor · group tokens · k / E) assignments per
            group, every first choice before any second choice, earlier tokens first. Past C an
            assignment is dropped: it adds nothing, so a token whose k choices are all dropped
            passes through the residual connection unchanged. Written as GShard's einsums with
            one-hot dispatch and combine tensors [group, token, expert, slot]. A batch of fewer
            sequences than a group (decoding: one) is one group. Decoding passes the length of
            the real tokens (`decode_ops`): the padding after it takes no slot and the capacity
            counts only the real tokens, so the logits at the cursor do not depend on the buffer.

Auxiliary outputs, per layer (keys ending `_loss` are added to the objective):
  moe_balance_loss  balance_loss · E·Σ_i f_i·P_i (Switch): f_i the fraction of assignments routed
                    to expert i, P_i its mean router probability, over the batch. 1 when balanced.
  moe_z_loss        z_loss · mean(logsumexp(logits)^2) (ST-MoE): keeps router logits small.
  moe_routed [E]    f_i: fraction of the layer's assignments routed to each expert (sums to 1)
  moe_dropped [E]   fraction of the layer's assignments dropped at each expert (sums to the dropped fraction)
  moe_entropy       mean entropy of the router distribution, nats (log E: uniform)
  moe_balance, moe_z  the two losses unweighted
Fractions rather than counts: a data-parallel strategy averages them over devices to the global value.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.model.ops import Ops

ACT = ACTIVATION_AXES


@dataclass(frozen=True)
class MoEConfig:
    """model.moe.* with `expert_mlp_dim` resolved (see jaxpar/config.py for each field)."""

    experts: int
    top_k: int
    expert_mlp_dim: int
    dense_layers: int = 0
    shared_experts: int = 0
    router: str = "softmax"
    normalize_top_k: bool = True
    dispatch: str = "dropless"
    capacity_factor: float = 1.25
    group_sequences: int = 1
    balance_loss: float = 0.01
    z_loss: float = 0.001
    bias_rate: float = 0.001

    @classmethod
    def from_config(cls, moe, mlp_dim: int) -> MoEConfig | None:
        if not moe.experts:
            return None
        return cls(experts=moe.experts, top_k=moe.top_k, expert_mlp_dim=moe.expert_mlp_dim or mlp_dim,
                   dense_layers=moe.dense_layers, shared_experts=moe.shared_experts, router=moe.router,
                   normalize_top_k=moe.normalize_top_k, dispatch=moe.dispatch,
                   capacity_factor=float(moe.capacity_factor), group_sequences=moe.group_sequences,
                   balance_loss=float(moe.balance_loss), z_loss=float(moe.z_loss), bias_rate=float(moe.bias_rate))

    def capacity(self, group_tokens: int) -> int:
        """Slots per expert per group: ceil(capacity_factor · group tokens · k / E)."""
        return max(1, math.ceil(self.capacity_factor * group_tokens * self.top_k / self.experts))


# ============================================================================ routers

def noise_seeds(tokens):
    """One uint32 per sequence, hashed from its tokens [B, S]: the noisy router's randomness.

    Keyed by content, a sequence draws the same noise on whatever device and in whatever batch
    split it lands, so every strategy reproduces the single device, and no strategy has to thread
    a random key through its step; a new batch gives new noise.
    """
    weights = (jnp.arange(tokens.shape[1], dtype=jnp.uint32) * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
    return jnp.sum(tokens.astype(jnp.uint32) * weights, axis=1, dtype=jnp.uint32)


def _noise(seeds, layer, shape):
    """Standard normal noise [B, *shape] for one layer from per-sequence seeds [B]."""
    base = jax.random.fold_in(jax.random.key(0), layer)
    return jax.vmap(lambda seed: jax.random.normal(jax.random.fold_in(base, seed), shape))(seeds)


def top_k(values, k: int):
    """The k largest values along the last axis and their indices (ties: the lower index first).

    `jax.lax.top_k` does the same, but XLA's SPMD partitioner all-gathers a TopK's operand over
    the batch (measured: every device then routes the whole global batch); a sort along the
    last axis stays split along the others.
    """
    ids = jnp.argsort(-values, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(values, ids, axis=-1), ids


def route(x, w, cfg: MoEConfig, noise=None, sequence=None):
    """x [B, S, D] -> (logits, probs [B, S, E], ids [B, S, k], gates [B, S, k]), all fp32 but ids.

    `noise`: (seeds [B], layer index) in training with router=noisy, else None.
    `sequence`: under sequence parallelism (`MoEOps.sequence`) x is this device's part of the sequence, and
    the noise is its part of the whole sequence's.
    `probs` are what the balance loss and the entropy see: the softmax (of the noisy logits for
    router=noisy), or for router=sigmoid the scores normalised per token.
    """
    x32 = x.astype(jnp.float32)
    logits = jnp.einsum("bsd,de->bse", x32, w["router"].astype(jnp.float32))
    if cfg.router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        bias = jax.lax.stop_gradient(w["router_bias"].astype(jnp.float32))
        _, ids = top_k(scores + bias, cfg.top_k)                  # the bias chooses ...
        gates = jnp.take_along_axis(scores, ids, axis=-1)        # ... but the gates are the scores
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        chosen_from = logits
        if cfg.router == "noisy" and noise is not None:
            seeds, layer = noise
            scale = jax.nn.softplus(jnp.einsum("bsd,de->bse", x32, w["router_noise"].astype(jnp.float32)))
            if sequence is None:
                eps = _noise(seeds, layer, logits.shape[1:])
            else:
                eps = sequence.local(_noise(seeds, layer, (logits.shape[1] * sequence.size, logits.shape[2])))
            chosen_from = logits + eps * scale
        probs = jax.nn.softmax(chosen_from, axis=-1)
        gates, ids = top_k(probs, cfg.top_k)
    if cfg.normalize_top_k:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return logits, probs, ids, gates


def router_outputs(logits, probs, ids, kept, cfg: MoEConfig, batch_mean=None, sequence=None) -> dict:
    """The layer's weighted losses and statistics (see the module docstring).

    `sequence` (sequence parallelism, `MoEOps.sequence`): this device routed only its part of each sequence;
    every per-token mean is first averaged over those parts (`sequence.mean`, whose gradient is each part's
    own share), so the losses and statistics are the whole sequences', equal on every part.
    `batch_mean`: for a manual strategy whose devices each hold a shard of the batch (the pipelines),
    the mean over those shards; f_i and P_i of the balance loss are then the whole batch's, as one
    device sees them, while P_i's gradient stays this shard's own (the shards' gradients, averaged
    by the strategy, are the single device's). The other statistics are means the strategy averages.
    """
    E, k = cfg.experts, cfg.top_k
    assigned = jax.nn.one_hot(ids, E, dtype=jnp.float32)                      # [B, S, k, E]
    routed = jnp.mean(jnp.sum(assigned, axis=2), axis=(0, 1)) / k             # f_i: no gradient (from ids)
    dropped = jnp.mean(jnp.sum(assigned * (~kept)[..., None], axis=2), axis=(0, 1)) / k
    importance = jnp.mean(probs, axis=(0, 1))                                 # P_i: the gradient's path
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    entropy = jnp.mean(-jnp.sum(jax.scipy.special.xlogy(probs, probs), axis=-1))
    if sequence is not None:
        routed, dropped, importance, z, entropy = map(sequence.mean, (routed, dropped, importance, z, entropy))
    if batch_mean is not None:
        routed = batch_mean(routed)
        importance = importance + jax.lax.stop_gradient(batch_mean(importance) - importance)
    balance = E * jnp.sum(routed * importance)
    return {"moe_balance_loss": cfg.balance_loss * balance, "moe_z_loss": cfg.z_loss * z,
            "moe_routed": routed, "moe_dropped": dropped, "moe_entropy": entropy,
            "moe_balance": balance, "moe_z": z}


# A load within this of the mean is a tie. Loads are counts over N = tokens·k assignments, so two loads that
# differ really differ by at least 1/(E·N): more than this below 2^20 assignment-experts per step. Layouts sum
# the counts in different orders, so at a real tie they differ by an ulp, and a bare sign would split them.
TIE = 2.0 ** -20


def bias_update(routed, rate: float):
    """DeepSeek-V3's aux-free balancing step: b_i += rate · sign(mean load - load_i), per layer; 0 at a tie.

    `routed` [layers, E] is the observed load of the step; overloaded experts become less
    likely to be chosen, underloaded ones more. The strategies add this after their optimizer
    update (parallel/step.py `apply_outside_gradient`): the bias never sees a gradient.
    """
    gap = jnp.mean(routed, axis=-1, keepdims=True) - routed
    return rate * jnp.where(jnp.abs(gap) <= TIE, 0.0, jnp.sign(gap))


# ============================================================================ the experts

def weights_in_use(w, ops: Ops) -> dict:
    """The router and expert weights pinned whole along `embed` (gathered, under FSDP) before use."""
    roles = {"router": "router_in_use", "router_noise": "router_in_use", "expert_gate": "experts_in_use",
             "expert_up": "experts_in_use", "expert_down": "experts_out_use"}
    return {**w, **{name: ops.constrain(w[name], ACT[role]) for name, role in roles.items() if name in w}}


def expert_weights(w) -> dict:
    return {name: w[name] for name in ("expert_gate", "expert_up", "expert_down")}


@jax.custom_vjp
def expert_gating(gate, up):
    """silu(gate)·up, whose backward recomputes silu from gate and up rather than keeping its intermediates:
    autodiff would keep three more [rows, F] states per routed row, the largest part of what an MoE layer
    holds for its backward (experiments/07_moe/README.md, "What an MoE layer keeps")."""
    return jax.nn.silu(gate) * up


def _gating_forward(gate, up):
    return expert_gating(gate, up), (gate, up)


def _gating_backward(kept, dy):
    gate, up = kept
    sigmoid = jax.nn.sigmoid(gate)
    silu = gate * sigmoid
    return dy * up * (sigmoid + silu * (1 - sigmoid)), dy * silu


expert_gating.defvjp(_gating_forward, _gating_backward)


def grouped_swiglu(rows, group_sizes, w, ops: Ops):
    """Rows [M, D] sorted by expert, `group_sizes` [E] -> each row through its expert's SwiGLU [M, D].

    One `ragged_dot` per weight: a grouped matmul over contiguous row groups. Rows past
    sum(group_sizes) come out as zeros (expert parallelism uses them as padding).
    """
    gate = jax.lax.ragged_dot(rows, w["expert_gate"], group_sizes)
    up = jax.lax.ragged_dot(rows, w["expert_up"], group_sizes)
    return jax.lax.ragged_dot(expert_gating(gate, up), w["expert_down"], group_sizes)


def slot_swiglu(slots, w, ops: Ops):
    """Capacity slots [E, G, C, D] -> each expert's SwiGLU of its own slots [E, G, C, D] (batched einsums)."""
    gate = jnp.einsum("egcd,edf->egcf", slots, w["expert_gate"])
    up = jnp.einsum("egcd,edf->egcf", slots, w["expert_up"])
    hidden = ops.constrain(expert_gating(gate, up), ACT["expert_mlp"])
    return jnp.einsum("egcf,efd->egcd", hidden, w["expert_down"])


def inverse_permutation(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def combine(outputs, gates):
    """outputs [T, k, D] of each token's k experts, gates [T, k] -> the gate-weighted sum [T, D]."""
    return jnp.einsum("tkd,tk->td", outputs, gates.astype(outputs.dtype))


def dropless_experts(x, ids, gates, w, ops: Ops, experts: int):
    """Tokens x [T, D] through their k experts ids [T, k], combined with gates [T, k] -> [T, D].

    Assignment a = t·k + j is sorted to its expert's contiguous rows, the experts run as one
    grouped matmul, and the rows return to assignment order before the weighted sum.
    """
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                  # assignments grouped by expert
    sizes = jnp.bincount(flat, length=experts)
    out = grouped_swiglu(x[order // k], sizes, w, ops)
    return combine(out[inverse_permutation(order)].reshape(T, k, -1), gates)


def capacity_slots(ids, gates, experts: int, capacity: int, limit=None):
    """Per group, the slot each assignment takes in its expert's buffer.

    ids, gates [G, S, k] -> dispatch [G, S, E, C] (1 where token s sits in slot c of expert e),
    combine [G, S, E, C] (the same with the gate as value), kept [G, S, k]. Priority: all
    first choices of the group, in token order, then all second choices, and so on.
    An id of -1 (padding) takes no slot. `limit` [G]: slots usable per expert in each group
    (at most `capacity`, the buffer's size); None: all of them.
    """
    G, S, k = ids.shape
    onehot = jax.nn.one_hot(ids, experts, dtype=jnp.int32)                    # [G, S, k, E]; -1: all 0
    by_choice = onehot.transpose(0, 2, 1, 3).reshape(G, k * S, experts)       # choice-major order
    position = (jnp.cumsum(by_choice, axis=1) - 1).reshape(G, k, S, experts).transpose(0, 2, 1, 3)
    position = jnp.sum(position * onehot, axis=-1)                             # [G, S, k]
    kept = position < (capacity if limit is None else limit[:, None, None])
    slot = jax.nn.one_hot(jnp.where(kept, position, capacity), capacity, dtype=jnp.float32)  # dropped: all 0
    chosen = onehot.astype(jnp.float32)
    dispatch = jnp.einsum("gske,gskc->gsec", chosen, slot)
    combine_weights = jnp.einsum("gske,gskc,gsk->gsec", chosen, slot, gates)
    return dispatch, combine_weights, kept


def _unchanged(slots):
    return slots


def capacity_experts(x, ids, gates, w, cfg: MoEConfig, ops: Ops, to_experts=_unchanged, from_experts=_unchanged,
                     length=None):
    """x [B, S, D] through capacity-limited experts -> (y [B, S, D], kept [B, S, k]).

    `to_experts` / `from_experts` move the slot buffer [E, G, C, D] to the devices holding the
    experts and back: identity on one device (and for the automatic strategies, whose
    partitioner moves it as the `expert_slots` constraint asks); all_to_alls in parallel/expert.py.
    `length` (decoding): positions from `length` on are padding, routed nowhere and not counted.
    """
    B, S, D = x.shape
    k = ids.shape[-1]
    sequences = min(cfg.group_sequences, B)       # decoding: one sequence is a group of its own
    G, group_tokens = B // sequences, sequences * S
    limit = None
    if length is not None:
        ids = jnp.where((jnp.arange(S) < length)[None, :, None], ids, -1)
        real = jnp.full((G,), sequences, jnp.float32) * jnp.minimum(length, S)
        limit = jnp.maximum(1, jnp.ceil(cfg.capacity_factor * real * cfg.top_k / cfg.experts)).astype(jnp.int32)
    dispatch, combine_weights, kept = capacity_slots(ids.reshape(G, group_tokens, k),
                                                     gates.reshape(G, group_tokens, k),
                                                     cfg.experts, cfg.capacity(group_tokens), limit)
    slots = jnp.einsum("gsec,gsd->egcd", dispatch.astype(x.dtype), x.reshape(G, group_tokens, D))
    slots = to_experts(ops.constrain(slots, ACT["expert_slots"]))
    out = from_experts(ops.constrain(slot_swiglu(slots, w, ops), ACT["expert_slots"]))
    y = jnp.einsum("gsec,egcd->gsd", combine_weights.astype(out.dtype), out)
    return y.reshape(B, S, D), kept.reshape(B, S, k)


def routed_experts(x, ids, gates, w, cfg: MoEConfig, ops: Ops, length=None):
    """The reference dispatch (one device; the automatic strategies' global view).

    x [B, S, D], ids/gates [B, S, k], w the expert weights [E, ...] -> (y [B, S, D], kept [B, S, k]).
    `length`: see `capacity_experts` (dropless dispatch treats every token alone: padding is harmless).
    """
    if cfg.dispatch == "capacity":
        return capacity_experts(x, ids, gates, w, cfg, ops, length=length)
    B, S, D = x.shape
    k = ids.shape[-1]
    y = dropless_experts(x.reshape(B * S, D), ids.reshape(B * S, k), gates.reshape(B * S, k), w, ops, cfg.experts)
    return y.reshape(B, S, D), jnp.ones(ids.shape, bool)


@dataclasses.dataclass(frozen=True)
class MoEOps(Ops):
    """`Ops` plus the MoE pieces a strategy swaps: `routed_experts` (dispatch, experts, combine) and
    `batch_mean` (the balance loss's statistics over a manual strategy's batch shards, `router_outputs`),
    `sequence` (the router's view under sequence parallelism) and `layer_ops` (see `moe_layer_ops`)."""

    routed_experts: Callable = routed_experts
    batch_mean: Callable | None = None
    sequence: Any = None    # sequence parallelism: the sequence's parts on the tensor ranks (.size, .gather,
                            # .local, .mean; parallel/tensor_moe.py); None: each device routes whole sequences
    layer_ops: Callable | None = None   # (ops) -> the ops an MoE block's feed-forward runs with; None: ops


def with_moe_ops(ops: Ops, **changes) -> MoEOps:
    """`ops` (an `Ops` or a `MoEOps`) as a `MoEOps` with the named MoE pieces replaced."""
    return MoEOps(**{**{f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)}, **changes})


def with_routed_experts(ops: Ops, fn: Callable) -> MoEOps:
    """`ops` with its routed-experts implementation replaced by `fn` (same signature as `routed_experts`)."""
    return with_moe_ops(ops, routed_experts=fn)


def moe_layer_ops(ops: Ops) -> Ops:
    """The ops of an MoE block's feed-forward (router, routed and shared experts). Collective matmul fuses
    `column_in` into the column-parallel matmuls (it returns the ring's chunks, not an array) and `row_out` into
    the row-parallel ones; the experts' dispatch needs the gathered tokens as one array, so such a strategy
    names, in `layer_ops`, the ops with whole collectives (parallel/collective_matmul.py)."""
    return ops.layer_ops(ops) if isinstance(ops, MoEOps) and ops.layer_ops is not None else ops


def decode_ops(length) -> MoEOps:
    """The reference ops for a decode buffer whose tokens from `length` on are padding (see `capacity_experts`)."""
    return with_routed_experts(Ops(), functools.partial(routed_experts, length=length))


# ============================================================================ the layer

def moe_feed_forward(x, w, cfg: MoEConfig, ops: Ops, noise=None):
    """The routed experts of one MoE layer: x [B, S, D] (normed) -> (output [B, S, D], aux).

    The router sees x itself; the experts see ops.column_in(x) and their combined output goes
    through ops.row_out, like the dense MLP's column- and row-parallel matmuls. The gates enter
    that parallel region too (through column_in: Megatron's f): under manual TP each device
    combines its partial expert outputs with them, so their gradient is summed over `tensor`.
    Under sequence parallelism x is this device's s/t tokens: the router sees those, column_in
    gathers x and the gates, `sequence.gather` the expert ids, and `kept` comes back to this part.
    """
    w = weights_in_use(w, ops)
    moe_ops = ops if isinstance(ops, MoEOps) else MoEOps()
    sequence = moe_ops.sequence
    logits, probs, ids, gates = route(x, w, cfg, noise, sequence)
    y, kept = moe_ops.routed_experts(ops.column_in(x), ids if sequence is None else sequence.gather(ids),
                                     ops.column_in(gates), expert_weights(w), cfg, ops)
    kept = kept if sequence is None else sequence.local(kept)
    return ops.row_out(y), router_outputs(logits, probs, ids, kept, cfg, moe_ops.batch_mean, sequence)

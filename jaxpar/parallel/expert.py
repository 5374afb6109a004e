"""`parallel.expert=manual`: expert parallelism with explicit all_to_alls, as DeepSpeed-MoE, Megatron-Core
and torchtitan write it with torch.distributed.

Each of the N devices on `expert` holds E/N experts and 1/N of the batch. The router runs where the tokens
are (the single device's view); then per MoE layer a `shard_map` over the whole mesh permutes, dispatches
(all_to_all), runs the local experts as one `ragged_dot` (hidden split over `tensor` when tensor > 1),
returns (all_to_all) and combines. Buffers are padded (XLA:CPU has no ragged_all_to_all). Routing and the
experts' math are the single device's, so the losses match it to fp32 rounding. The steps, the padding's
cost and XLA:CPU's constraints: experiments/04_moe/README.md, "How manual expert parallelism is written".
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.moe import MoEConfig, capacity_experts, grouped_swiglu, inverse_permutation, with_routed_experts
from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.rules import AxisRules

AXIS = "expert"


# ============================================================================ dropless, padded

def padded_chunk_rows(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows of one destination's chunk: the most assignments a device can send to one other device."""
    return tokens * min(top_k, local_experts)


def dropless_exchange(x, ids, gates, w, cfg: MoEConfig, ops, *, n: int, tensor_sum):
    """One device's tokens x [B, S, D] through experts on all N devices (inside shard_map over `expert`).

    w: this device's E/N experts. Returns (y [B, S, D], kept [B, S, k] = all True).
    """
    B, S, D = x.shape
    k = ids.shape[-1]
    T, local = B * S, cfg.experts // n
    rows = padded_chunk_rows(T, k, local)
    x, flat = x.reshape(T, D), ids.reshape(T * k)

    # 1. permute: assignments sorted by expert, hence by destination device
    order = jnp.argsort(flat, stable=True)
    dest_sizes = jnp.bincount(flat // local, length=n)
    dest_start = jnp.cumsum(dest_sizes) - dest_sizes
    slot = jnp.arange(rows)
    valid = slot[None, :] < dest_sizes[:, None]                                    # [n, rows]
    sorted_at = jnp.where(valid, dest_start[:, None] + slot[None, :], 0)           # position in sorted order
    send = jnp.where(valid[..., None], x[order[sorted_at] // k], 0)                # [n, rows, D]
    send_expert = jnp.where(valid, flat[order[sorted_at]] % local, local)          # `local` marks padding

    # 2. dispatch: chunk d to device d; chunk s of what arrives came from device s
    recv = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True)
    recv_expert = jax.lax.all_to_all(send_expert, AXIS, 0, 0, tiled=True).reshape(n * rows)

    # 3. compute: what arrived, sorted by local expert (padding last, where ragged_dot writes zeros)
    by_expert = jnp.argsort(recv_expert, stable=True)
    sizes = jnp.bincount(recv_expert, length=local)                                # padding not counted
    out = tensor_sum(grouped_swiglu(recv.reshape(n * rows, D)[by_expert], sizes, w, ops))
    out = out[inverse_permutation(by_expert)].reshape(n, rows, D)

    # 4. return: results back to the devices the tokens came from, in the layout they were sent
    back = jax.lax.all_to_all(out, AXIS, 0, 0, tiled=True)

    # 5. combine: assignment a sat at row (rank(a) - dest_start[dest(a)]) of chunk dest(a)
    rank = inverse_permutation(order)
    dest = flat // local
    results = back[dest, rank - dest_start[dest]].reshape(T, k, D)
    y = jnp.einsum("tkd,tk->td", results, gates.reshape(T, k).astype(results.dtype))
    return y.reshape(B, S, D), jnp.ones(ids.shape, bool)


# ============================================================================ capacity

def _to_experts(slots):
    """[E, G, C, D] (my groups, every expert) -> [E/N, N·G, C, D] (my experts, every device's groups)."""
    return jax.lax.all_to_all(slots, AXIS, 0, 1, tiled=True)


def _from_experts(slots):
    return jax.lax.all_to_all(slots, AXIS, 1, 0, tiled=True)


def capacity_exchange(x, ids, gates, w, cfg: MoEConfig, ops, *, n: int, tensor_sum):
    """The capacity dispatch with the slot buffers moved by all_to_all (inside shard_map over `expert`)."""
    return capacity_experts(x, ids, gates, w, cfg, ops, to_experts=_to_experts,
                            from_experts=lambda slots: _from_experts(tensor_sum(slots)))


# ============================================================================ the shard_map

def _unsummed(out):
    return out


def exchange_for(cfg: MoEConfig, n: int, tensor_sum=_unsummed):
    """The routed experts of a per-device program over `expert` (n devices), `routed_experts`' signature: the
    dropless or capacity exchange. `tensor_sum` adds the experts' partial outputs over `tensor` where the
    program does not (identity: Megatron's g after the layer adds them, parallel/tensor_moe.py)."""
    exchange = dropless_exchange if cfg.dispatch == "dropless" else capacity_exchange
    return partial(exchange, n=n, tensor_sum=tensor_sum)


def manual_routed_experts(x, ids, gates, w, cfg: MoEConfig, ops, *, mesh, batch_axes: tuple[str, ...]):
    """`routed_experts` (model/moe.py) over the mesh: a shard_map around the exchange, manual over every
    mesh axis. Tokens are split as the batch is (`expert` among its axes), experts over `expert`, each
    expert's hidden dimension over `tensor`."""
    n, tp = int(mesh.shape[AXIS]), "tensor" if mesh.shape["tensor"] > 1 else None
    tensor_sum = (lambda out: jax.lax.psum(out, tp)) if tp else _unsummed
    local = partial(exchange_for(cfg, n, tensor_sum), cfg=cfg, ops=ops)
    tokens = P(batch_axes)
    experts = {name: P(AXIS, None, tp) if name != "expert_down" else P(AXIS, tp, None) for name in w}
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, experts), out_specs=(tokens, tokens),
                         axis_names=set(mesh.axis_names))(x, ids, gates, w)


class ExpertStrategy(AutoStrategy):
    """The automatic strategy with the MoE layers' token exchange written by hand (`parallel.expert=manual`)."""

    RUNS = {"expert": ("manual",)}
    PLANNED: dict = {}   # the planner ranks expert=auto: the prediction (AutoStrategy's) is the same

    @classmethod
    def check(cls, config, sizes):
        if not config.model.moe.experts:
            raise ConfigError("parallel.expert", "manual expert parallelism needs an MoE model: set "
                              "model.moe.experts > 0, or parallel.expert=auto")
        batch = AxisRules.from_config(config).spec(("batch",))[0]
        if AXIS not in (batch if isinstance(batch, tuple) else (batch,)):
            raise ConfigError("parallel.rules", f"manual expert parallelism splits the batch over `{AXIS}`, but "
                              f"the rules map batch to {batch}; keep {AXIS} in the batch rule")

    def with_ops(self, ops):
        batch = self.rules.spec(("batch",))[0]
        batch_axes = batch if isinstance(batch, tuple) else (batch,)
        return with_routed_experts(ops, partial(manual_routed_experts, mesh=self.mesh, batch_axes=batch_axes))

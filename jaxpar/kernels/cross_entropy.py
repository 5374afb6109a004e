"""The output head's cross-entropy without the full logits: chunked over the sequence, fused with its gradient.

The reference (`model.ops.cross_entropy`) computes logits = x @ head for the whole batch:
[B, S, V] fp32 (e.g. 8 x 2048 x 32000 x 4 bytes = 2 GiB per device), keeps them for the
backward pass, and the backward makes a gradient of the same size. Here the sequence is cut
into chunks of `chunk` positions and a `lax.scan` walks them: one chunk's logits
[B, chunk, V] exist at a time.

The gradient is computed in the same pass (Liger-Kernel's "fused linear cross-entropy"):
for each chunk, d(loss)/d(logits) = (softmax - onehot) / tokens is formed while the logits
are there and pulled back through the head's matmul at once, giving that chunk's dx and
its share of d(head); the custom VJP keeps dx [B, S, D] and d(head) [D, V] as residuals
and scales them by the incoming cotangent. So the head costs three matmuls (logits, dx,
d(head)), as unchunked, and no logits are kept or recomputed. Without differentiation
(evaluation) only the loss is computed.

Vocabulary parallel (`axis`, inside a `shard_map` over it): each device holds [D, V/t] of
the head; the max, the sum of exponentials and the target's logit are reduced over `axis`
per chunk (three numbers per token, Megatron's scheme), and dx is this device's partial
sum (Megatron's f operator before the head all-reduces it in the backward pass). Under the
automatic strategies the partitioner does the same from the head's sharding.

The matmul is `ops.logits` (any compute dtype, FP8 included): its own VJP is used per chunk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.model.ops import cross_entropy as cross_entropy_reference  # noqa: F401 - what the tests compare to


def _chunks(x, targets, chunk: int):
    """[B, S, ...] -> [n, B, chunk, ...] (padded to whole chunks) and a validity mask [n, B, chunk]."""
    B, S = targets.shape
    n = -(-S // chunk)
    pad = n * chunk - S
    valid = jnp.arange(n * chunk) < S
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    split = lambda a: jnp.moveaxis(a.reshape(B, n, chunk, *a.shape[2:]), 1, 0)
    return split(x), split(targets), jnp.broadcast_to(valid.reshape(n, 1, chunk), (n, B, chunk))


def _unchunk(a, seq_len: int):
    """[n, B, chunk, ...] -> [B, S, ...]."""
    n, B, chunk = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(B, n * chunk, *a.shape[3:])[:, :seq_len]


def _chunk_statistics(logits, targets, axis):
    """Per token of one chunk: log-sum-exp over the (whole) vocabulary and the target's logit."""
    vocab = logits.shape[-1]
    offset = 0 if axis is None else jax.lax.axis_index(axis) * vocab
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    if axis is not None:
        top = jax.lax.pmax(top, axis)
    sum_exp = jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)
    is_target = (offset + jnp.arange(vocab)) == targets[..., None]        # a compare, not a gather: shards well
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    if axis is not None:
        sum_exp, target_logit = jax.lax.psum((sum_exp, target_logit), axis)
    return top + jnp.log(sum_exp), target_logit, is_target


def _loss_only(x, head, targets, ops, chunk, axis):
    xs, ts, valid = _chunks(x, targets, chunk)

    def step(total, inputs):
        x_c, t_c, v_c = inputs
        logits = ops.constrain(ops.logits(x_c, head), ACTIVATION_AXES["logits"])
        lse, target_logit, _ = _chunk_statistics(logits, t_c, axis)
        return total + jnp.sum(jnp.where(v_c, lse - target_logit, 0.0)), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (xs, ts, valid))
    return total / targets.size


def _loss_and_grads(x, head, targets, ops, chunk, axis):
    """Loss and its gradients (dx, d(head)) for a unit cotangent, one chunk of logits at a time."""
    xs, ts, valid = _chunks(x, targets, chunk)
    tokens = targets.size

    def step(carry, inputs):
        total, dhead = carry
        x_c, t_c, v_c = inputs
        logits, pullback = jax.vjp(lambda a, w: ops.constrain(ops.logits(a, w), ACTIVATION_AXES["logits"]), x_c, head)
        lse, target_logit, is_target = _chunk_statistics(logits, t_c, axis)
        total = total + jnp.sum(jnp.where(v_c, lse - target_logit, 0.0))
        dlogits = (jnp.exp(logits - lse[..., None]) - is_target) * (v_c[..., None] / tokens)
        dx_c, dhead_c = pullback(dlogits)
        return (total, dhead + dhead_c.astype(jnp.float32)), dx_c

    start = (jnp.zeros((), jnp.float32), jnp.zeros(head.shape, jnp.float32))
    (total, dhead), dxs = jax.lax.scan(step, start, (xs, ts, valid))
    return total / tokens, _unchunk(dxs, targets.shape[1]), dhead.astype(head.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, head, targets, ops, chunk, axis):
    return _loss_only(x, head, targets, ops, chunk, axis)


def _fused_fwd(x, head, targets, ops, chunk, axis):
    loss, dx, dhead = _loss_and_grads(x, head, targets, ops, chunk, axis)
    return loss, (dx, dhead)


def _fused_bwd(ops, chunk, axis, residuals, g):
    dx, dhead = residuals
    return (dx * g).astype(dx.dtype), (dhead * g).astype(dhead.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def chunked_cross_entropy(x, head, targets, ops, *, chunk: int = 256, axis: str | None = None):
    """Mean next-token cross-entropy of x [B, S, D] through `head` [D, V] (or this device's [D, V/t] with
    `axis`): the reference's value and gradients, with at most [B, chunk, V] logits alive at a time."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be at least 1 sequence position")
    return _fused(x, head, targets, ops, min(chunk, targets.shape[1]), axis)

"""Attention across a sequence split over the `context` axis: a ring of key/value blocks, or all_to_all.

Both run per device inside `shard_map`, on the device's slice of the sequence (q [b, n, H, Dh],
k/v [b, n, KV, Dh], n = S / context), and give exactly the causal attention of the whole sequence.

ring        (Liu et al., Ring Attention.) Each device keeps its queries; the key/value blocks travel
            round the ring with `ppermute`, one hop per step, c - 1 hops. Each step's partial attention
            (output and log-sum-exp) merges into the running one by online-softmax rescaling, as flash
            attention merges its key blocks. Causal load balance: the sequence is cut into 2c chunks and
            device i holds chunks i and 2c-1-i (`zigzag_order`), so at every step after the first each
            device computes exactly two of its four chunk pairs (the other two are masked whole): no device
            idles while another works. The backward pass is JAX's transpose of the loop: each `ppermute`
            becomes one sending the key/value gradients back the other way (c - 1 hops), and the blocks
            each step used are kept as residuals (recomputed under remat).
all_to_all  (DeepSpeed-Ulysses.) Three all_to_alls turn q, k, v from [b, n, H, Dh] (a slice of the
            sequence, every head) into [b, S, H/c, Dh] (the whole sequence, a slice of the heads); any
            attention then runs as on one device; a fourth turns the output back. Needs heads and KV heads
            divisible by c. The sequence keeps its natural order.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

MASKED = -1e30      # finite: a row that sees no key of a block gets weight exp(MASKED - lse) = 0, never NaN


def zigzag_order(seq_len: int, context: int) -> np.ndarray:
    """The ring's sequence order: position p of the reordered sequence holds token `order[p]`.

    2c chunks; device i's slice (the i-th n = S/c positions) is chunk i then chunk 2c-1-i.
    """
    chunk = seq_len // (2 * context)
    chunks = [j for i in range(context) for j in (i, 2 * context - 1 - i)]
    return np.concatenate([np.arange(j * chunk, (j + 1) * chunk) for j in chunks])


def block_attention(q, k, v, causal: bool):
    """One block pair: q [b, m, H, Dh] over k/v [b, m, KV, Dh] -> (out [b, m, H, Dh] fp32, lse [b, m, H] fp32).

    `causal`: the block sits on the diagonal (query i sees keys 0..i); else every key is visible.
    Scores and softmax in fp32, probabilities cast to v's dtype, as `model.ops.dot_attention`.
    """
    b, m, H, Dh = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(b, m, kv_heads, H // kv_heads, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k).astype(jnp.float32) / jnp.sqrt(Dh).astype(jnp.float32)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((m, m), dtype=bool)), scores, MASKED)
    lse = jax.nn.logsumexp(scores, axis=-1)                                     # [b, KV, g, m]
    probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).astype(jnp.float32).reshape(b, m, H, Dh)
    return out, lse.transpose(0, 3, 1, 2).reshape(b, m, H)


def merge(a, b):
    """Two partial attentions (out, lse) of the same queries over disjoint keys -> their union's."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    return (out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None]), lse


def _pick(flag, when_true, when_false):
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), when_true, when_false)


def ring_attention(q, k, v, *, axis: str, block: Callable = block_attention):
    """Causal attention of the zigzag-ordered sequence split over `axis` (see the module docstring).

    `block(q, k, v, causal) -> (out, lse)` computes one chunk pair (the jnp reference, or a flash kernel).
    """
    c = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    half = q.shape[1] // 2
    q0, q1 = q[:, :half], q[:, half:]                     # chunks me and 2c-1-me
    kv = jnp.stack([k, v])                                # one ppermute carries both
    # step 0, the device's own keys: chunk me sees itself causally; chunk 2c-1-me sees chunk me whole and itself
    first = merge(block(q1, k[:, :half], v[:, :half], False), block(q1, k[:, half:], v[:, half:], True))
    ring = [(j, (j + 1) % c) for j in range(c)]

    def step(carry, index):
        kv, acc0, acc1 = carry
        kv = jax.lax.ppermute(kv, axis, ring)             # now the blocks of device me - index
        k0, k1, v0, v1 = kv[0, :, :half], kv[0, :, half:], kv[1, :, :half], kv[1, :, half:]
        acc1 = merge(acc1, block(q1, k0, v0, False))      # chunk 2c-1-me sees every other device's first chunk
        earlier = index <= me                             # the sender is device me - index >= 0
        # an earlier device's first chunk is seen by chunk me; a later device's second chunk by chunk 2c-1-me
        extra = block(jnp.where(earlier, q0, q1), jnp.where(earlier, k0, k1), jnp.where(earlier, v0, v1), False)
        acc0, acc1 = _pick(earlier, merge(acc0, extra), acc0), _pick(earlier, acc1, merge(acc1, extra))
        return (kv, acc0, acc1), None

    carry = (kv, block(q0, k[:, :half], v[:, :half], True), first)
    (_, (out0, _), (out1, _)), _ = jax.lax.scan(step, carry, jnp.arange(1, c))
    return jnp.concatenate([out0, out1], axis=1).astype(q.dtype)


def all_to_all_attention(q, k, v, *, axis: str, attention: Callable):
    """Causal attention of the naturally ordered sequence split over `axis`: heads <-> sequence, twice."""
    def to_heads(x):      # [b, n, heads, Dh] -> [b, S, heads / c, Dh]
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    out = attention(to_heads(q), to_heads(k), to_heads(v))
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)

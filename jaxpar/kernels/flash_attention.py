"""Flash attention with FlashAttention-2's structure, as Pallas kernels, beside its pure-jnp reference.

`attention_reference` materializes the [S, S] scores per head; `flash_attention` never does.

forward   grid (batch, head, query block). One program holds a block of queries and walks
          the key/value blocks it may see (causal: only those at or left of the diagonal),
          keeping a running max m, a running sum l and an unnormalized output (the online
          softmax). It writes the output and only the log-sum-exp lse = m + log(l): [B, H, S]
          fp32, instead of the [B, H, S, S] probabilities a plain backward would keep.
backward  delta = rowsum(dO * O) first (a cheap XLA fusion), then two kernels that recompute
          each block's probabilities from q, k and lse:
            dq   grid (batch, head, query block), walks key blocks:   dq += dS k
            dkv  grid (batch, head, key block),   walks query blocks: dv += Pᵀ dO, dk += dSᵀ q
          with dS = P * (dO vᵀ - delta). FA-2 accumulates dq with atomic adds inside the dkv
          loop (5 block matmuls); two kernels recompute QKᵀ and dO vᵀ once more (7) but need no
          atomics and are deterministic.
GQA/MQA   query head h reads key/value head h // (H / KV) through the BlockSpec index map; the
          dkv kernel writes dk, dv per query head (fp32) and the group is summed afterwards, as
          FA-2 does for grouped heads.
lengths   a sequence that is not a multiple of the blocks is padded with zeros up to one; the
          causal mask already hides padded keys from real queries (their positions are larger),
          padded query rows are sliced off (their cotangent is zero, so they add nothing to dk, dv).

Block sizes are powers of two >= 16 (Triton's `tl.dot` minimum); they are clamped to the
padded sequence. Masking is applied only on blocks that cross the diagonal (or the padding).
On GPU the kernels lower through Triton (`interpret=False`); on CPU `interpret=True` runs the
same kernel bodies as XLA loops, so every test runs in CI.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpar.kernels import varying

MIN_BLOCK = 16
NEG_INF = float("-inf")
MASKED = -1e30          # finite: a fully masked block never produces inf - inf


# ----------------------------------------------------------------------------- reference

def attention_reference(q, k, v, *, causal: bool = True, scale: float | None = None):
    """Grouped-query attention in fp32 with the full [S, S] scores: q [B,S,H,Dh], k/v [B,S,KV,Dh]."""
    B, S, H, Dh = q.shape
    kv_heads = k.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    q32 = q.astype(jnp.float32).reshape(B, S, kv_heads, H // kv_heads, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q32, k.astype(jnp.float32)) * scale
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((S, S), dtype=bool)), scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v.astype(jnp.float32))
    return out.reshape(B, S, H, Dh).astype(q.dtype)


# ----------------------------------------------------------------------------- settings

@dataclasses.dataclass(frozen=True)
class Blocks:
    """Static settings of one call: block sizes (after clamping), lengths, mask, scale, backend."""

    block_q: int
    block_k: int
    seq_len: int            # the real length; the arrays the kernels see are padded to `padded`
    padded: int
    causal: bool
    scale: float
    interpret: bool

    @property
    def q_blocks(self) -> int:
        return self.padded // self.block_q

    @property
    def k_blocks(self) -> int:
        return self.padded // self.block_k


def _check_block(name: str, size: int) -> None:
    if size < MIN_BLOCK or size & (size - 1):
        raise ValueError(f"{name}={size}: flash attention blocks are powers of two >= {MIN_BLOCK} "
                         "(Triton's block shapes are powers of two; tl.dot needs at least 16)")


def plan(seq_len: int, head_dim: int, *, block_q: int, block_k: int, causal: bool, scale, interpret: bool) -> Blocks:
    """Clamp the blocks to the sequence and pad the sequence to a multiple of both blocks."""
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    if head_dim < MIN_BLOCK or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the flash attention kernel needs a power of two >= {MIN_BLOCK} "
                         "(64 and 128 are the tuned cases)")
    whole = max(MIN_BLOCK, pl.next_power_of_2(seq_len))
    bq, bk = min(block_q, whole), min(block_k, whole)
    padded = pl.cdiv(seq_len, max(bq, bk)) * max(bq, bk)
    return Blocks(bq, bk, seq_len, padded, causal, 1.0 / math.sqrt(head_dim) if scale is None else float(scale),
                  interpret)


def _compiler_params(head_dim: int, interpret: bool):
    """Triton launch settings on GPU: 4 warps for head_dim 64, 8 for 128 (the FA-2 Triton tutorial's)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


# ----------------------------------------------------------------------------- which blocks a program visits

def _key_range(i, c: Blocks):
    """Key blocks query block i walks: [0, unmasked) need no mask, [unmasked, end) do."""
    end: jax.Array | int
    if c.causal:
        unmasked = (i * c.block_q + 1) // c.block_k                   # last key <= first query of the block
        end = jnp.minimum(((i + 1) * c.block_q + c.block_k - 1) // c.block_k, c.k_blocks)
    else:
        unmasked, end = c.seq_len // c.block_k, c.k_blocks           # only the padded tail is masked
    return unmasked, end


def _query_range(j, c: Blocks):
    """Query blocks key block j is seen by: [start, unmasked) need a mask, [unmasked, end) do not."""
    if c.causal:
        start = (j * c.block_k) // c.block_q
        unmasked = jnp.minimum(((j + 1) * c.block_k - 1 + c.block_q - 1) // c.block_q, c.q_blocks)
        return start, jnp.maximum(unmasked, start), c.q_blocks
    has_padding = ((j + 1) * c.block_k > c.seq_len).astype(jnp.int32)
    return 0, has_padding * c.q_blocks, c.q_blocks                   # a block with padded keys: mask every row


def _visible(q_pos, k_pos, c: Blocks):
    """[bq, bk] mask: causal (key at or before the query), or the key is not padding."""
    if c.causal:
        return k_pos[None, :] <= q_pos[:, None]
    return (k_pos[None, :] < c.seq_len) | (q_pos[:, None] < 0)          # [bq, bk]: keys that are not padding


def _scores(q, k, q_pos, k_pos, c: Blocks, masked: bool):
    """q kᵀ · scale in fp32 for one [bq, bk] block, masked when the block crosses the diagonal or padding."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * c.scale
    return jnp.where(_visible(q_pos, k_pos, c), s, MASKED) if masked else s


# ----------------------------------------------------------------------------- forward kernel

def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, c: Blocks):
    i = pl.program_id(2)
    q = q_ref[...]                                                     # [bq, Dh], stays on chip
    q_pos = i * c.block_q + jnp.arange(c.block_q)

    def visit(j, carry, masked):
        acc, m, l = carry
        k = k_ref[pl.ds(j * c.block_k, c.block_k), :]
        v = v_ref[pl.ds(j * c.block_k, c.block_k), :]
        s = _scores(q, k, q_pos, j * c.block_k + jnp.arange(c.block_k), c, masked)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        rescale = jnp.exp(m - m_new)                                   # earlier blocks' terms, re-based
        acc = acc * rescale[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, l * rescale + jnp.sum(p, axis=1)

    unmasked, end = _key_range(i, c)
    start = (jnp.zeros((c.block_q, q.shape[-1]), jnp.float32), jnp.full((c.block_q,), NEG_INF, jnp.float32),
             jnp.zeros((c.block_q,), jnp.float32))
    carry = jax.lax.fori_loop(0, unmasked, functools.partial(visit, masked=False), start)
    acc, m, l = jax.lax.fori_loop(unmasked, end, functools.partial(visit, masked=True), carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _pairs(c: Blocks) -> int:
    """(query block, key block) pairs the kernels visit: the FLOP count's unit."""
    if not c.causal:
        return c.q_blocks * c.k_blocks
    return sum(min(c.k_blocks, ((i + 1) * c.block_q + c.block_k - 1) // c.block_k) for i in range(c.q_blocks))


def _cost(c: Blocks, B: int, H: int, Dh: int, matmuls: int, nbytes: int):
    """FLOPs the kernel executes: `matmuls` [bq, bk, Dh] block matmuls per visited pair (kernels/costs.py)."""
    pairs = B * H * _pairs(c)
    return pl.CostEstimate(flops=int(2 * matmuls * pairs * c.block_q * c.block_k * Dh),
                           transcendentals=int(pairs * c.block_q * c.block_k), bytes_accessed=int(nbytes))


def _forward(q, k, v, c: Blocks):
    """Padded q [B,P,H,Dh], k/v [B,P,KV,Dh] -> (out [B,P,H,Dh], lse [B,H,P] fp32)."""
    B, P, H, Dh = q.shape
    group = H // k.shape[2]
    q_spec = pl.BlockSpec((None, c.block_q, None, Dh), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, P, None, Dh), lambda b, h, i: (b, 0, h // group, 0))
    nbytes = sum(x.size * x.dtype.itemsize for x in (q, k, v)) * 2
    (q, k, v), axes = varying.match(q, k, v)
    return pl.pallas_call(
        functools.partial(_forward_kernel, c=c),
        grid=(B, H, c.q_blocks),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, pl.BlockSpec((None, None, c.block_q), lambda b, h, i: (b, h, i))],
        out_shape=[varying.struct(q.shape, q.dtype, axes), varying.struct((B, H, P), jnp.float32, axes)],
        compiler_params=_compiler_params(Dh, c.interpret),
        cost_estimate=_cost(c, B, H, Dh, 2, nbytes),
        interpret=c.interpret,
        name="jaxpar_flash_forward",
    )(q, k, v)


# ----------------------------------------------------------------------------- backward kernels

def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, c: Blocks):
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = i * c.block_q + jnp.arange(c.block_q)

    def visit(j, dq, masked):
        k = k_ref[pl.ds(j * c.block_k, c.block_k), :]
        v = v_ref[pl.ds(j * c.block_k, c.block_k), :]
        p = jnp.exp(_scores(q, k, q_pos, j * c.block_k + jnp.arange(c.block_k), c, masked) - lse[:, None])
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    unmasked, end = _key_range(i, c)
    dq = jax.lax.fori_loop(0, unmasked, functools.partial(visit, masked=False),
                           jnp.zeros((c.block_q, q.shape[-1]), jnp.float32))
    dq = jax.lax.fori_loop(unmasked, end, functools.partial(visit, masked=True), dq)
    dq_ref[...] = (dq * c.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, c: Blocks):
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]                                      # [bk, Dh], stay on chip
    k_pos = j * c.block_k + jnp.arange(c.block_k)

    def visit(i, carry, masked):
        dk, dv = carry
        rows = pl.ds(i * c.block_q, c.block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse, delta = lse_ref[rows], delta_ref[rows]
        p = jnp.exp(_scores(q, k, i * c.block_q + jnp.arange(c.block_q), k_pos, c, masked) - lse[:, None])
        dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
        return dk, dv

    start, masked_end, end = _query_range(j, c)
    zeros = jnp.zeros((c.block_k, k.shape[-1]), jnp.float32)
    carry = jax.lax.fori_loop(start, masked_end, functools.partial(visit, masked=True), (zeros, zeros))
    dk, dv = jax.lax.fori_loop(masked_end, end, functools.partial(visit, masked=False), carry)
    dk_ref[...] = (dk * c.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, out, lse, do, c: Blocks, dlse=None):
    """Gradients (dq, dk, dv) of the padded arrays, recomputing each block's probabilities.

    `dlse` [B,H,P]: a cotangent of the log-sum-exp too (`flash_attention_with_lse`); d lse / d s = P, so it
    enters as dS = P * (dP - (delta - dlse)).
    """
    B, P, H, Dh = q.shape
    kv_heads = k.shape[2]
    group = H // kv_heads
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse
    (q, k, v, do, lse, delta), axes = varying.match(q, k, v, do, lse, delta)
    params = _compiler_params(Dh, c.interpret)
    nbytes = sum(x.size * x.dtype.itemsize for x in (q, k, v, do)) * 2

    head_block = lambda size: pl.BlockSpec((None, size, None, Dh), lambda b, h, n: (b, n, h, 0))
    head_whole = pl.BlockSpec((None, P, None, Dh), lambda b, h, n: (b, 0, h, 0))
    kv_block = pl.BlockSpec((None, c.block_k, None, Dh), lambda b, h, n: (b, n, h // group, 0))
    kv_whole = pl.BlockSpec((None, P, None, Dh), lambda b, h, n: (b, 0, h // group, 0))
    row_block = pl.BlockSpec((None, None, c.block_q), lambda b, h, n: (b, h, n))
    row_whole = pl.BlockSpec((None, None, P), lambda b, h, n: (b, h, 0))

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, c=c), grid=(B, H, c.q_blocks),
        in_specs=[head_block(c.block_q), kv_whole, kv_whole, head_block(c.block_q), row_block, row_block],
        out_specs=head_block(c.block_q), out_shape=varying.struct(q.shape, q.dtype, axes),
        compiler_params=params, cost_estimate=_cost(c, B, H, Dh, 3, nbytes), interpret=c.interpret,
        name="jaxpar_flash_backward_dq",
    )(q, k, v, do, lse, delta)

    # dk, dv per query head; a group's heads are summed below (fp32 so the sum loses nothing)
    per_head = jnp.float32 if group > 1 else k.dtype
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, c=c), grid=(B, H, c.k_blocks),
        in_specs=[head_whole, kv_block, kv_block, head_whole, row_whole, row_whole],
        out_specs=[head_block(c.block_k), head_block(c.block_k)],
        out_shape=[varying.struct((B, P, H, Dh), per_head, axes)] * 2,
        compiler_params=params, cost_estimate=_cost(c, B, H, Dh, 4, nbytes), interpret=c.interpret,
        name="jaxpar_flash_backward_dkv",
    )(q, k, v, do, lse, delta)
    if group > 1:
        dk = dk.reshape(B, P, kv_heads, group, Dh).sum(axis=3)
        dv = dv.reshape(B, P, kv_heads, group, Dh).sum(axis=3)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- the differentiable op

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, c: Blocks):
    return _forward(q, k, v, c)[0]


def _flash_fwd(q, k, v, c: Blocks):
    out, lse = _forward(q, k, v, c)
    return out, (q, k, v, out, lse)          # the [B, H, S] lse is the only softmax statistic kept


def _flash_bwd(c: Blocks, residuals, do):
    q, k, v, out, lse = residuals
    return _backward(q, k, v, out, lse, do, c)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, causal: bool = True, scale: float | None = None, block_q: int = 128,
                    block_k: int = 128, interpret: bool | None = None):
    """Attention of q [B,S,H,Dh] over k, v [B,S,KV,Dh] (KV divides H) without the [S, S] scores.

    `interpret`: None runs the kernels interpreted on CPU and through Triton elsewhere.
    Head counts come from the shapes, so a device's local heads under tensor parallelism work as is.
    """
    B, S, H, Dh = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, S) or k.shape[3] != Dh or H % k.shape[2]:
        raise ValueError(f"flash_attention: q {q.shape} and k/v {k.shape}/{v.shape} must be [B,S,H,Dh] and "
                         "[B,S,KV,Dh] with KV dividing H (self-attention: one sequence length)")
    q, k, v, c = _blocked(q, k, v, block_q=block_q, block_k=block_k, causal=causal, scale=scale, interpret=interpret)
    out = _flash(q, k, v, c)
    return out[:, :S] if c.padded != S else out


def _blocked(q, k, v, *, block_q, block_k, causal, scale, interpret):
    """The kernels' block plan for these shapes, with q, k, v padded to whole blocks and of one varying type."""
    S, Dh = q.shape[1], q.shape[3]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    c = plan(S, Dh, block_q=block_q, block_k=block_k, causal=causal, scale=scale, interpret=interpret)
    if c.padded != S:
        pad = ((0, 0), (0, c.padded - S), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    (q, k, v), _ = varying.match(q, k, v)
    return q, k, v, c


# ----------------------------------------------------------------------------- with the log-sum-exp

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash_lse(q, k, v, c: Blocks):
    return _forward(q, k, v, c)


def _flash_lse_fwd(q, k, v, c: Blocks):
    out, lse = _forward(q, k, v, c)
    return (out, lse), (q, k, v, out, lse)


def _flash_lse_bwd(c: Blocks, residuals, cotangents):
    q, k, v, out, lse = residuals
    do, dlse = cotangents
    return _backward(q, k, v, out, lse, do, c, dlse)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def flash_attention_with_lse(q, k, v, *, causal: bool, block_q: int = 128, block_k: int = 128,
                             interpret: bool | None = None):
    """`flash_attention` that also returns each query's log-sum-exp [B,S,H] fp32, differentiably: what merging
    partial attentions over disjoint keys needs (ring attention, parallel/context_attention.py)."""
    S = q.shape[1]
    q, k, v, c = _blocked(q, k, v, block_q=block_q, block_k=block_k, causal=causal, scale=None, interpret=interpret)
    out, lse = _flash_lse(q, k, v, c)
    return out[:, :S], lse[:, :, :S].transpose(0, 2, 1)

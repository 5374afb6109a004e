"""Megatron-LM's tensor-parallel building blocks, written out for a `shard_map` over one mesh axis.

Inside the per-device program each device holds 1/t of the heads, of the MLP hidden
dimension and of the vocabulary. Two conjugate operators carry the activations across
the split (Shoeybi et al. 2019, fig. 3):

  f = `copy_to_parallel`    forward: identity;    backward: all-reduce (psum) of the gradient
  g = `reduce_from_parallel` forward: all-reduce;  backward: identity

f stands before every column-parallel matmul (q/k/v, gate/up, the output head): each
device multiplies the same input by its own columns, so the input's gradient is the sum
of the devices' contributions. g stands after every row-parallel matmul (wo, down):
each device holds a partial sum of the output. The vocabulary-parallel embedding looks
up only its own rows and sums with g; the vocabulary-parallel cross-entropy never
gathers the logits: it all-reduces the max, the sum of exponentials and the target's
logit, three numbers per token.

These are written for `shard_map(..., check_vma=False)`: JAX then inserts no implicit
collective, and every reduction in the step is one of the operators below.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxpar.model.ops import Ops


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_parallel(x, axis):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return x


def _copy_fwd(x, axis):
    return x, None


def _copy_bwd(axis, _, g):
    return (jax.lax.psum(g, axis),)


copy_to_parallel.defvjp(_copy_fwd, _copy_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_parallel(x, axis):
    """Megatron's g: all-reduce forward, identity backward."""
    return jax.lax.psum(x, axis)


def _reduce_fwd(x, axis):
    return jax.lax.psum(x, axis), None


def _reduce_bwd(axis, _, g):
    return (g,)


reduce_from_parallel.defvjp(_reduce_fwd, _reduce_bwd)


def _local_range(rows: int, axis: str):
    start = jax.lax.axis_index(axis) * rows
    return start, start + rows


def vocab_parallel_embedding(tokens, table, axis: str):
    """This device's vocabulary rows [V/t, D]: look up the tokens it owns, zeros elsewhere, then g."""
    start, stop = _local_range(table.shape[0], axis)
    mine = (tokens >= start) & (tokens < stop)
    rows = jnp.take(table, jnp.where(mine, tokens - start, 0), axis=0)
    return reduce_from_parallel(jnp.where(mine[..., None], rows, jnp.zeros_like(rows)), axis)


def vocab_parallel_cross_entropy(x, head, targets, ops: Ops, axis: str):
    """Mean cross-entropy from this device's logits columns [B, S, V/t], never gathering the full logits.

    loss = log sum_v exp(z_v - m) - (z_target - m), with m the max over all shards; the sums
    over the vocabulary are g's all-reduces of per-token partial sums.
    """
    logits = ops.logits(x, head)
    start, stop = _local_range(logits.shape[-1], axis)
    top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis)   # a shift only: no gradient
    shifted = logits - top[..., None]
    sum_exp = reduce_from_parallel(jnp.sum(jnp.exp(shifted), axis=-1), axis)
    mine = (targets >= start) & (targets < stop)
    local = jnp.take_along_axis(shifted, jnp.where(mine, targets - start, 0)[..., None], axis=-1)[..., 0]
    target = reduce_from_parallel(jnp.where(mine, local, 0.0), axis)
    return jnp.mean(jnp.log(sum_exp) - target)


def tensor_parallel_ops(base: Ops, axis: str = "tensor") -> Ops:
    """`base` with Megatron's pieces over `axis`: f before column-parallel matmuls, g after row-parallel
    ones, the vocabulary-parallel embedding and cross-entropy. Attention needs nothing: it reads its
    local head count from the shapes."""
    return base.replace(
        column_in=partial(copy_to_parallel, axis=axis),
        row_out=partial(reduce_from_parallel, axis=axis),
        embed=partial(vocab_parallel_embedding, axis=axis),
        cross_entropy=partial(vocab_parallel_cross_entropy, axis=axis),
    )

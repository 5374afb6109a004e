"""Megatron-LM's tensor-parallel operators, written for a `shard_map(..., check_vma=False)` over one mesh
axis (JAX then inserts no implicit collective: every reduction in the step is one of these).

  f = copy_to_parallel        forward: identity;       backward: psum            (before column-parallel)
  g = reduce_from_parallel    forward: psum;           backward: identity        (after row-parallel)
  gather_sequence             forward: all-gather;     backward: reduce-scatter  (f under SP)
  reduce_scatter_sequence     forward: reduce-scatter; backward: all-gather      (g under SP)

plus the vocabulary-parallel embedding and cross-entropy and `sequence_parallel_policy` (the s/t shard of
a column-parallel input kept, gathered again in the backward). Why each stands where it does:
experiments/03_tensor/README.md, "How the manual strategies are written".
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxpar.kernels.cross_entropy import chunked_cross_entropy
from jaxpar.model.ops import Ops
from jaxpar.parallel.step import never_saving, produced_by


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


def _owned_rows(tokens, table, axis: str):
    """This device's vocabulary rows [V/t, D]: the rows of the tokens it owns, zeros for the others."""
    start, stop = _local_range(table.shape[0], axis)
    mine = (tokens >= start) & (tokens < stop)
    rows = jnp.take(table, jnp.where(mine, tokens - start, 0), axis=0)
    return jnp.where(mine[..., None], rows, jnp.zeros_like(rows))


def vocab_parallel_embedding(tokens, table, axis: str):
    """This device's vocabulary rows [V/t, D]: look up the tokens it owns, zeros elsewhere, then g."""
    return reduce_from_parallel(_owned_rows(tokens, table, axis), axis)


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


def vocab_parallel_loss(base: Ops, axis: str):
    """The run's cross-entropy over a vocabulary split on `axis`: the chunked kernel takes the axis itself
    (model.loss=chunked); any other loss becomes `vocab_parallel_cross_entropy`."""
    loss = base.cross_entropy
    if isinstance(loss, partial) and loss.func is chunked_cross_entropy:
        return partial(loss, axis=axis)
    return partial(vocab_parallel_cross_entropy, axis=axis)


def tensor_parallel_ops(base: Ops, axis: str = "tensor") -> Ops:
    """`base` with Megatron's pieces over `axis`: f before column-parallel matmuls, g after row-parallel
    ones, the vocabulary-parallel embedding and cross-entropy. Attention needs nothing: it reads its
    local head count from the shapes."""
    return base.replace(
        column_in=partial(copy_to_parallel, axis=axis),
        row_out=partial(reduce_from_parallel, axis=axis),
        embed=partial(vocab_parallel_embedding, axis=axis),
        cross_entropy=vocab_parallel_loss(base, axis),
    )


# ----------------------------------------------------------------------------- sequence parallelism

SEQUENCE_DIM = 1   # activations are [batch, sequence, ...]


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_sequence(x, axis):
    """SP's f (Megatron-LM `gather_from_sequence_parallel_region`): all-gather the sequence
    [b, s/t, h] -> [b, s, h] forward; reduce-scatter the gradient back to [b, s/t, h]."""
    return jax.lax.all_gather(x, axis, axis=SEQUENCE_DIM, tiled=True)


def _gather_fwd(x, axis):
    return gather_sequence(x, axis), None


def _gather_bwd(axis, _, g):
    return (jax.lax.psum_scatter(g, axis, scatter_dimension=SEQUENCE_DIM, tiled=True),)


gather_sequence.defvjp(_gather_fwd, _gather_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_scatter_sequence(x, axis):
    """SP's g (Megatron-LM `reduce_scatter_to_sequence_parallel_region`): sum the devices' partial
    [b, s, h] and keep this device's s/t tokens forward; all-gather the gradient backward."""
    return jax.lax.psum_scatter(x, axis, scatter_dimension=SEQUENCE_DIM, tiled=True)


def _scatter_fwd(x, axis):
    return reduce_scatter_sequence(x, axis), None


def _scatter_bwd(axis, _, g):
    return (jax.lax.all_gather(g, axis, axis=SEQUENCE_DIM, tiled=True),)


reduce_scatter_sequence.defvjp(_scatter_fwd, _scatter_bwd)


def sequence_parallel_embedding(tokens, table, axis: str):
    """The vocabulary-parallel lookup, ending in SP's g: each device keeps its s/t tokens of the sum."""
    return reduce_scatter_sequence(_owned_rows(tokens, table, axis), axis)


def sequence_parallel_ops(base: Ops, axis: str = "tensor") -> Ops:
    """`tensor_parallel_ops` with the sequence split between the parallel regions: the residual stream,
    the norms and the final norm see [b, s/t, h]; all-gather before the column-parallel matmuls (and the
    head), reduce-scatter after the row-parallel ones and after the embedding lookup. The head's
    cross-entropy is TP's: every device gathers the full sequence and keeps its vocabulary columns."""
    return base.replace(
        column_in=partial(gather_sequence, axis=axis),
        row_out=partial(reduce_scatter_sequence, axis=axis),
        embed=partial(sequence_parallel_embedding, axis=axis),
        cross_entropy=vocab_parallel_loss(base, axis),
    )


def sequence_parallel_policy(policy=None):
    """Remat policy for a layer under SP: `policy` (None: save everything), except a gathered sequence.

    The matmuls after `gather_sequence` need its full [b, s, h] output for their weight gradients;
    this policy keeps the s/t input instead and gathers again in the backward pass, as Megatron-LM's
    column-parallel linear does under sequence parallelism (so that activation is divided by t too)."""
    return never_saving(produced_by(("all_gather",)), policy)

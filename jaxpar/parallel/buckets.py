"""DDP / ZeRO-2 gradient buckets: the layers' gradients reduced during the backward pass (`parallel.grad_buckets`).

Plain DDP (zero.py) all-reduces the whole gradient once, after the backward pass: nothing
is left to compute beside that collective. PyTorch DDP instead packs the gradients into
buckets (`bucket_cap_mb`) and all-reduces a bucket as soon as the backward pass has filled
it, while the layers below are still differentiated. Here the stacked layers are cut into
B buckets of L/B consecutive layers and the layer loop becomes two nested scans:

  forward    for each bucket b: w = reduce_in_backward(layers of b); for each layer of b: x = block(x, w_l)
  backward   for b = B-1..0: the bucket's layers' vjps, then ONE collective on the bucket's
             gradient, packed flat (psum for DDP, psum_scatter for ZeRO-2)

`reduce_in_backward` is an identity (it marks the weights varying over `data`) whose custom vjp
packs the bucket's gradient into one flat buffer and reduces it: B collectives inside the
backward loop instead of one after it. The bytes are unchanged (the same gradient is reduced,
in pieces); only their number and their place in the program move. The embedding, final norm
and head are reduced one array each where their gradient is complete (JAX's own transpose of
the varying mark for DDP, zero.py's `use_local_copy` for ZeRO-2).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

AXIS = "data"


def _pack(leaves, dims, n):
    """Leaves -> one [n, S] buffer whose row i holds device i's slice (along `dims`) of every leaf, flattened."""
    return jnp.concatenate([jnp.moveaxis(g, d, 0).reshape(n, -1) for g, d in zip(leaves, dims)], axis=1)


def _unpack(flat, leaves, dims, n):
    """The inverse of `_pack` for one row: each leaf's part, shaped as the leaf with dimension `dims` cut by n."""
    out, start = [], 0
    for g, d in zip(leaves, dims):
        moved = jnp.moveaxis(g, d, 0).shape
        part_shape = (moved[0] // n, *moved[1:])
        size = g.size // n
        part = flat[start:start + size].reshape(part_shape).astype(g.dtype)
        out.append(jnp.moveaxis(part, 0, d))
        start += size
    return out


def reduce_flat(tree, dims: tuple | None, n: int):
    """One collective over `data` for the whole tree: psum (dims None: DDP) or, with each leaf's split
    dimension in `dims` (flattened leaf order), psum_scatter leaving this device's slices (ZeRO-2)."""
    leaves, treedef = jax.tree.flatten(tree)
    if dims is None:
        flat = jax.lax.psum(jnp.concatenate([g.ravel() for g in leaves]), AXIS)
        return treedef.unflatten(_unpack(flat, leaves, (0,) * len(leaves), 1))
    mine = jax.lax.psum_scatter(_pack(leaves, dims, n), AXIS, scatter_dimension=0, tiled=True)[0]
    return treedef.unflatten(_unpack(mine, leaves, dims, n))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def reduce_in_backward(target, used, dims, n):
    """Forward: `used` (full weights) marked varying over `data`. Backward: their gradient reduced in ONE
    collective into `target`'s cotangent (DDP: target is `used`; ZeRO-2: this device's slices)."""
    return jax.tree.map(lambda w: jax.lax.pcast(w, AXIS, to="varying"), used)


def _reduce_fwd(target, used, dims, n):
    return reduce_in_backward(target, used, dims, n), None


def _reduce_bwd(dims, n, _, grads):
    zeros = jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), grads)   # DDP: added to target's, the same array
    return reduce_flat(grads, dims, n), zeros


reduce_in_backward.defvjp(_reduce_fwd, _reduce_bwd)


def bucketed_layers(buckets: int, weights, policy):
    """An `Ops.layers` loop over the stacked layers in `buckets` groups of consecutive layers.

    `weights(group)`: the stored parameters of one bucket (leading axis: its layers) -> the weights its
    layers compute with, through `reduce_in_backward`. `policy`: the remat policy of one bucket's body; it
    must never save the varying mark (the backward recomputes it: it is free)."""
    def run(blocks, x, block_fn):
        layers = jax.tree.leaves(blocks)[0].shape[0]
        groups = jax.tree.map(lambda a: a.reshape(buckets, layers // buckets, *a.shape[1:]), blocks)

        def bucket(x, group):
            return jax.lax.scan(block_fn, x, weights(group))   # the bucket's layers, one after the other

        x, aux = jax.lax.scan(jax.checkpoint(bucket, policy=policy, prevent_cse=False), x, groups)
        return x, jax.tree.map(lambda a: a.reshape(layers, *a.shape[2:]), aux)

    return run

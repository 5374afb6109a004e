"""DDP / ZeRO-2 gradient buckets: the layers' gradients reduced during the backward pass (`parallel.grad_buckets`).

Plain DDP (zero.py) all-reduces the whole gradient once, after the backward pass: nothing
is left to compute beside that collective. PyTorch DDP instead packs the gradients into
buckets (`bucket_cap_mb`) and all-reduces a bucket as soon as the backward pass has filled
it, while the layers below are still being differentiated. Here the stacked layers are cut
into B buckets of L/B consecutive layers, and the layer loop has its own backward pass:

  forward    for each bucket b, for each of its layers l: x = block_l(x, fetch(w_l)); keep the layer's input
  backward   dW_{B-1} = bucket B-1's backward
             for b = B-2..0: reduce(dW_{b+1})  and  dW_b = bucket b's backward      (independent: overlappable)
             reduce(dW_0)                                                            (exposed, as in PyTorch)

`reduce` packs a bucket's gradient into one flat buffer: ONE collective per bucket (psum for
DDP, psum_scatter for ZeRO-2). Bucket b+1's collective sits in the same loop iteration as
bucket b's backward compute and shares no data with it, so an async collective (GPU) runs
beside that compute. The bytes are those of the unbucketed reduction (the same gradient, in
pieces); only their number and their place move. Like prefetch.py, the loop keeps each
layer's input and recomputes the layer in the backward pass (remat `full`). The embedding,
final norm and head are reduced one array each where their gradient is complete (zero.py).
"""
from __future__ import annotations

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
        size = g.size // n
        part = flat[start:start + size].reshape(moved[0] // n, *moved[1:])
        out.append(jnp.moveaxis(part, 0, d))
        start += size
    return out


def reduce_flat(tree, dims: tuple | None, n: int):
    """One collective over `data` for the whole tree: psum (dims None: DDP) or, with each leaf's split
    dimension in `dims` (flattened leaf order), psum_scatter leaving this device's slices (ZeRO-2)."""
    leaves, treedef = jax.tree.flatten(tree)
    if dims is None:
        flat = jax.lax.psum(jnp.concatenate([g.ravel() for g in leaves]), AXIS)
        return jax.tree.unflatten(treedef, _unpack(flat, leaves, (0,) * len(leaves), 1))
    mine = jax.lax.psum_scatter(_pack(leaves, dims, n), AXIS, scatter_dimension=0, tiled=True)[0]
    return jax.tree.unflatten(treedef, _unpack(mine, leaves, dims, n))


def _cut(tree, buckets):
    return jax.tree.map(lambda a: a.reshape(buckets, a.shape[0] // buckets, *a.shape[1:]), tree)


def bucketed_layers(buckets: int, split, fetch, reduce):
    """An `Ops.layers` loop over the stacked layers in `buckets` buckets of consecutive layers.

    split(blocks) -> (targets, used): what receives the reduced gradient (DDP: the params; ZeRO-2: this
    device's slices) and the stored weights the layers compute with. fetch(used) -> weights (varying over
    `data`, compute dtype). reduce(bucket's weight gradient) -> its targets' part, in ONE collective."""
    def run(blocks, x, block_fn):
        apply = lambda x, w: block_fn(x, w)[0]
        targets, used = split(blocks)

        def bucket_backward(dy, inputs, stored):
            """One bucket's layers, last first: each recomputed from its input, then its vjp."""
            def layer(dy, xs):
                x_in, w = xs
                x_in, dy = jax.lax.optimization_barrier((x_in, dy))   # recompute when dy is there, not all early
                return jax.vjp(apply, x_in, w)[1](dy)
            # unrolled: straight-line compute the scheduler can place beside the collective (not a nested loop)
            return jax.lax.scan(layer, dy, (inputs, fetch(stored)), reverse=True, unroll=True)

        @jax.custom_vjp
        def loop(targets, used, x):
            return forward(targets, used, x)[0]

        def forward(targets, used, x):
            def bucket(x, stored):
                return jax.lax.scan(lambda x, w: (apply(x, w), x), x, fetch(stored))
            y, inputs = jax.lax.scan(bucket, x, _cut(used, buckets))   # inputs [B, L/B, ...]
            return y, (targets, used, inputs)

        def backward(saved, dy):
            targets, used, inputs = saved
            stored = _cut(used, buckets)
            grads = _cut(jax.tree.map(jnp.zeros_like, targets), buckets)   # zeros_like: varying like the targets
            put = lambda grads, b, part: jax.tree.map(   # in place: no concatenated copy of the whole gradient
                lambda g, p: jax.lax.dynamic_update_index_in_dim(g, p.astype(g.dtype), b, 0), grads, part)
            dy, pending = bucket_backward(dy, inputs[-1], jax.tree.map(lambda a: a[-1], stored))

            def step(carry, b):                                 # indexed, not sliced: no copy of the weights
                dy, pending, grads = carry
                grads = put(grads, b + 1, reduce(pending))      # bucket b+1's collective, beside bucket b's backward
                take = lambda a: jax.lax.dynamic_index_in_dim(a, b, keepdims=False)
                return (*bucket_backward(dy, take(inputs), jax.tree.map(take, stored)), grads), None
            (dx, pending, grads), _ = jax.lax.scan(step, (dy, pending, grads), jnp.arange(buckets - 1), reverse=True)
            grads = put(grads, 0, reduce(pending))
            return jax.tree.map(lambda g, t: g.reshape(t.shape), grads, targets), jax.tree.map(jnp.zeros_like, used), dx

        loop.defvjp(forward, backward)
        return loop(targets, used, x), {}

    return run

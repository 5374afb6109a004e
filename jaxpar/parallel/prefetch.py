"""ZeRO-3 / FSDP prefetch by hand: layer i+1's all-gather issued before layer i's compute.

ZeRO-3 (zero.py) gathers each layer's weights inside the layer loop, so in program order the
gather of layer i stands right before layer i's matmuls, which need it: nothing can hide it
unless the compiler moves it. Here the layer loop carries the *next* layer's gathered weights:

  forward    w = gather(layer 0); for i: w_next = gather(layer i+1); x = block_i(x, w); w = w_next
  backward   w = gather(layer L-1); for i = L-1..0: w_prev = gather(layer i-1);
             recompute block_i at its saved input, its vjp gives dx and dW_i;
             reduce-scatter(dW_i) (the slice's gradient); w = w_prev

so every gather has a whole layer of compute beside it in the data flow (PyTorch FSDP's
forward and backward prefetch). The memory cost is one more gathered layer alive at a time
(w and w_next: 2 layers instead of 1); the loop saves only each layer's input and recomputes
the layer in the backward pass (as remat `full` does), and the last step prefetches nothing.
The gradients are JAX's vjp of the same block: the same numbers as ZeRO-3 without prefetch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

AXIS = "data"


def _layer(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


def prefetching_layers(dims, dtype, axis: str = AXIS):
    """An `Ops.layers` loop over stacked ZeRO-3 slices; `dims`: each layer leaf's split dimension."""
    def gather(shards):
        return jax.tree.map(lambda s, d: jax.lax.all_gather(s.astype(dtype), axis, axis=d, tiled=True),
                            shards, dims)

    def scatter(grads, like):
        return jax.tree.map(lambda g, d, s: jax.lax.psum_scatter(g, axis, scatter_dimension=d, tiled=True)
                            .astype(s.dtype), grads, dims, like)

    def run(blocks, x, block_fn):
        apply = lambda x, w: block_fn(x, w)[0]

        @jax.custom_vjp
        def loop(blocks, x):
            return forward(blocks, x)[0]

        def forward(blocks, x):
            def step(carry, following):
                x, w = carry
                w_next = gather(following)                      # prefetch: issued before this layer's compute
                return (apply(x, w), w_next), x
            rest = jax.tree.map(lambda a: a[1:], blocks)
            (x_last, w), inputs = jax.lax.scan(step, (x, gather(_layer(blocks, 0))), rest)
            inputs = jnp.concatenate([inputs, x_last[None]])
            return apply(x_last, w), (blocks, inputs)

        def backward(saved, dy):
            blocks, inputs = saved
            def step(carry, layer):
                dy, w = carry
                x_in, previous = layer
                w_prev = gather(previous)                       # prefetch the layer below
                dx, dw = jax.vjp(apply, x_in, w)[1](dy)
                return (dx, w_prev), scatter(dw, previous)      # this layer's gradient slice, in the loop
            last = len(inputs) - 1
            earlier = jax.tree.map(lambda a: a[:-1], blocks)
            (dy, w), dws = jax.lax.scan(step, (dy, gather(_layer(blocks, last))), (inputs[1:], earlier),
                                        reverse=True)
            dx, dw0 = jax.vjp(apply, inputs[0], w)[1](dy)
            first = scatter(dw0, _layer(blocks, 0))
            return jax.tree.map(lambda a, rest: jnp.concatenate([a[None], rest]), first, dws), dx

        loop.defvjp(forward, backward)
        return loop(blocks, x), {}

    return run


"""Collective matmul: sequence parallelism's all-gather and reduce-scatter cut into `ppermute` steps,
each beside a partial matmul, so the transfer of one chunk runs while the previous one is multiplied.

Under sequence parallelism (megatron.py) device i of t holds the sequence chunk x_i [b, s/t, h].

  all-gather matmul (column-parallel: q/k/v, gate/up). Y = [x_0; ...; x_{t-1}] @ W. The chunks
      travel round the ring: at step k device i multiplies chunk (i-k) mod t, which it received at
      step k-1, while it passes that chunk on. No device waits for the whole gather: the first
      matmul starts on its own chunk. Bidirectional: chunks travel both ways round the ring, so
      t-1 chunks arrive in ceil((t-1)/2) steps using both directions of every link.
  matmul reduce-scatter (row-parallel: wo, w_down). out_i = sum_j x^(j)[chunk i] @ W^(j). A
      partial sum travels the ring: at step k device i adds its own term for chunk (i-1-k) mod t to
      the accumulator it received, and after t-1 steps holds the complete chunk i. Bidirectional:
      the output features are split in halves, one ring each way (each carries half the bytes).

The bytes each device sends are those of the all-gather and reduce-scatter they replace ((t-1)/t
of the buffer); what changes is that every transfer has a matmul beside it in the data flow,
so the scheduler can overlap them. Gradients are JAX's: ppermute's transpose is the reverse
ppermute, so the backward pass is the same ring in the other direction, also beside matmuls.

Ops integration: `column_in` returns the ring's chunks (a `Chunks`), `matmul` multiplies chunks
one by one, or runs the reduce-scatter ring for a row-parallel product (output `bsd`, input not
`bsd`), and `row_out` is the identity. The output head takes the chunks put together (no overlap).

Inside a hand-written pipeline (pipeline.py) a stage's layers run in one branch of a per-tick switch
that the other stages do not take. XLA:CPU's collective-permute meets every device of the program, so
there a ppermute waits forever (the runtime aborts after 40 s); an all-to-all meets its group only. So
the pipelines' rings step by `_swap`, an all-to-all that is the ring's step, bytes and all, for t = 2.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxpar.model.moe import MoEOps
from jaxpar.model.ops import Ops
from jaxpar.parallel.megatron import SEQUENCE_DIM
from jaxpar.parallel.step import never_saving, produced_by

MODES = ("none", "collective_matmul", "bidirectional")


@dataclasses.dataclass(frozen=True)
class Chunks:
    """This device's view of the gathered sequence: chunks in arrival order and their sequence positions."""

    arrays: tuple          # each [b, s/t, h]
    positions: tuple       # traced ints: the sequence chunk each array is

    def whole(self):
        """The gathered [b, s, h] (what an all-gather would have produced)."""
        return _in_sequence_order(self.arrays, self.positions)


def _shift(x, axis: str, t: int, step: int):
    """Send x to the device `step` places on (step = +1: to i+1, -1: to i-1) round the ring."""
    return jax.lax.ppermute(x, axis, perm=[(j, (j + step) % t) for j in range(t)])


def _swap(x, axis: str, t: int, step: int):
    """The ring step of t = 2 devices (a swap, either direction) as an all-to-all of [x, x]: it sends x, the
    permute's bytes, and meets only the devices of this `axis` group. A collective-permute meets every device
    of the program on XLA:CPU, so inside a pipeline stage's branch (the other stages run other branches) it
    waits for devices that never come; an all-to-all, like SP's all-gather, does not."""
    assert t == 2, "a swap is the ring of two devices"
    return _swapped(x, axis)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _swapped(x, axis: str):
    """x of the other device: one call for the remat policy to see (not its slice, which it would save);
    its transpose is the swap again."""
    both = jax.lax.all_to_all(jnp.stack([x, x]), axis, 0, 0, tiled=True)     # [x_0, x_1] on each device
    return jax.lax.dynamic_index_in_dim(both, 1 - jax.lax.axis_index(axis), axis=0, keepdims=False)


_swapped.defvjp(lambda x, axis: (_swapped(x, axis), None), lambda axis, _, dy: (_swapped(dy, axis),))


def _in_sequence_order(pieces, positions):
    """Stack `pieces` (chunk positions[k] at k) in sequence order along the sequence axis."""
    t = len(pieces)
    stacked = jnp.stack(pieces)                                      # [t, b, s/t, ...]
    slot = jnp.zeros((t,), jnp.int32).at[jnp.stack(positions)].set(jnp.arange(t, dtype=jnp.int32))
    ordered = jnp.take(stacked, slot, axis=0)
    ordered = jnp.moveaxis(ordered, 0, SEQUENCE_DIM)                 # [b, t, s/t, ...]
    return ordered.reshape(ordered.shape[0], -1, *ordered.shape[3:])


def gather_chunks(x, axis: str, bidirectional: bool, shift=_shift) -> Chunks:
    """The ring all-gather of the sequence, left as chunks so each can meet its matmul as it arrives."""
    t = jax.lax.axis_size(axis)
    i = jax.lax.axis_index(axis)
    arrays, positions = [x], [i]
    left, right = x, x
    received = 1
    for k in range(1, t):
        if received == t:
            break
        left = shift(left, axis, t, +1)                              # from i-k
        arrays.append(left)
        positions.append((i - k) % t)
        received += 1
        if bidirectional and received < t:
            right = shift(right, axis, t, -1)                        # from i+k
            arrays.append(right)
            positions.append((i + k) % t)
            received += 1
    return Chunks(tuple(arrays), tuple(positions))


def _column(matmul, spec: str, chunks: Chunks, w):
    """All-gather matmul: one partial product per chunk, put in sequence order."""
    return _in_sequence_order([matmul(spec, c, w) for c in chunks.arrays], chunks.positions)


def _reduce_scatter_ring(matmul, spec, x, w, axis: str, t: int, step: int, shift=_shift):
    """out_i = sum over devices of their term for chunk i; the accumulator moves `step` each step."""
    i = jax.lax.axis_index(axis)
    n = x.shape[SEQUENCE_DIM] // t

    def term(k):                          # this device's contribution to the chunk the accumulator serves
        chunk = (i - step * (1 + k)) % t
        return matmul(spec, jax.lax.dynamic_slice_in_dim(x, chunk * n, n, axis=SEQUENCE_DIM), w)

    acc = term(0)
    for k in range(1, t):
        acc = shift(acc, axis, t, step) + term(k)
    return acc


def _row(matmul, spec: str, x, w, axis: str, bidirectional: bool, shift=_shift):
    """Matmul reduce-scatter over the sequence; bidirectional: half the output features each way."""
    t = jax.lax.axis_size(axis)
    if not bidirectional:
        return _reduce_scatter_ring(matmul, spec, x, w, axis, t, +1, shift)
    half = w.shape[-1] // 2
    return jnp.concatenate([_reduce_scatter_ring(matmul, spec, x, w[..., :half], axis, t, +1, shift),
                            _reduce_scatter_ring(matmul, spec, x, w[..., half:], axis, t, -1, shift)], axis=-1)


def _matmul(base, axis: str, bidirectional: bool, shift, spec: str, x, w):
    if isinstance(x, Chunks):
        return _column(base, spec, x, w)
    lhs, out = spec.replace(" ", "").split("->")[0].split(",")[0], spec.split("->")[1].strip()
    if out == "bsd" and lhs != "bsd":                                # row-parallel: wo, w_down
        return _row(base, spec, x, w, axis, bidirectional, shift)
    return base(spec, x, w)


def _whole_for_head(cross_entropy, x, *args, **kwargs):
    return cross_entropy(x.whole() if isinstance(x, Chunks) else x, *args, **kwargs)


def _whole_collectives(sequence_ops: Ops, ops: Ops) -> Ops:
    """`ops` with SP's own all-gather, reduce-scatter and matmul back (an MoE block's feed-forward)."""
    return ops.replace(column_in=sequence_ops.column_in, row_out=sequence_ops.row_out, matmul=sequence_ops.matmul,
                       layer_ops=None)


def collective_matmul_ops(sequence_ops: Ops, axis: str, mode: str, swap: bool = False) -> Ops:
    """`sequence_ops` (megatron.sequence_parallel_ops) with its layers' gathers and reduce-scatters
    decomposed into ppermute rings beside partial matmuls; `mode` one of MODES except none. `swap`: each
    ring step an all-to-all (`_swap`, two devices only), for rings inside a pipeline stage's branch.
    An MoE model's `sequence_ops` (a `MoEOps`): its MoE blocks' feed-forward keeps SP's whole collectives
    (`moe.moe_layer_ops`: the experts' dispatch takes the gathered tokens as one array); attention, and the
    dense blocks' MLP, run the rings."""
    bidirectional, shift = mode == "bidirectional", _swap if swap else _shift
    rings = sequence_ops.replace(
        column_in=partial(gather_chunks, axis=axis, bidirectional=bidirectional, shift=shift),
        row_out=lambda x: x,
        matmul=partial(_matmul, sequence_ops.matmul, axis, bidirectional, shift),
        cross_entropy=partial(_whole_for_head, sequence_ops.cross_entropy),
    )
    if isinstance(rings, MoEOps):
        rings = rings.replace(layer_ops=partial(_whole_collectives, sequence_ops))
    return rings


def _ring_step(axis: str):
    """A remat predicate: a `_swap` over `axis` (its all-to-all; the experts' are over `expert`)."""
    def test(prim, params) -> bool:
        if prim.name == "all_to_all":
            return axis in jax.tree.leaves(params.get("axis_name"))
        jaxpr = params.get("call_jaxpr")
        return jaxpr is not None and any(test(e.primitive, e.params) for e in jaxpr.eqns)
    return test


def ring_policy(policy=None, swap_axis: str | None = None):
    """`megatron.sequence_parallel_policy` for the rings: the chunks a ppermute (with `swap_axis`, an
    all-to-all over it) brought are not saved for the backward pass but brought again there, as SP gathers
    its input again (the partial products and slices around them are kept as `policy` says)."""
    return never_saving(produced_by(("ppermute",)) if swap_axis is None else _ring_step(swap_axis), policy)

"""The dropless expert exchange over `expert`, sized three ways (`parallel.expert_exchange`).

Each device sorts its T·k assignments by destination device and sends each destination its chunk. XLA's
`all_to_all` moves fixed-size chunks, so the question is how big a chunk's buffer is:

  padded    T·min(k, E/X) rows per destination, the most one device can send another (a token's k experts are
            distinct): X·min(k, E/X)/k times the routed rows, 4x for Mixtral (E = X = 8, k = 2). A teaching
            baseline, and the overflow round of the next two.
  capacity  ceil(SLACK·T·k/X) rows per destination: the routed rows when the routing is balanced. Dropless and
            exact all the same: if any device of the `expert` group would send a chunk more rows than that
            (a pmax of the largest chunk, so every device of the group agrees), the group takes the padded
            exchange instead (`lax.cond`, the overflow round). Runs on every backend.
  ragged    `jax.lax.ragged_all_to_all` (XLA:GPU, TPU; XLA:CPU answers UNIMPLEMENTED): every chunk exactly its
            rows, received into a buffer of ceil(SLACK·T·k) rows; a device that would receive more makes the
            group take the padded exchange.
  auto      ragged where the mesh's devices are GPUs or TPUs, capacity elsewhere: chosen at trace time.

Every assignment meets the same expert with the same weights whichever round carries it, so each way gives the
single device's results. The overflow round runs inside the `expert_overflow` named scope:
`measure.hlo.collectives` counts the step as it runs without overflow. The cond that takes it is never
differentiated (`with_overflow_round`): the backward pass keeps the sized round's residuals only and recomputes the
overflow round on a step that took it. Differentiated, the cond kept the padded round's rows and hidden states in
every layer whether it ran or not (Mixtral's shape at 2 layers, 4096 tokens per device, deviceless H100: 28.8 GiB
of temp), and a copy of the expert weights (a pipeline stashed it per microbatch in flight: 11.5 GiB of the
Mixtral recipe's first stage).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.kernels import varying
from jaxpar.model.moe import grouped_swiglu, inverse_permutation
from jaxpar.parallel.expert_sizes import capacity_chunk_rows, padded_chunk_rows, ragged_buffer_rows

AXIS = "expert"
OVERFLOW_SCOPE = "expert_overflow"     # measure/hlo.py counts its collectives 0 times per step


def _local_experts(rows, row_expert, local: int, w, ops, tensor_sum):
    """Arrived rows [M, D] with their local expert ids [M] (`local`: padding) -> each through its expert [M, D]."""
    by_expert = jnp.argsort(row_expert, stable=True)                   # padding last, where ragged_dot writes 0
    sizes = jnp.bincount(row_expert, length=local)
    out = tensor_sum(grouped_swiglu(rows[by_expert], sizes, w, ops))
    return out[inverse_permutation(by_expert)]


def chunked_exchange(x, flat, w, ops, *, n: int, local: int, rows: int, tensor_sum):
    """Tokens x [T, D], their assignments' experts flat [T·k] -> each assignment's expert output [T·k, D],
    moved in X chunks of `rows` rows by two all_to_alls (the caller makes sure no chunk has more)."""
    k = flat.shape[0] // x.shape[0]
    order = jnp.argsort(flat, stable=True)                             # by expert, hence by destination device
    dest_sizes = jnp.bincount(flat // local, length=n)
    dest_start = jnp.cumsum(dest_sizes) - dest_sizes
    slot = jnp.arange(rows)
    valid = slot[None, :] < dest_sizes[:, None]                                    # [n, rows]
    sorted_at = jnp.where(valid, dest_start[:, None] + slot[None, :], 0)           # position in sorted order
    send = jnp.where(valid[..., None], x[order[sorted_at] // k], 0)                # [n, rows, D]
    send_expert = jnp.where(valid, flat[order[sorted_at]] % local, local)          # `local` marks padding
    recv = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True)                        # chunk s came from device s
    recv_expert = jax.lax.all_to_all(send_expert, AXIS, 0, 0, tiled=True).reshape(-1)
    out = _local_experts(recv.reshape(n * rows, -1), recv_expert, local, w, ops, tensor_sum)
    back = jax.lax.all_to_all(out.reshape(n, rows, -1), AXIS, 0, 0, tiled=True)   # in the layout it was sent
    rank, dest = inverse_permutation(order), flat // local
    return back[dest, rank - dest_start[dest]]


def _buffer(like, shape, fill=0):
    """A receive buffer for `ragged_all_to_all`, varying over the manual axes `like` varies over (its result
    takes the buffer's)."""
    return varying.match(like, jnp.full(shape, fill, like.dtype))[0][1]


def ragged_exchange(x, flat, w, ops, *, n: int, local: int, rows: int, tensor_sum, skip=False):
    """As `chunked_exchange`, each chunk exactly its rows (`ragged_all_to_all`), received into `rows` rows.
    `skip`: send nothing (the group takes the overflow round; more rows would not fit the buffer)."""
    k = flat.shape[0] // x.shape[0]
    order = jnp.argsort(flat, stable=True)
    dest_sizes = jnp.where(skip, 0, jnp.bincount(flat // local, length=n)).astype(jnp.int32)
    dest_start = jnp.cumsum(dest_sizes) - dest_sizes
    recv_sizes = jax.lax.all_to_all(dest_sizes, AXIS, 0, 0, tiled=True)         # rows from each source
    recv_start = jnp.cumsum(recv_sizes) - recv_sizes
    at_receiver = jax.lax.all_to_all(recv_start, AXIS, 0, 0, tiled=True)        # where my chunk lands there
    at_source = jax.lax.all_to_all(dest_start, AXIS, 0, 0, tiled=True)          # where its chunk left from
    send = partial(jax.lax.ragged_all_to_all, axis_name=AXIS)
    recv = send(x[order // k], _buffer(x, (rows, x.shape[1])), dest_start, dest_sizes, at_receiver, recv_sizes)
    recv_expert = send(flat[order] % local, _buffer(flat, (rows,), local), dest_start, dest_sizes, at_receiver,
                       recv_sizes)
    out = _local_experts(recv, recv_expert, local, w, ops, tensor_sum)
    back = send(out, _buffer(out, (flat.shape[0], x.shape[1])), recv_start, recv_sizes, at_source, dest_sizes)
    return back[inverse_permutation(order)]


def overflows(flat, *, n: int, local: int, exchange: str, rows: int):
    """Whether any device of the `expert` group would overflow the exchange's buffer (the same on all of them)."""
    dest_sizes = jnp.bincount(flat // local, length=n)
    if exchange == "ragged":
        dest_sizes = jnp.sum(jax.lax.all_to_all(dest_sizes, AXIS, 0, 0, tiled=True), keepdims=True)
    return jax.lax.pmax(jnp.max(dest_sizes), AXIS) > rows


def with_overflow_round(sized, overflow_round):
    """The exchange as a function of (over, tokens, flat, w): `overflow_round`'s result where `over`, else `sized`'s,
    written as a `custom_vjp` whose backward pass keeps the sized round's residuals and the layer's own inputs,
    nothing that came out of a `lax.cond` (see the module docstring). The sized round runs on every step; when
    the group overflows, its results are discarded and the backward pass recomputes the overflow round's."""

    def choose(over, tokens, flat, w):
        return jax.lax.cond(over, overflow_round, sized, tokens, flat, w)

    def forward(over, tokens, flat, w):
        out, pullback = jax.vjp(lambda tokens, w: sized(tokens, flat, w, skip=over), tokens, w)
        out = jax.lax.cond(over, lambda: overflow_round(tokens, flat, w), lambda: out)
        return out, (over, tokens, flat, w, pullback)

    def backward(kept, dy):
        over, tokens, flat, w, pullback = kept

        def recompute(dy):      # its backward too in the overflow scope: measure/hlo.py counts it 0 times a step
            with jax.named_scope(OVERFLOW_SCOPE):
                return jax.vjp(lambda tokens, w: overflow_round(tokens, flat, w), tokens, w)[1](dy)
        d_tokens, d_w = jax.lax.cond(over, recompute, pullback, dy)
        return None, d_tokens, None, d_w

    exchange = jax.custom_vjp(choose)
    exchange.defvjp(forward, backward)
    return exchange


def dropless_exchange(x, ids, gates, w, cfg, ops, *, n: int, tensor_sum, exchange: str):
    """One device's tokens x [B, S, D] through experts on all N devices (inside shard_map over `expert`), by
    `exchange` (padded | capacity | ragged). w: this device's E/N experts. -> (y [B, S, D], kept = all True)."""
    B, S, D = x.shape
    k = ids.shape[-1]
    T, local = B * S, cfg.experts // n
    tokens, flat = x.reshape(T, D), ids.reshape(T * k)
    common: dict[str, Any] = {"n": n, "local": local, "tensor_sum": tensor_sum}

    def padded(tokens, flat, w):
        return chunked_exchange(tokens, flat, w, ops, rows=padded_chunk_rows(T, k, local), **common)

    if exchange == "padded":
        results = padded(tokens, flat, w)
    else:
        rows = (ragged_buffer_rows if exchange == "ragged" else capacity_chunk_rows)(T, k, cfg.experts, n)

        def sized(tokens, flat, w, skip=False):
            if exchange == "ragged":
                return ragged_exchange(tokens, flat, w, ops, rows=rows, skip=skip, **common)
            return chunked_exchange(tokens, flat, w, ops, rows=rows, **common)   # a full chunk drops the rest

        def overflow_round(tokens, flat, w):
            with jax.named_scope(OVERFLOW_SCOPE):
                return padded(tokens, flat, w)

        over = overflows(flat, n=n, local=local, exchange=exchange, rows=rows)
        results = with_overflow_round(sized, overflow_round)(over, tokens, flat, w)
    y = jnp.einsum("tkd,tk->td", results.reshape(T, k, D), gates.reshape(T, k).astype(results.dtype))
    return y.reshape(B, S, D), jnp.ones(ids.shape, bool)

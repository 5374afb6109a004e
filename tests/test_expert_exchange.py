"""The dropless expert exchange (parallel/expert_exchange.py) against one device, each way of sizing it: the
padded chunks, the capacity chunks with and without the overflow round, and the ragged exchange's program
(XLA:CPU cannot compile it: it is lowered, not run). Outputs and gradients, fp32, expert=4 x data=2."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.measure.hlo import collectives
from jaxpar.model import moe
from jaxpar.model.ops import Ops
from jaxpar.parallel.expert_exchange import dropless_exchange
from jaxpar.parallel.expert_sizes import capacity_chunk_rows

E, K, D, F, B, S = 8, 2, 16, 32, 8, 8          # B sequences over data x expert = 8 devices: T = 8 tokens each
CFG = moe.MoEConfig(experts=E, top_k=K, expert_mlp_dim=F)


def inputs(skewed: bool):
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (B, S, D))
    w = {name: jax.random.normal(key, shape) / np.sqrt(shape[1]) for key, name, shape in
         zip(keys[1:], ("expert_gate", "expert_up", "expert_down"), ((E, D, F), (E, D, F), (E, F, D)))}
    if skewed:   # every token to experts 0 and 1, both on expert rank 0: its chunk gets T·k rows from everyone
        ids = jnp.broadcast_to(jnp.array([0, 1]), (B, S, K))
    else:        # each token's two experts on two different ranks, every rank's share the same: no overflow
        first = (jnp.arange(B * S) % E).reshape(B, S)
        ids = jnp.stack([first, (first + 4) % E], axis=-1)
    gates = jax.nn.softmax(jax.random.normal(keys[4], (B, S, K)), axis=-1)
    return x, ids, gates, w


def one_device(x, ids, gates, w):
    return moe.routed_experts(x, ids, gates, w, CFG, Ops())[0]


def on_mesh(x, ids, gates, w, exchange: str):
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    local = partial(dropless_exchange, cfg=CFG, ops=Ops(), n=4, tensor_sum=lambda out: out, exchange=exchange)
    tokens, experts = P(("expert", "data")), {name: P("expert") for name in w}
    return jax.shard_map(lambda *a: local(*a)[0], mesh=mesh, in_specs=(tokens, tokens, tokens, experts),
                         out_specs=tokens)(x, ids, gates, w)


def loss_and_grads(fn, x, ids, gates, w):
    value = lambda x, gates, w: jnp.sum(jnp.sin(fn(x, ids, gates, w)))      # noqa: E731
    return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2)))(x, gates, w)


@pytest.mark.parametrize("exchange, skewed", [("capacity", False), ("capacity", True)],
                         ids=["capacity", "capacity-overflow"])
def test_exchange_equals_one_device(exchange, skewed):
    x, ids, gates, w = inputs(skewed)
    T = B * S // 8
    largest = 2 * 4 * T if skewed else T * K // 4      # rows one device sends rank 0 (skewed) or any rank (even)
    assert (largest > capacity_chunk_rows(T, K, E, 4)) == skewed    # the overflow round runs exactly when skewed
    expected = loss_and_grads(one_device, x, ids, gates, w)
    got = loss_and_grads(partial(on_mesh, exchange=exchange), x, ids, gates, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_capacity_exchange_sends_capacity_chunks_unless_it_overflows():
    """The compiled program holds both rounds; the overflow round's collectives sit in its scope and count 0 runs."""
    x, ids, gates, w = inputs(False)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    text = jax.jit(partial(on_mesh, exchange="capacity")).lower(x, ids, gates, w).compile().as_text()
    T = B * S // 8
    rows = {c.shape: c.on_overflow for c in collectives(text, mesh) if c.op == "all-to-all" and "f32" in c.shape}
    capacity, padded = capacity_chunk_rows(T, K, E, 4), T * K     # 2 local experts: a chunk holds T·k at most
    assert capacity < padded
    assert rows == {f"({', '.join([f'f32[1,{capacity},{D}]'] * 4)})": False,
                    f"({', '.join([f'f32[1,{padded},{D}]'] * 4)})": True}


def ragged_all_to_all_by_all_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                    axis_name):
    """`jax.lax.ragged_all_to_all`'s documented semantics from all_gathers (slow, but XLA:CPU runs it): each
    source's slice for this device written at the offset the source gave it."""
    me = jax.lax.axis_index(axis_name)
    every = [jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes, output_offsets)]
    row = jnp.arange(output.shape[0])
    for src_rows, start, size, at in zip(*every):
        inside = (row >= at[me]) & (row < at[me] + size[me])
        taken = src_rows[jnp.clip(start[me] + row - at[me], 0, src_rows.shape[0] - 1)]
        output = jnp.where(inside.reshape(-1, *[1] * (output.ndim - 1)), taken, output)
    return output


@pytest.mark.parametrize("skewed", [False, True], ids=["ragged", "ragged-overflow"])
def test_ragged_exchange_equals_one_device_with_ragged_all_to_all_emulated(monkeypatch, skewed):
    """The ragged exchange's offsets and sizes, checked on CPU with the collective emulated (the real one runs
    on GPU and TPU only); skewed, the group overflows its buffer and takes the padded round."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", ragged_all_to_all_by_all_gather)
    x, ids, gates, w = inputs(skewed)
    expected = loss_and_grads(one_device, x, ids, gates, w)
    got = loss_and_grads(partial(on_mesh, exchange="ragged"), x, ids, gates, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_ragged_exchange_lowers_to_ragged_all_to_all_with_its_gradient():
    x, ids, gates, w = inputs(False)
    text = jax.jit(lambda x, gates, w: jax.grad(lambda *a: jnp.sum(on_mesh(*a, exchange="ragged")), (0, 2))(
        x, ids, gates, w)).lower(x, gates, w).as_text()
    assert text.count("ragged_all_to_all") == 5     # rows and ids there, rows back; the rows' two transposes


@pytest.mark.parametrize("exchange, times_formula", [("ragged", 1.0), ("capacity", 1.25), ("padded", 4.0)])
def test_predicted_bytes_follow_the_exchange(exchange, times_formula):
    """Mixtral's shape on expert=8 (E = X = 8, k = 2): per exchange the routed rows (ragged), 1.25 x them (capacity
    chunks), X·min(k, E/X)/k = 4 x them (padded), plus the int32 ids and the vote (under 0.1%)."""
    from jaxpar.config import load_config
    from jaxpar.model.counting import ModelShape
    from jaxpar.parallel.theory import Candidate, moe_all_to_all_bytes
    shape = ModelShape.from_config(load_config("configs/mixtral_8x7b.py"))
    cand = Candidate(fsdp=8, expert=8, remat="none", expert_impl="manual", expert_exchange=exchange)
    sent = moe_all_to_all_bytes(shape, cand, 256, 4096, "gpu")
    assert sent["predicted"] / sent["formula"] == pytest.approx(times_formula, rel=1e-3)


def test_memory_holds_the_buffers_the_exchange_receives():
    """An MoE step's working set has room for the padded overflow round whichever exchange runs (XLA holds both
    branches' buffers); without remat each layer keeps the rows its experts received and their SwiGLU states,
    4 x T·k rows padded, 1.25 x ragged."""
    from jaxpar.config import load_config
    from jaxpar.model.counting import ModelShape
    from jaxpar.parallel.expert_memory import EXPERT_SWIGLU_SAVED
    from jaxpar.parallel.memory import memory
    from jaxpar.parallel.theory import Candidate
    shape = ModelShape.from_config(load_config("configs/mixtral_8x7b.py"))
    got = {exchange: memory(shape, Candidate(fsdp=8, expert=8, expert_impl="manual", expert_exchange=exchange,
                                             remat="none"), 256, 4096, 80e9) for exchange in ("ragged", "padded")}
    T, k, h, f = 256 // 64 * 4096, 2, shape.d_model, shape.expert_mlp_dim
    assert got["padded"].working == got["ragged"].working
    kept = got["padded"].activations - got["ragged"].activations
    assert kept == pytest.approx(shape.layers * (4 - 1.25) * T * k * (h + EXPERT_SWIGLU_SAVED * f) * 2)


def kept_for_backward(exchange: str) -> int:
    """Bytes the exchange's vjp holds between the forward and the backward pass (its residuals), on the mesh."""
    x, ids, gates, w = inputs(False)
    forward = partial(jax.vjp, lambda x, gates, w: on_mesh(x, ids, gates, w, exchange=exchange))
    _, backward = jax.eval_shape(forward, x, gates, w)         # traced only: the residuals' shapes
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(backward))


def test_the_overflow_round_keeps_nothing_for_the_backward_pass():
    """Differentiating a `lax.cond` keeps both branches' residuals; the overflow round is rematerialized, so the
    capacity exchange keeps less than the padded one (without it: the padded residuals and its own)."""
    assert kept_for_backward("capacity") < kept_for_backward("padded")


def test_the_routed_experts_keep_gate_up_and_their_product_only():
    """`expert_gating` recomputes silu(gate)·up in the backward: a grouped SwiGLU's vjp keeps its rows, the gate and
    up outputs and their product [rows, F] (down's input), not silu's intermediates (without it: 3 more)."""
    from jaxpar.model.moe import grouped_swiglu
    from jaxpar.model.ops import make_ops
    rows, d, f, experts = 64, 16, 48, 4
    w = {name: jnp.zeros(shape, jnp.bfloat16) for name, shape in (("expert_gate", (experts, d, f)),
                                                                  ("expert_up", (experts, d, f)),
                                                                  ("expert_down", (experts, f, d)))}
    x, sizes = jnp.zeros((rows, d), jnp.bfloat16), jnp.full((experts,), rows // experts, jnp.int32)
    _, backward = jax.eval_shape(partial(jax.vjp, lambda x, w: grouped_swiglu(x, sizes, w, make_ops("bfloat16"))), x, w)
    kept = [leaf for leaf in jax.tree.leaves(backward) if leaf.shape == (rows, f)]
    assert len(kept) == 3


def weight_copies(exchange: str) -> int:
    """Residuals shaped like an expert weight that a two-layer loop's backward keeps beside the weights themselves."""
    x, ids, gates, w = inputs(False)
    stacked = {name: jnp.stack([a, a]) for name, a in w.items()}
    copies = []

    def layers(x, stacked):
        return jax.lax.scan(lambda x, w: (on_mesh(x, ids, gates, w, exchange=exchange), None), x, stacked)[0]

    def probe(x, stacked):
        _, pullback = jax.vjp(layers, x, stacked)
        stored = jax.tree.leaves(stacked)
        copies.extend(leaf for leaf in jax.tree.leaves(pullback)
                      if leaf.shape[-2:] in ((D, F), (F, D)) and not any(leaf is s for s in stored))
        return x

    jax.eval_shape(probe, x, stacked)
    return len(copies)


def test_the_overflow_round_adds_no_copy_of_the_expert_weights():
    """The capacity exchange's layer loop keeps no more copies of the expert weights than the padded one's, which
    has no overflow round. Differentiated through the round's `lax.cond`, each layer kept one more copy, the
    cond's output, which a pipeline stashes once per microbatch in flight (`with_overflow_round`). The padded
    exchange's copies are the weights made varying over `data` inside the shard_map."""
    assert weight_copies("capacity") == weight_copies("padded") == 3

"""The fused kernels against their pure-jnp references: values and gradients, in interpret mode on CPU,
and their lowering to Triton for a GPU (no GPU needed to lower)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.costs import hlo_has_kernels, kernel_flops
from jaxpar.kernels.cross_entropy import chunked_cross_entropy, cross_entropy_reference
from jaxpar.kernels.flash_attention import attention_reference, flash_attention
from jaxpar.kernels.rms_norm import rms_norm, rms_norm_reference
from jaxpar.measure.memory import compiled_memory
from jaxpar.model.ops import Ops
from jaxpar.parallel.megatron import copy_to_parallel

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def random(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def value_and_grads(fn, args, cotangent):
    """fn(*args) and the gradients of <fn(*args), cotangent> w.r.t. every argument."""
    return jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent),
                              argnums=tuple(range(len(args))))(*args), fn(*args)


# (batch, seq, heads, kv_heads, head_dim, block_q, block_k, causal, dtype): GQA, MQA, padding, both dtypes.
# The non-causal path (unused by the model) is checked in the lab's agreement table.
ATTENTION_CASES = {
    "fp32 GQA 4:2 dh64, S=40 padded to 64": (2, 40, 4, 2, 64, 16, 32, True, jnp.float32),
    "fp32 MQA 4:1, S=48, block_q > block_k": (1, 48, 4, 1, 16, 32, 16, True, jnp.float32),
    "bf16 GQA 4:2 dh128, S=64": (1, 64, 4, 2, 128, 16, 16, True, jnp.bfloat16),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_flash_attention_matches_reference(case):
    B, S, H, KV, Dh, bq, bk, causal, dtype = ATTENTION_CASES[case]
    q, k, v = random((B, S, H, Dh), dtype, 0), random((B, S, KV, Dh), dtype, 1), random((B, S, KV, Dh), dtype, 2)
    cotangent = random((B, S, H, Dh), jnp.float32, 3)
    flash = jax.jit(lambda q, k, v: value_and_grads(
        lambda *a: flash_attention(*a, causal=causal, block_q=bq, block_k=bk), (q, k, v), cotangent))
    (_, got_grads), got = flash(q, k, v)
    (_, want_grads), want = jax.jit(lambda q, k, v: value_and_grads(
        lambda *a: attention_reference(*a, causal=causal), (q, k, v), cotangent))(q, k, v)
    assert got.dtype == dtype and got.shape == q.shape
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        assert rel_error(g, w) < TOLERANCE[dtype], (name, rel_error(g, w))


def test_flash_attention_refuses_bad_blocks_and_shapes():
    q = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(ValueError, match="powers of two >= 16"):
        flash_attention(q, q, q, block_q=24)
    with pytest.raises(ValueError, match="head_dim=24"):
        flash_attention(jnp.zeros((1, 32, 2, 24)), jnp.zeros((1, 32, 2, 24)), jnp.zeros((1, 32, 2, 24)))
    with pytest.raises(ValueError, match="KV dividing H"):
        flash_attention(jnp.zeros((1, 32, 4, 16)), jnp.zeros((1, 32, 3, 16)), jnp.zeros((1, 32, 3, 16)))


@pytest.mark.parametrize("shape, dtype, block_rows",
                         [((4, 33, 48), jnp.float32, 4), ((3, 40, 256), jnp.bfloat16, None)])
def test_fused_rms_norm_matches_reference(shape, dtype, block_rows):
    """Odd row counts and a width that is not a power of two (padded), fp32 and bf16: y, dx and d(scale)."""
    x, cotangent = random(shape, dtype, 0), random(shape, jnp.float32, 1)
    scale = 1 + 0.1 * random(shape[-1:], jnp.float32, 2)
    (_, got_grads), got = jax.jit(lambda x, s: value_and_grads(
        lambda *a: rms_norm(*a, 1e-5, block_rows=block_rows), (x, s), cotangent))(x, scale)
    (_, want_grads), want = jax.jit(lambda x, s: value_and_grads(
        lambda *a: rms_norm_reference(*a, 1e-5), (x, s), cotangent))(x, scale)
    for name, g, w in zip(("y", "dx", "dscale"), (got, *got_grads), (want, *want_grads)):
        assert rel_error(g, w) < TOLERANCE[dtype], (name, rel_error(g, w))


def ce_inputs(B=2, S=37, D=16, V=64):
    x, head = random((B, S, D), jnp.float32, 0), random((D, V), jnp.float32, 1)
    return x, head, jnp.asarray(np.random.default_rng(2).integers(0, V, (B, S)), jnp.int32)


def test_chunked_cross_entropy_matches_full_logits():
    """S=37 in chunks of 8 (the last one padded): same loss, dx and d(head) as the full-logits reference."""
    x, head, targets = ce_inputs()
    want, want_grads = jax.value_and_grad(lambda x, h: cross_entropy_reference(x, h, targets, Ops()), (0, 1))(x, head)
    chunked = lambda x, h: chunked_cross_entropy(x, h, targets, Ops(), chunk=8)
    got, got_grads = jax.jit(jax.value_and_grad(chunked, (0, 1)))(x, head)
    assert rel_error(got, want) < 1e-6
    assert rel_error(jax.jit(chunked)(x, head), want) < 1e-6           # evaluation: the loss-only path
    for g, w in zip(got_grads, want_grads):
        assert rel_error(g, w) < 1e-5


def test_chunked_cross_entropy_vocab_parallel():
    """Inside shard_map over tensor=4, each device holding [D, V/4] of the head (Megatron's f before it)."""
    x, head, targets = ce_inputs()
    want, want_grads = jax.value_and_grad(lambda x, h: cross_entropy_reference(x, h, targets, Ops()), (0, 1))(x, head)
    mesh = jax.make_mesh((4,), ("tensor",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Explicit,))
    local = lambda x, h, t: chunked_cross_entropy(copy_to_parallel(x, "tensor"), h, t, Ops(), chunk=8, axis="tensor")
    step = jax.shard_map(jax.value_and_grad(local, (0, 1)), mesh=mesh, in_specs=(P(), P(None, "tensor"), P()),
                         out_specs=(P(), (P(), P(None, "tensor"))), check_vma=False)
    got, got_grads = jax.jit(step)(x, jax.device_put(head, NamedSharding(mesh, P(None, "tensor"))), targets)
    assert rel_error(got, want) < 1e-6
    for g, w in zip(got_grads, want_grads):
        assert rel_error(g, w) < 1e-5


def test_chunked_cross_entropy_saves_the_logits_memory():
    """Compiled temp bytes of loss + gradients: chunked is below full-logits by >= 50% of the [B, S, V] fp32 bytes."""
    B, S, D, V = 4, 256, 64, 8192
    x, head = jax.ShapeDtypeStruct((B, S, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32)
    targets = jax.ShapeDtypeStruct((B, S), jnp.int32)
    temp = {}
    for name, fn in (("full", lambda x, h, t: cross_entropy_reference(x, h, t, Ops())),
                     ("chunked", lambda x, h, t: chunked_cross_entropy(x, h, t, Ops(), chunk=32))):
        compiled = jax.jit(jax.value_and_grad(fn, (0, 1))).lower(x, head, targets).compile()
        temp[name] = compiled_memory(compiled, "cpu").temp
    logits_bytes = B * S * V * 4
    assert temp["full"] - temp["chunked"] >= 0.5 * logits_bytes, (temp, logits_bytes)


def test_kernel_flops_from_cost_estimates():
    """Causal, S = 4 blocks: the kernels visit 4·5/2 = 10 block pairs; forward 2 block matmuls per pair,
    dq 3, dk/dv 4; scans multiply. A custom call in GPU HLO is what makes the count necessary."""
    B, S, H, Dh, b = 2, 64, 4, 16, 16
    q = jnp.zeros((B, S, H, Dh))
    step = lambda q: jnp.sum(flash_attention(q, q[:, :, :2], q[:, :, :2], block_q=b, block_k=b))
    pair = 2 * B * H * b * b * Dh * 10
    found = kernel_flops(jax.make_jaxpr(jax.grad(step))(q))
    assert found.by_kernel == {"jaxpar_flash_forward": 2 * pair, "jaxpar_flash_backward_dq": 3 * pair,
                               "jaxpar_flash_backward_dkv": 4 * pair}
    scanned = kernel_flops(jax.make_jaxpr(lambda qs: jax.lax.scan(lambda c, q: (c + step(q), None), 0.0, qs))(
        jnp.zeros((3, B, S, H, Dh))))
    assert scanned.total == 3 * 2 * pair


def test_kernels_lower_to_triton_for_gpu():
    """The kernels as a GPU compile would see them: Pallas' Triton lowering runs on a CPU-only machine and
    rejects what Triton cannot do (non-power-of-two blocks, unsupported ops). bf16, head_dim 128."""
    q = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    scale = jax.ShapeDtypeStruct((128,), jnp.float32)

    def step(q, k, v, scale):
        out = flash_attention(q, k, v, block_q=64, block_k=64, interpret=False)
        return jnp.sum(rms_norm(out, scale, 1e-5, interpret=False).astype(jnp.float32))

    hlo = jax.jit(jax.grad(step, (0, 1, 2, 3))).trace(q, kv, kv, scale).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 5     # flash forward, dq, dkv; norm forward, backward
    assert hlo_has_kernels(hlo)

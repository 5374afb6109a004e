"""FP8 training (model/fp8.py, train.compute_dtype=float8): numerics, the compiled types, training runs.

Error bounds, measured on jax 0.10.2 CPU (relative Frobenius error vs the fp32 einsum; 3 seeds, 3 einsum specs):
- forward 0.037-0.038. e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most
  2^-4 relative, rms 2^-3/sqrt(12) * sqrt(E[1/m^2]) = 0.026 for a mantissa m uniform in [1, 2).
  Two operands: sqrt(2) * 0.026 = 0.036. Bound 0.05 (< 2^-4). bfloat16 measures 0.003,
  so an error above 0.01 also shows that the operands really were quantized.
- dx, dw 0.057-0.063: the gradient is e5m2 (2 mantissa bits, rms 0.051), the other operand
  e4m3: sqrt(0.051^2 + 0.026^2) = 0.057. Bound 0.08 (< e5m2's worst case 2^-3).
"""
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.mesh import make_mesh
from jaxpar.model.fp8 import E4M3, fp8_einsum, quantize
from jaxpar.model.ops import DTYPES, make_ops
from jaxpar.model.transformer import ModelConfig, init_params, loss
from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.zero import ZeroStrategy

VOCAB = 512
FP8 = "train.compute_dtype=float8"


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("spec, x_shape, w_shape", [
    ("bsd,dhk->bshk", (4, 32, 64), (64, 4, 16)),          # q/k/v projections
    ("bshk,hkd->bsd", (4, 32, 4, 16), (4, 16, 64)),       # the attention output projection
])
def test_fp8_einsum_forward_and_gradients_are_close_to_fp32(spec, x_shape, w_shape):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape)
    w = 0.02 * jax.random.normal(kw, w_shape)
    want, vjp = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
    g = jax.random.normal(kg, want.shape)
    want_dx, want_dw = vjp(g)
    bf16 = lambda a: a.astype(jnp.bfloat16)
    got, vjp8 = jax.vjp(lambda x, w: fp8_einsum(spec, x, w), bf16(x), bf16(w))
    dx, dw = vjp8(bf16(g))
    assert got.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert 0.01 < rel_err(got, want) < 0.05
    assert 0.01 < rel_err(dx, want_dx) < 0.08
    assert 0.01 < rel_err(dw, want_dw) < 0.08
    # the lm_head asks for fp32 logits
    assert fp8_einsum(spec, bf16(x), bf16(w), preferred_element_type=jnp.float32).dtype == jnp.float32


def test_fp8_einsum_edge_cases():
    zeros, ones = jnp.zeros((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
    assert (fp8_einsum("ij,jk->ik", zeros, ones) == 0).all()           # amax 0: no 0/0
    big = jnp.full((4, 8), 1e4, jnp.bfloat16)                           # far beyond e4m3's 448: scaled
    np.testing.assert_allclose(np.asarray(fp8_einsum("ij,jk->ik", big, ones), np.float32), 8e4, rtol=1e-2)
    with pytest.raises(ValueError, match="every index"):
        fp8_einsum("ij,jk->i", zeros, ones)                             # k summed out of w alone


def test_why_the_custom_vjp():
    """Plain autodiff through the fp8 casts rounds the gradient of each fp8 operand to fp8, unscaled:
    almost all of a small weight gradient underflows (measured: 99.9% zeros, relative error 2.7)."""
    x = jax.random.normal(jax.random.key(0), (8, 64), jnp.bfloat16)
    w = (0.02 * jax.random.normal(jax.random.key(1), (64, 16))).astype(jnp.bfloat16)

    def naive(x, w):                                      # fp8_einsum's forward, differentiated by JAX
        (x8, sx), (w8, sw) = quantize(x, E4M3), quantize(w, E4M3)
        return (jnp.einsum("ij,jk->ik", x8, w8, preferred_element_type=jnp.float32) * sx * sw).astype(x.dtype)

    grad = lambda f: np.asarray(jax.grad(lambda w: jnp.sum(f(x, w).astype(jnp.float32) ** 2))(w), np.float32)
    want = grad(lambda x, w: jnp.einsum("ij,jk->ik", x.astype(jnp.float32), w.astype(jnp.float32)))
    assert (grad(naive) == 0).mean() > 0.9
    assert rel_err(grad(lambda x, w: fp8_einsum("ij,jk->ik", x, w)), want) < 0.08


def test_fp8_einsum_under_checkpoint_keeps_gradients():
    """jax.checkpoint's reduce_precision on saved residuals would turn a saved e4m3 value of 256..448 to NaN."""
    x = jax.random.normal(jax.random.key(1), (8, 16), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (16, 16), jnp.bfloat16)
    loss = lambda w, x: jnp.sum(fp8_einsum("ij,jk->ik", x, w).astype(jnp.float32) ** 2)
    saved = jax.checkpoint(loss, policy=jax.checkpoint_policies.everything_saveable)
    want, got = jax.grad(loss)(w, x), jax.grad(saved)(w, x)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ---------------------------------------------------------------------------- in the model
# configs/test.py on 8 devices, the learnable rows of test_strategies.py / test_zero.py

def make_strategy(*overrides, manual=False):
    config = load_config("configs/test.py")
    apply_overrides(config, ["train.weight_decay=0.1", "train.warmup_steps=1", *overrides])
    cls = ZeroStrategy if manual else AutoStrategy
    return cls(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, jax.devices()))


def batches(config, steps):
    return counting_batches(config, steps, VOCAB)


def run(strategy, steps):
    state, losses, norms = strategy.init_state(), [], []
    for batch in batches(strategy.config, steps):
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms)


def test_float8_validates_and_keeps_the_state_layout():
    """Current scaling is stateless: checkpoints and every strategy's state layout stay those of fp32.
    (Building a strategy validates the config: float8 combines with every strategy and remat policy.)"""
    layout = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), t.abstract_state)
    fsdp = ("mesh.fsdp=8", "mesh.data=1")
    assert layout(make_strategy(*fsdp, FP8)) == layout(make_strategy(*fsdp))
    assert DTYPES["float8"] == jnp.float8_e4m3fn          # transformer.precision: bf16 activations, fp8 matmuls


def test_weight_matmuls_are_fp8_forward_and_backward():
    """The train step's dots: 7 weight matmuls in the layer body + lm_head, each with an e4m3 forward and two
    backward dots against the e5m2 gradient; the attention score/value einsums stay bf16 (the embedding is a
    gather, no dot)."""
    strategy = make_strategy("mesh.data=8", FP8)
    lowered = strategy.lower_step()
    operand = r"tensor<(?:[0-9]+x)*(\w+)>"
    dots = Counter(re.findall(rf"stablehlo\.dot_general .*: \({operand}, {operand}\)", lowered.as_text()))
    assert dots == {("f8E4M3FN", "f8E4M3FN"): 8, ("f8E5M2", "f8E4M3FN"): 8, ("f8E4M3FN", "f8E5M2"): 8,
                    ("bf16", "bf16"): 6}, dots  # bf16: 2 attention einsums x (1 fwd + 2 bwd)
    compiled = lowered.compile().as_text()
    assert "f8e4m3fn[" in compiled and "f8e5m2[" in compiled     # XLA kept the quantized operands


def test_gradients_reach_every_parameter_and_follow_fp32():
    """Measured on two batches, relative error vs fp32 per parameter: 0.07-0.105 for the layers' weights and
    norms, 0.03-0.04 for embed, final_norm and lm_head (bf16: <= 0.008). Each backward fp8 matmul adds ~0.06
    (the e5m2 gradient); a layer's gradient has passed through several (the head's, the later blocks'), whose
    errors add in quadrature: sqrt(3) x 0.06 ~ 0.10. Bound 0.15."""
    config = load_config("configs/test.py")
    model_cfg = ModelConfig.from_config(config.model, VOCAB)
    params = init_params(model_cfg, 0)
    tokens = jnp.asarray(batches(config, 1)[0])
    grad = jax.jit(jax.grad(lambda p, t, ops: loss(p, t, model_cfg, ops)[0]), static_argnums=2)
    want = grad(params, tokens, make_ops("float32"))
    got = grad(params, tokens, make_ops("float8"))
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        name = jax.tree_util.keystr(path[0])
        assert g.dtype == jnp.float32 and np.isfinite(g).all() and np.abs(g).max() > 0, name
        assert rel_err(g, w) < 0.15, (name, rel_err(g, w))


def test_fp8_training_tracks_fp32():
    """30 steps on 8 devices (data=8). Measured: max deviation from fp32 1.2%, final 0.4% (bf16: 0.16%, 0.0%)."""
    want, _ = run(make_strategy("mesh.data=8", "train.steps=30"), 30)
    losses, _ = run(make_strategy("mesh.data=8", "train.steps=30", FP8), 30)
    assert losses[-1] < 0.5 * losses[0]
    deviation = np.abs(losses / want - 1)
    assert deviation.max() < 0.03, deviation
    assert deviation[-1] < 0.02, deviation


def test_manual_zero3_trains_in_fp8():
    """ZeRO-3 gathers bf16 weights and quantizes after the gather; each device scales its own batch shard,
    so it is close to (not equal to) the automatic run. Measured: losses within 0.07%, grad norms 0.9%."""
    auto, auto_norms = run(make_strategy("mesh.data=8", FP8), 5)
    manual, manual_norms = run(make_strategy("mesh.data=8", "parallel.data=zero3", FP8,
                                            manual=True), 5)
    np.testing.assert_allclose(manual, auto, rtol=5e-3)
    np.testing.assert_allclose(manual_norms, auto_norms, rtol=3e-2)

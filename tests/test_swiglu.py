"""The dense SwiGLU (model/transformer.py's `mlp`, also the shared experts) keeps gate, up and their product for
its backward: `gated_silu` (model/swiglu.py) recomputes silu rather than keeping its intermediates."""
import jax
import jax.numpy as jnp

from jaxpar.model.ops import make_ops
from jaxpar.model.swiglu import gated_silu
from jaxpar.model.transformer import mlp


def test_the_dense_swiglu_keeps_gate_up_and_their_product_only():
    """A dense SwiGLU's vjp keeps three [batch, seq, F] residuals (gate, up, down's input), not silu's
    intermediates too (autodiff through silu(gate)·up: six)."""
    b, s, d, f = 2, 8, 16, 48
    w = {name: jnp.zeros(shape, jnp.bfloat16) for name, shape in (("w_gate", (d, f)), ("w_up", (d, f)),
                                                                  ("w_down", (f, d)))}
    x = jnp.zeros((b, s, d), jnp.bfloat16)
    _, backward = jax.eval_shape(lambda x, w: jax.vjp(lambda x, w: mlp(x, w, make_ops("bfloat16")), x, w), x, w)
    kept = [leaf for leaf in jax.tree.leaves(backward) if leaf.shape == (b, s, f)]
    assert len(kept) == 3


def test_gated_silu_gradients_match_autodiff():
    """The written-out backward is silu(gate)·up's derivative (fp32, against autodiff of the plain expression)."""
    gate, up = jax.random.normal(jax.random.key(0), (2, 5, 7)), jax.random.normal(jax.random.key(1), (2, 5, 7))
    dy = jax.random.normal(jax.random.key(2), (2, 5, 7))
    mine = jax.vjp(gated_silu, gate, up)[1](dy)
    plain = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)[1](dy)
    for a, b in zip(mine, plain):
        assert jnp.allclose(a, b, rtol=1e-6, atol=1e-6)

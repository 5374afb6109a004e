"""Collective matmul (parallel/collective_matmul.py): the ppermute rings give the all-gather / reduce-scatter
matmuls exactly, forward and backward, and the manual TP+SP strategy with them reproduces one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from synthetic import counting_batches

from jaxpar.config import ConfigError, apply_overrides, load_config, validate
from jaxpar.measure.hlo import collectives
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig, loss
from jaxpar.parallel import collective_matmul as cm
from jaxpar.parallel.registry import make_strategy
from jaxpar.parallel.tensor import TensorStrategy

T = 4
VOCAB = 512
BASE = ["model.kv_heads=4", "train.warmup_steps=1", "train.grad_clip=0.05"]


def _rings(mode):
    """shard_map over 4 devices: gather-matmul and matmul-reduce-scatter by the rings, and by the collectives."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:T]), ("tensor",))
    bidirectional = mode == "bidirectional"

    def ring(x, w_col, y, w_row):
        col = cm._column(jnp.einsum, "bsd,df->bsf", cm.gather_chunks(x, "tensor", bidirectional), w_col)
        return col, cm._row(jnp.einsum, "bsf,fd->bsd", y, w_row, "tensor", bidirectional)

    def plain(x, w_col, y, w_row):
        col = jnp.einsum("bsd,df->bsf", jax.lax.all_gather(x, "tensor", axis=1, tiled=True), w_col)
        return col, jax.lax.psum_scatter(jnp.einsum("bsf,fd->bsd", y, w_row), "tensor", scatter_dimension=1,
                                         tiled=True)

    specs = {"mesh": mesh, "in_specs": (P(None, "tensor"), P(None, "tensor"), P(None, None, "tensor"),
                                      P("tensor", None)),
                 "out_specs": (P(None, None, "tensor"), P(None, "tensor")), "check_vma": False}
    return [jax.jit(jax.shard_map(f, **specs)) for f in (ring, plain)]


@pytest.mark.parametrize("mode", ["collective_matmul", "bidirectional"])
def test_rings_equal_the_collectives_forward_and_backward(mode):
    keys = jax.random.split(jax.random.key(0), 4)
    x, w_col = jax.random.normal(keys[0], (2, 8, 6)), jax.random.normal(keys[1], (6, 12))
    y, w_row = jax.random.normal(keys[2], (2, 8, 12)), jax.random.normal(keys[3], (12, 6))
    ring, plain = _rings(mode)
    for got, want in zip(ring(x, w_col, y, w_row), plain(x, w_col, y, w_row)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    objective = lambda f: lambda *a: sum(jnp.sum(jnp.sin(o)) for o in f(*a))
    got = jax.grad(objective(ring), argnums=(0, 1, 2, 3))(x, w_col, y, w_row)
    want = jax.grad(objective(plain), argnums=(0, 1, 2, 3))(x, w_col, y, w_row)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    text = ring.lower(x, w_col, y, w_row).compile().as_text()
    ops = {c.op for c in collectives(text)}
    assert ops == {"collective-permute"}, ops                       # no all-gather / reduce-scatter left


def _config(overrides):
    config = load_config("configs/test.py")
    apply_overrides(config, BASE + overrides)
    return config


def _run(strategy, steps=3):
    state, losses = strategy.init_state(), []
    with jax.set_mesh(strategy.mesh):
        step = strategy.lower_step().compile()
        for batch in counting_batches(strategy.config, steps, VOCAB):
            state, metrics = step(state, jax.device_put(batch, strategy.batch_sharding))
            losses.append(float(metrics["loss"]))
    return np.array(losses), step


@pytest.fixture(scope="module")
def oracle():
    config = _config(["mesh.data=1"])
    strategy = make_strategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, jax.devices()[:1]))
    params = strategy.init_state()["params"]
    batch = counting_batches(config, 1, VOCAB)[0]
    grads = jax.jit(jax.grad(lambda p, x: loss(p, x, strategy.model_cfg, strategy.ops)[0]))(params, batch)
    return _run(strategy)[0], grads


@pytest.mark.parametrize("mode", ["bidirectional"])   # both rings' directions; the one-way ring: unit test above
def test_strategy_with_rings_matches_one_device(mode, oracle):
    config = _config(["mesh.data=2", f"mesh.tensor={T}", "parallel.tensor=manual", "parallel.sequence=true",
                      f"parallel.tensor_overlap={mode}"])
    strategy = TensorStrategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, jax.devices()))
    losses, step = _run(strategy)
    np.testing.assert_allclose(losses, oracle[0], rtol=1e-4)
    params = strategy.init_state()["params"]
    with jax.set_mesh(strategy.mesh):
        _, grads = strategy.grad_fn(params, jax.device_put(counting_batches(config, 1, VOCAB)[0],
                                                           strategy.batch_sharding))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(oracle[1])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
    layers = [c for c in collectives(step.as_text(), strategy.mesh) if c.runs_per_step == strategy.model_cfg.layers]
    assert layers and {c.op for c in layers} == {"collective-permute"}    # the layers' SP collectives are rings


@pytest.mark.parametrize("overrides, words", [
    (["parallel.tensor_overlap=sideways"], "valid: none, collective_matmul, bidirectional"),
    (["mesh.tensor=4", "parallel.tensor=manual", "parallel.tensor_overlap=collective_matmul"],
     "parallel.sequence=true"),
])
def test_bad_tensor_overlap_is_one_line(overrides, words):
    with pytest.raises(ConfigError, match="parallel.tensor_overlap") as err:
        validate(_config(["mesh.data=-1", *overrides]), 8)
    assert words in str(err.value) and "\n" not in str(err.value)

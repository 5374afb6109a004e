"""The model's pieces compose into every placement: shard-local heads, vocab-parallel embedding and
cross-entropy under a shard_map over `tensor`, auxiliary outputs flowing into the metrics."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.mesh import make_mesh
from jaxpar.model import transformer
from jaxpar.model.ops import Ops
from jaxpar.model.transformer import ModelConfig, init_params, loss
from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.megatron import tensor_parallel_ops
from jaxpar.parallel.rules import AxisRules

VOCAB = 512


def model_and_batch(*overrides):
    config = load_config("configs/test.py")
    apply_overrides(config, ["model.kv_heads=4", *overrides])
    cfg = ModelConfig.from_config(config.model, VOCAB)
    return config, cfg, init_params(cfg, 0), jnp.asarray(counting_batches(config, 1, VOCAB)[0])


@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel_shard_map_matches_one_device(tied):
    """The unchanged model inside shard_map over tensor=4: each device holds 1/4 of the heads, the MLP and
    the vocabulary; Megatron's f/g, the vocab-parallel embedding and cross-entropy come in through Ops."""
    _, cfg, params, tokens = model_and_batch(f"model.tie_embeddings={tied}")
    objective = lambda p, t, ops: loss(p, t, cfg, ops)[0]
    want_loss, want_grads = jax.value_and_grad(objective)(params, tokens, Ops())

    mesh = jax.make_mesh((4,), ("tensor",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    specs = AxisRules().tree_specs(cfg.param_axes(), ("tensor",))
    assert specs["blocks"]["wq"] == P(None, None, "tensor", None) and specs["embed"] == P("tensor", None)
    tp = tensor_parallel_ops(Ops())
    step = jax.shard_map(jax.value_and_grad(partial(objective, ops=tp)), mesh=mesh, in_specs=(specs, P()),
                         out_specs=(P(), specs), check_vma=False)
    sharded = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    got_loss, got_grads = jax.jit(step)(sharded, jax.device_put(tokens, NamedSharding(mesh, P())))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for path, got, want in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(got_grads),
                               jax.tree.leaves(want_grads)):
        name = jax.tree_util.keystr(path[0])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7, err_msg=name)


def test_attention_reads_head_counts_from_shapes():
    """A device's local slice of q/k/v (4 of 8 heads, 2 of 4 kv heads) gives that slice of the full output."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 8, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(2))
    full = Ops().attention(q, k, v)
    half = Ops().attention(q[:, :, 4:], k[:, :, 2:], v[:, :, 2:])
    np.testing.assert_allclose(np.asarray(half), np.asarray(full[:, :, 4:]), rtol=1e-5, atol=1e-6)


def test_aux_outputs_reach_the_loss_and_the_metrics(monkeypatch):
    """A block that reports an auxiliary loss and a statistic: the loss adds the first (summed over layers),
    the train step's metrics carry both without the strategy naming them."""
    real_block = transformer.block

    def block_with_aux(x, w, cfg, ops):
        x, _ = real_block(x, w, cfg, ops)
        return x, {"probe_loss": 0.25 * jnp.mean(w["attn_norm"]), "probe_stat": jnp.ones(3)}

    config, cfg, params, tokens = model_and_batch("mesh.data=8")
    plain_total, plain = loss(params, tokens, cfg)
    monkeypatch.setattr(transformer, "block", block_with_aux)
    total, metrics = loss(params, tokens, cfg)
    assert float(total) == pytest.approx(float(plain_total) + 0.25 * cfg.layers, rel=1e-6)
    assert float(metrics["ce_loss"]) == pytest.approx(float(plain["loss"]), rel=1e-6)
    strategy = AutoStrategy(config, cfg, make_mesh(config, jax.devices()))
    _, step_metrics = strategy.step(strategy.init_state(), jax.device_put(tokens, strategy.batch_sharding))
    assert set(step_metrics) == {"loss", "ce_loss", "probe_loss", "probe_stat", "grad_norm"}
    assert step_metrics["probe_stat"].shape == (cfg.layers, 3)


def test_manual_tensor_parallelism_keeps_the_chunked_loss():
    """model.loss=chunked under manual TP: the chunked kernel, told the vocabulary axis (not the full-logits loss)."""
    from jaxpar.kernels.cross_entropy import chunked_cross_entropy
    from jaxpar.parallel.megatron import sequence_parallel_ops, vocab_parallel_cross_entropy
    chunked = Ops().replace(cross_entropy=partial(chunked_cross_entropy, chunk=16))
    for build in (tensor_parallel_ops, sequence_parallel_ops):
        loss_op = build(chunked).cross_entropy
        assert loss_op.func is chunked_cross_entropy and loss_op.keywords == {"chunk": 16, "axis": "tensor"}
        assert build(Ops()).cross_entropy.func is vocab_parallel_cross_entropy

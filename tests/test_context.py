"""Context parallelism (parallel/context.py): one-device losses, gradients and weights; the bytes it predicts.

A small matrix on configs/test.py (2 steps, one compile per configuration): ring and all_to_all over 8 devices
with fsdp and tensor. Over 4 devices alone they are lab 03's part e, whose quick run CI checks end to end
(tests/test_journeys.py, tests/lab_results.py's `tensor`: both match one device within 1e-5 and send the predicted
bytes); its full size is the larger matrix (growing lengths).
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from synthetic import build_strategy_for, counting_batches

from jaxpar.config import ConfigError, apply_overrides, load_config, validate
from jaxpar.measure.hlo import collectives
from jaxpar.model.ops import dot_attention
from jaxpar.parallel.context import flash_block
from jaxpar.parallel.context_attention import ring_attention, zigzag_order
from jaxpar.parallel.registry import predicted_collective_bytes

VOCAB = 512
STEPS = 2
BASE = ["mesh.data=1", "model.kv_heads=4"]   # all_to_all gives each device whole KV heads: 4 = context x tensor


def run(strategy, compiled=None):
    """Losses and gradient norms of STEPS steps, through `compiled` (the AOT-compiled step) when given."""
    step = compiled or strategy.step_fn
    state = strategy.init_state()
    losses, norms = [], []
    with jax.set_mesh(strategy.mesh):
        for batch in counting_batches(strategy.config, STEPS, VOCAB):
            state, metrics = step(state, jax.device_put(batch, strategy.batch_sharding))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms)


@pytest.fixture(scope="module")
def oracle():
    return run(build_strategy_for(BASE, [], 1, VOCAB))


MATRIX = {   # name -> (overrides, devices)
    "ring-2-fsdp-tensor": (["parallel.context=ring", "mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2"], 8),
    "all_to_all-2-fsdp-tensor": (["parallel.context=all_to_all", "mesh.context=2", "mesh.fsdp=2",
                                  "mesh.tensor=2"], 8),
}
_RUNS: dict = {}


def measured(name):
    """One compile per configuration: (losses, gradient norms, context-axis bytes measured, predicted, kinds)."""
    if name not in _RUNS:
        overrides, devices = MATRIX[name]
        strategy = build_strategy_for(BASE, overrides, devices, VOCAB)
        with jax.set_mesh(strategy.mesh):
            compiled = strategy.lower_step().compile()
        found = [c for c in collectives(compiled.as_text(), strategy.mesh) if c.axes == ("context",)]
        predicted = predicted_collective_bytes(strategy.config, strategy.model_cfg, dict(strategy.mesh.shape),
                                               "cpu")["context"]
        _RUNS[name] = (*run(strategy, compiled), sum(c.bytes_per_step for c in found), predicted,
                       {c.op for c in found})
    return _RUNS[name]


@pytest.mark.parametrize("name", list(MATRIX))
def test_context_parallel_reproduces_one_device(name, oracle):
    """Losses (the second step's follows the first step's gradients) and gradient norms as on one device."""
    losses, norms, *_ = measured(name)
    np.testing.assert_allclose(losses, oracle[0], rtol=1e-5)
    np.testing.assert_allclose(norms, oracle[1], rtol=1e-5)


@pytest.mark.parametrize("name", ["ring-2-fsdp-tensor"])
def test_context_bytes_follow_the_prediction(name):
    """The compiled step's collectives on the context axis (ring hops or all_to_alls, and the gradient
    all-reduce) carry the bytes `parallel/context_predict.py` predicts, within 1%."""
    *_, bytes_measured, predicted, kinds = measured(name)
    assert ("collective-permute" if name.startswith("ring") else "all-to-all") in kinds, kinds
    assert bytes_measured == pytest.approx(predicted, rel=0.01)


def test_zigzag_order_gives_device_i_chunks_i_and_its_mirror():
    order = zigzag_order(16, 4)          # 8 chunks of 2 tokens
    chunks = order.reshape(4, 2, 2)[:, :, 0] // 2
    assert chunks.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("overrides, field", [
    (["parallel.context=spiral"], "parallel.context"),
    (["mesh.context=2"], "parallel.context"),
    (["mesh.context=4", "parallel.context=ring", "data.seq_len=36"], "data.seq_len"),
    (["mesh.context=8", "parallel.context=all_to_all"], "model.heads"),
])
def test_bad_context_settings_are_refused_in_one_line(overrides, field):
    config = load_config("configs/test.py")
    apply_overrides(config, ["mesh.data=-1", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(config, 8)
    assert err.value.field == field and "\n" not in str(err.value)


def test_ring_attention_with_the_pallas_kernel_and_its_gradients_match_one_device():
    """The ring alone (2 devices, GQA) with the Pallas flash kernel (interpreted) per chunk pair, returning its
    log-sum-exp and taking that statistic's cotangent: outputs and q/k/v gradients as one device's causal
    attention. (The jnp chunk pair's ring is checked through whole training steps above.)"""
    c, seq = 2, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, seq, 4, 16))
    k, v = (jax.random.normal(key, (2, seq, 2, 16)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], q.shape)
    order = zigzag_order(seq, c)
    block = flash_block(block_q=16, block_k=16, interpret=True)
    mesh = Mesh(np.array(jax.devices()[:c]), ("context",))
    ring = jax.shard_map(partial(ring_attention, axis="context", block=block), mesh=mesh,
                         in_specs=P(None, "context"), out_specs=P(None, "context"), check_vma=False)

    def split(q, k, v):      # the ring sees the zigzag order; its output is put back into the natural order
        out = ring(q[:, order], k[:, order], v[:, order])
        return jnp.zeros_like(out).at[:, order].set(out)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weights)

    want = jax.jit(jax.value_and_grad(loss(dot_attention), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.value_and_grad(loss(split), argnums=(0, 1, 2)))(q, k, v)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5), got, want)


def test_planner_offers_context_sizes_for_long_sequences_only():
    from jaxpar.model.counting import ModelShape
    from jaxpar.plan.space import context_choices, enumerate_candidates

    assert context_choices(64, 131072) == [1, 2, 4, 8, 16, 32]
    assert context_choices(64, 4096) == [1]
    config = load_config("arabic_7b_long")
    shape = ModelShape.from_config(config)
    long = [c for c in enumerate_candidates(shape, 64, 8, remats=("full",), precisions=("bfloat16",),
                                            attentions=("flash",), seq_len=131072) if c.context > 1]
    assert long and all(c.pipe == c.expert == 1 and c.context_impl == "ring" and c.devices == 64 for c in long)


def test_activation_memory_is_split_over_context():
    """Kept activations and the layer's working set per device follow the S/c rows a device holds."""
    import dataclasses

    from jaxpar.model.counting import ModelShape
    from jaxpar.parallel.memory import memory
    from jaxpar.parallel.theory import Candidate

    shape = ModelShape.from_config(load_config("arabic_7b_long"))
    one = Candidate(fsdp=8, attention="flash", remat="full")
    split = dataclasses.replace(one, context=8, context_impl="ring")
    whole, parts = (memory(shape, c, 8, 131072, 80e9) for c in (one, split))
    assert parts.activations == pytest.approx(whole.activations / 8)
    assert parts.working < whole.working

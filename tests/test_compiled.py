"""Features checked in the compiled program, so that a feature switched off turns a test red:
remat policies shrink temp memory, bfloat16 computes its matmuls in bfloat16, tensor-parallel bytes
follow the Megatron prediction, and the embedding costs no matmul FLOPs."""
import re
from collections import Counter

import jax
import pytest

from jaxpar.config import apply_overrides, load_config
from jaxpar.measure.flops import compiled_flops, model_flops_per_step
from jaxpar.measure.hlo import collectives
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.registry import make_strategy, predicted_collective_bytes

VOCAB = 512


def build(*overrides, devices=None):
    config = load_config("configs/test.py")
    apply_overrides(config, [f"model.vocab_size={VOCAB}", *overrides])
    mesh = make_mesh(config, devices or jax.devices())
    return make_strategy(config, ModelConfig.from_config(config.model), mesh)


def compile_step(strategy):
    with jax.set_mesh(strategy.mesh):
        return strategy.lower_step().compile()


@pytest.fixture(scope="module")
def temp_by_policy():
    one = jax.devices()[:1]
    return {policy: compile_step(build("mesh.data=1", f"train.remat={policy}", devices=one)
                                 ).memory_analysis().temp_size_in_bytes
            for policy in ("none", "full", "dots", "names")}


@pytest.mark.parametrize("policy", ["full", "dots", "names"])
def test_each_remat_policy_lowers_temp_memory(policy, temp_by_policy):
    assert temp_by_policy[policy] < 0.9 * temp_by_policy["none"], temp_by_policy


@pytest.mark.parametrize("dtype, operand", [("bfloat16", "bf16"), ("float32", "f32")])
def test_compute_dtype_reaches_every_matmul(dtype, operand):
    """Every dot_general of the step (forward and backward) multiplies operands of the compute dtype."""
    text = build("mesh.data=8", f"train.compute_dtype={dtype}").lower_step().as_text()
    kinds = Counter(re.findall(r"stablehlo\.dot_general .*: \(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)", text))
    assert set(kinds) == {(operand, operand)}, kinds
    assert sum(kinds.values()) == 3 * (7 + 2) + 3      # per layer: 7 weight + 2 attention matmuls, each fwd + 2 bwd;
                                                       # the head's 3 (the layer body is traced once in the scan)


def test_tensor_parallel_bytes_follow_megatron():
    """tensor=4 x data=2: per layer 2 all-reduces of b·s·h forward and 2 backward (the q/k/v and gate/up inputs
    held once per tensor shard: parallel/auto.py's `Copies`), + the embedding's and the head's."""
    strategy = build("mesh.data=2", "mesh.tensor=4", "model.kv_heads=4")
    found = collectives(compile_step(strategy).as_text(), strategy.mesh)
    tensor = sum(c.bytes_per_step for c in found if c.axes == ("tensor",))
    predicted = predicted_collective_bytes(strategy.config, strategy.model_cfg, dict(strategy.mesh.shape), "cpu")
    assert tensor == pytest.approx(predicted["tensor"], rel=0.01)


def test_compiled_flops_are_the_model_flops():
    """No one-hot embedding matmul: with remat none, compiled FLOPs are the model's 6Ψ + attention, plus
    the elementwise work (a few % on this small model)."""
    strategy = build("mesh.data=1", devices=jax.devices()[:1])
    flops = compiled_flops(compile_step(strategy))["corrected"]
    model = model_flops_per_step(strategy.model_cfg, strategy.config.train.batch_size, strategy.config.data.seq_len)
    assert 1.0 < flops / model < 1.1, flops / model

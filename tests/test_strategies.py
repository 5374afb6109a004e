"""Every automatic strategy reproduces the single-device run, and shards what it says it shards."""
import jax
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.auto import AutoStrategy

STEPS = 5
VOCAB = 512
MESHES = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "tensor=4,data=2": ["mesh.data=2", "mesh.tensor=4", "model.kv_heads=4"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}


def make_strategy(overrides, devices):
    config = load_config("configs/test.py")
    apply_overrides(config, ["train.weight_decay=0.1", "train.warmup_steps=1"] + overrides)
    return AutoStrategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, devices))


def batches(strategy):
    return counting_batches(strategy.config, STEPS, VOCAB)


def run(strategy):
    state = strategy.init_state()
    losses = []
    for batch in batches(strategy):
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def single_device_losses():
    losses, _ = run(make_strategy(["mesh.data=1"], jax.devices()[:1]))
    assert losses[-1] < losses[0]  # the oracle itself learns
    return losses


@pytest.mark.parametrize("name", MESHES)
def test_strategy_matches_single_device(name, single_device_losses):
    overrides = MESHES[name]
    if "model.kv_heads=4" in overrides:  # the oracle must be the same model: rerun it with 4 kv heads
        oracle, _ = run(make_strategy(["mesh.data=1", "model.kv_heads=4"], jax.devices()[:1]))
    else:
        oracle = single_device_losses
    losses, state = run(make_strategy(overrides, jax.devices()))
    np.testing.assert_allclose(losses, oracle, rtol=1e-4)
    assert int(state["step"]) == STEPS


def shard_fraction(array):
    """Fraction of the array's elements held by one device."""
    return array.addressable_shards[0].data.size / array.size


def test_fsdp_shards_params_and_adam_state_eightfold():
    strategy = make_strategy(MESHES["fsdp=8"], jax.devices())
    state = strategy.init_state()
    params = state["params"]
    adam = state["opt_state"][1][0]
    axes = strategy.model_cfg.param_axes()
    for (path, leaf), names in zip(jax.tree_util.tree_leaves_with_path(params),
                                   jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        expected = 1 / 8 if "embed" in names else 1.0  # every matrix has an `embed` axis; norm scales replicate
        assert shard_fraction(leaf) == expected, jax.tree_util.keystr(path)
    for tree in (adam.mu, adam.nu):
        for leaf, param in zip(jax.tree.leaves(tree), jax.tree.leaves(params)):
            assert leaf.sharding == param.sharding
    assert shard_fraction(params["blocks"]["wq"]) == 1 / 8
    # the spec names every rule's axis; `tensor` has size 1 on this mesh, so only `fsdp` splits
    assert params["blocks"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)


def test_data_parallel_replicates_params():
    state = make_strategy(MESHES["data=8"], jax.devices()).init_state()
    assert all(shard_fraction(leaf) == 1.0 for leaf in jax.tree.leaves(state["params"]))


def test_tensor_parallel_splits_heads_and_mlp():
    state = make_strategy(MESHES["tensor=4,data=2"], jax.devices()).init_state()
    blocks = state["params"]["blocks"]
    P = jax.sharding.PartitionSpec
    assert blocks["wq"].sharding.spec == P(None, "fsdp", "tensor", None)      # column parallel (heads)
    assert blocks["wo"].sharding.spec == P(None, "tensor", None, "fsdp")      # row parallel
    assert blocks["w_up"].sharding.spec == P(None, "fsdp", "tensor")
    assert blocks["w_down"].sharding.spec == P(None, "tensor", "fsdp")
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert shard_fraction(blocks[name]) == 1 / 4, name
    assert shard_fraction(state["params"]["embed"]) == 1 / 4                 # vocab-parallel embedding


def test_microbatching_matches_full_batch():
    full, _ = run(make_strategy(["mesh.data=8"], jax.devices()))
    accumulated, _ = run(make_strategy(["mesh.data=8", "train.microbatches=2"], jax.devices()))
    np.testing.assert_allclose(accumulated, full, rtol=1e-4)


@pytest.mark.parametrize("policy", ["full", "dots", "names"])
def test_remat_policies_keep_losses(policy, single_device_losses):
    losses, _ = run(make_strategy(["mesh.data=1", f"train.remat={policy}"], jax.devices()[:1]))
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5)


def test_bf16_compute_tracks_fp32(single_device_losses):
    losses, state = run(make_strategy(["mesh.data=1", "train.compute_dtype=bfloat16"], jax.devices()[:1]))
    assert state["params"]["embed"].dtype == np.float32       # fp32 master weights
    np.testing.assert_allclose(losses, single_device_losses, rtol=2e-2)


# ---------------------------------------------------------------------------- parallel.rules

def test_rules_override_reaches_the_parameter_shardings(single_device_losses):
    """embed=fsdp+data: FSDP over both axes (HSDP's opposite: one 8-way split), same losses."""
    strategy = make_strategy(["mesh.data=2", "mesh.fsdp=4", "parallel.rules=embed=fsdp+data"], jax.devices())
    losses, state = run(strategy)
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-4)
    assert state["params"]["blocks"]["wq"].sharding.spec[1] == ("fsdp", "data")
    assert shard_fraction(state["params"]["blocks"]["wq"]) == 1 / 8


def test_rules_override_reaches_the_activation_constraints(single_device_losses):
    """length=tensor: the residual stream is split along the sequence (sequence parallelism by rules), so
    the compiled step all-gathers activations over `tensor` before the column-parallel matmuls."""
    from collections import Counter

    from jaxpar.measure.hlo import collectives

    def tensor_ops(rules):
        strategy = make_strategy(["mesh.data=4", "mesh.tensor=2", f"parallel.rules={rules}"], jax.devices())
        with jax.set_mesh(strategy.mesh):
            found = collectives(strategy.lower_step().compile().as_text(), strategy.mesh)
        return strategy, Counter(c.op for c in found if c.axes == ("tensor",))

    _, plain = tensor_ops("")
    strategy, sequence = tensor_ops("length=tensor")
    assert plain["all-gather"] == 0 and sequence["all-gather"] > 0, (plain, sequence)
    losses, _ = run(strategy)
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-4)

"""Expert parallelism reproduces the single-device MoE run (fp32, 5 steps, rtol 1e-4), and the manual
all_to_alls move the bytes the formula says.

"The same grouping" for the capacity dispatch: capacity is counted per group of
`model.moe.group_sequences` consecutive sequences of a device's batch shard (config validation
refuses groups that would straddle devices), so one device and eight devices cut the batch into
the same groups and drop the same assignments.
"""
import jax
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.dryrun import moe_all_to_all_bytes
from jaxpar.measure.hlo import collectives
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.registry import make_trainer

STEPS, VOCAB, TOLERANCE = 5, 512, 1e-4
BASE = ["train.warmup_steps=1", "model.moe.experts=8", "model.moe.top_k=2"]
CAPACITY = ["model.moe.dispatch=capacity", "model.moe.capacity_factor=1.0"]
MANUAL = "parallel.expert=manual"


def build(overrides, devices):
    """A trainer and its step compiled once (run and inspected)."""
    config = load_config("configs/test.py")
    apply_overrides(config, BASE + overrides)
    mesh = make_mesh(config, devices)
    trainer = make_trainer(config, ModelConfig.from_config(config.model, VOCAB), mesh)
    with jax.set_mesh(mesh):
        compiled = trainer.lower_step().compile()
    return trainer, compiled


def run(trainer, compiled):
    """Losses and dropped fractions of STEPS steps over the shared synthetic batches."""
    state, losses, dropped = trainer.init_state(), [], []
    with jax.set_mesh(trainer.mesh):
        for batch in counting_batches(trainer.config, STEPS, VOCAB):
            state, metrics = compiled(state, jax.device_put(batch, trainer.batch_sharding))
            losses.append(float(metrics["loss"]))
            dropped.append(np.asarray(metrics["moe_dropped"]))
    return np.array(losses), np.array(dropped)


_oracles = {}


def single_device(extra):
    key = tuple(extra)
    if key not in _oracles:
        _oracles[key] = run(*build(["mesh.data=1", *extra], jax.devices()[:1]))
        assert _oracles[key][0][-1] < _oracles[key][0][0]          # the oracle itself learns
    return _oracles[key]


def a2a_bytes(trainer, compiled) -> float:
    return sum(c.bytes_per_step for c in collectives(compiled.as_text(), trainer.mesh) if c.op == "all-to-all")


@pytest.mark.parametrize("mesh", [
    ["mesh.data=1", "mesh.expert=8"],
    ["mesh.data=2", "mesh.expert=4"],
    ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],   # EP x FSDP x TP inside each expert
])
def test_dropless_manual_expert_parallel_matches_single_device(mesh):
    want, _ = single_device([])
    trainer, compiled = build([*mesh, MANUAL], jax.devices())
    got, dropped = run(trainer, compiled)
    np.testing.assert_allclose(got, want, rtol=TOLERANCE)
    assert np.all(dropped == 0)
    # the token exchange is the padded all_to_all of parallel/expert.py, exactly as predicted
    sizes = {name: int(size) for name, size in trainer.mesh.shape.items()}
    predicted = moe_all_to_all_bytes(trainer.config, trainer.model_cfg, sizes, "cpu")["predicted"]
    assert a2a_bytes(trainer, compiled) == pytest.approx(predicted, rel=1e-6)


def test_capacity_manual_expert_parallel_drops_what_one_device_drops():
    want, want_dropped = single_device(CAPACITY)
    trainer, compiled = build(["mesh.data=1", "mesh.expert=8", MANUAL, *CAPACITY], jax.devices())
    got, dropped = run(trainer, compiled)
    np.testing.assert_allclose(got, want, rtol=TOLERANCE)
    assert want_dropped.sum() > 0                                        # capacity factor 1.0 does drop
    np.testing.assert_allclose(dropped, want_dropped, atol=1e-7)         # ... the same assignments
    # all_to_all bytes against the course's 2·tokens·k·h·bytes per direction (capacity factor 1: equal)
    sizes = {name: int(size) for name, size in trainer.mesh.shape.items()}
    formula = moe_all_to_all_bytes(trainer.config, trainer.model_cfg, sizes, "cpu")["formula"]
    assert a2a_bytes(trainer, compiled) == pytest.approx(formula, rel=0.05)


def test_automatic_expert_parallel_matches_single_device():
    want, _ = single_device(CAPACITY)
    trainer, compiled = build(["mesh.data=1", "mesh.expert=8", *CAPACITY], jax.devices())
    np.testing.assert_allclose(run(trainer, compiled)[0], want, rtol=TOLERANCE)
    assert a2a_bytes(trainer, compiled) > 0                              # the partitioner chose all_to_all


def test_zero3_with_aux_free_bias_matches_single_device():
    """Manual ZeRO-3 stores a slice of the router bias: the bias update after the optimizer lands on it."""
    extra = ["model.moe.router=sigmoid", "model.moe.bias_rate=0.01", "model.moe.balance_loss=0"]
    want, _ = single_device(extra)
    got, _ = run(*build(["mesh.data=8", "parallel.data=zero3", *extra], jax.devices()))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE)

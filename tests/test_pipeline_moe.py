"""MoE inside the pipelines against one device: aux losses, router statistics and the aux-free bias update.

A pipeline with m microbatches (and train.microbatches = a) is one device accumulating over the same a·m
strided microbatches: the balance loss multiplies two batch means, so it depends on the microbatching and
nothing else may differ. The linear statistics (routed and dropped fractions, entropy, z) do not: step 1's
telemetry per layer equals the plain single device's. A representative subset runs here (1F1B with expert x
tensor, 1F1B with data x tensor and sequence parallelism, circular with virtual stages and manual experts); lab
03's `moe` part runs every schedule (28 layouts: data, fsdp, expert and tensor inside the stages, accumulation,
rules, DualPipeV).
"""
import jax
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.model.transformer import ModelConfig, loss
from jaxpar.parallel.registry import build_strategy, select

STEPS, VOCAB = 3, 512
FAST = {"xla_backend_optimization_level": 0}        # the same HLO compiled at -O0: same numbers, faster
MOE = ["train.warmup_steps=1", "model.layers=6", "model.moe.experts=4", "model.moe.top_k=2",
       "model.moe.dense_layers=2", "model.moe.router=sigmoid", "model.moe.bias_rate=0.01",
       "model.moe.balance_loss=0.1", "model.moe.z_loss=0.01"]
CASES = {   # name: (overrides, devices); every case's a·m = 4, the oracle's train.microbatches. A representative
    # subset: `jaxpar lab pipeline --parts moe` runs 28 layouts (labs/pipeline/moe.py), among them MoE DualPipeV
    # pipe=2 x tensor=2 and GPipe with accumulation
    # expert x pipe x tensor: every expert's hidden dimension split Megatron-style inside the stages, tokens
    # exchanged over expert
    "1f1b expert=2 x pipe=2 x tensor=2": (
        ["mesh.data=1", "mesh.expert=2", "mesh.pipe=2", "mesh.tensor=2", "parallel.expert=manual",
         "parallel.pipe=1f1b", "parallel.pipe_microbatches=4"], 8),
    # sequence parallelism inside the stages: the router sees its s/t tokens, the experts the whole sequence
    "1f1b data=2 x pipe=2 x tensor=2, sequence": (
        ["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "parallel.tensor=manual", "parallel.sequence=true",
         "parallel.pipe=1f1b", "parallel.pipe_microbatches=4"], 8),
    # manual EP inside the compiler-driven pipeline: the exchange's shard_map vmapped over the stages
    "circular data=2 x expert=2 x pipe=2 v=2, manual experts": (
        ["mesh.data=2", "mesh.expert=2", "mesh.pipe=2", "parallel.expert=manual", "parallel.pipe=circular",
         "parallel.pipe_virtual=2", "parallel.pipe_microbatches=4"], 8),
}


def make_config(overrides):
    config = load_config("configs/test.py")
    apply_overrides(config, MOE + overrides)
    return config


def train(overrides, devices: int, initial=None):
    """Metrics of STEPS steps (host arrays), the final params, the initial state (host; `initial` if given), the
    strategy and its compiled step."""
    config = make_config(overrides)
    strategy = build_strategy(config, jax.devices()[:devices], VOCAB)
    with jax.set_mesh(strategy.mesh):
        step = strategy.lower_step().compile(compiler_options=FAST)
        state = strategy.init_state() if initial is None else jax.device_put(initial, strategy.state_shardings)
        first = jax.device_get(state)
        metrics = []
        for batch in counting_batches(config, STEPS, VOCAB):
            state, m = step(state, jax.device_put(batch, strategy.batch_sharding))
            metrics.append(jax.device_get(m))
    metrics = {k: np.array([m[k] for m in metrics]) for k in metrics[0]}
    return metrics, jax.device_get(state["params"]), first, strategy, step


@pytest.fixture(scope="module")
def oracle():
    metrics, params, initial, _, _ = train(["mesh.data=1", "train.microbatches=4"], 1)
    assert metrics["loss"][-1] < metrics["loss"][0]
    assert np.abs(params["moe_blocks"]["router_bias"]).max() > 0          # the bias update ran
    return metrics, params, initial


@pytest.fixture(scope="module")
def runs(oracle):
    cache = {}

    def get(name):
        if name not in cache:
            overrides, devices = CASES[name]
            cache[name] = train(overrides, devices, oracle[2])
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(CASES))
def test_moe_pipeline_matches_one_device_accumulating_its_microbatches(name, runs, oracle):
    """Every metric (loss, cross-entropy, each aux loss, each statistic per layer, the gradient norm) at 1e-4
    every step, and the final params, aux-free router bias included."""
    metrics, params = runs(name)[:2]
    assert set(metrics) == set(oracle[0])
    for key, want in oracle[0].items():
        np.testing.assert_allclose(metrics[key], want, rtol=1e-4, atol=1e-7, err_msg=key)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(oracle[1])):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)


def test_pipeline_telemetry_per_layer_equals_the_single_device_step(runs, oracle):
    """Step 1's routed / dropped fractions, entropy and z per MoE layer (stacked in the model's layer order
    across the stages) equal the plain single device's forward on the whole batch (no microbatches)."""
    metrics = runs("1f1b expert=2 x pipe=2 x tensor=2")[0]
    config = make_config([])
    batch = counting_batches(config, 1, VOCAB)[0]
    model_cfg = ModelConfig.from_config(config.model, VOCAB)
    _, want = jax.jit(lambda p, t: loss(p, t, model_cfg))(oracle[2]["params"], batch)
    assert metrics["moe_routed"].shape == (STEPS, 4, 4)                    # [steps, MoE layers, experts]
    for key in ("moe_routed", "moe_dropped", "moe_entropy", "moe_z", "ce_loss"):
        np.testing.assert_allclose(metrics[key][0], np.asarray(want[key]), rtol=1e-4, atol=1e-7, err_msg=key)
    assert len({tuple(np.round(layer, 6)) for layer in metrics["moe_routed"][0]}) == 4   # each layer its own


@pytest.mark.parametrize("overrides, field", [
    (["mesh.data=2", "mesh.pipe=2", "mesh.expert=2", "parallel.pipe=1f1b"], "parallel.expert"),
    (["mesh.data=4", "mesh.pipe=2", "parallel.pipe=1f1b", "parallel.rules=embed=data"], "parallel.rules"),
    (["mesh.data=4", "mesh.pipe=2", "parallel.pipe=1f1b", "model.moe.dense_layers=1"], "model.moe.dense_layers"),
    (["mesh.data=4", "mesh.pipe=2", "parallel.pipe=gpipe", "train.microbatches=3"], "parallel.pipe_microbatches"),
])
def test_what_the_moe_pipeline_cannot_run_is_one_config_error(overrides, field):
    config = make_config(overrides)
    sizes = {"data": 1, "fsdp": 1, "pipe": 1, "expert": 1, "tensor": 1}
    sizes.update({a: int(config.mesh[a]) for a in sizes if int(config.mesh[a]) > 0})
    with pytest.raises(ConfigError) as error:
        select(config, sizes)
    assert error.value.field == field, str(error.value)


@pytest.mark.parametrize("name, axes, rel", [
    ("1f1b expert=2 x pipe=2 x tensor=2", {"pipe", "tensor", "expert"}, 0.01),
    ("1f1b data=2 x pipe=2 x tensor=2, sequence", {"pipe", "tensor", "data"}, 0.01),
    # its expert prediction is the all_to_alls alone (the next test); XLA's other traffic there is not predicted
    ("circular data=2 x expert=2 x pipe=2 v=2, manual experts", {"pipe", "expert?"}, 0.02),
])
def test_executed_collectives_of_moe_pipelines_match_the_prediction(name, axes, rel, runs):
    """The busiest stage's bytes per axis against `predict`: Megatron's f/g around every MoE layer's experts
    (its gates' gradient too), the dense stack on the first stage, the expert all_to_alls; under SP the
    gates' and expert ids' all-gathers and the router statistics' all-reduces; circular's rolls, queue and chunk
    picks over pipe (DualPipeV's re-deal of the stack: test_pipeline.py's dense case)."""
    from collections import defaultdict

    from jaxpar.measure.executed import step_collectives
    from jaxpar.parallel.registry import predicted_collective_bytes
    strategy, step = runs(name)[3:]
    sent = defaultdict(float)
    for collective in step_collectives(strategy, step.as_text()):
        sent[collective.axis_label] += collective.bytes_per_step
    sizes = {axis: int(n) for axis, n in strategy.mesh.shape.items()}
    predicted = predicted_collective_bytes(strategy.config, strategy.model_cfg, sizes, "cpu")
    assert set(predicted) == {axis.rstrip("?") for axis in axes}
    for axis in axes - {"expert?"}:
        assert sent[axis] == pytest.approx(predicted[axis], rel=rel), axis


def test_circular_manual_expert_all_to_alls_match_the_prediction(runs):
    """Circular with parallel.expert=manual: the all_to_alls over `expert` the step executes (every iteration, a
    bubble's too, each device exchanges its stage's tokens) against `predict`, byte for byte to 1%."""
    from jaxpar.measure.hlo import collectives
    from jaxpar.parallel.registry import predicted_collective_bytes
    strategy, step = runs("circular data=2 x expert=2 x pipe=2 v=2, manual experts")[3:]
    sent = sum(c.bytes_per_step for c in collectives(step.as_text(), strategy.mesh)
               if c.op == "all-to-all" and c.axes == ("expert",))
    sizes = {axis: int(n) for axis, n in strategy.mesh.shape.items()}
    predicted = predicted_collective_bytes(strategy.config, strategy.model_cfg, sizes, "cpu")
    assert sent > 0 and sent == pytest.approx(predicted["expert"], rel=0.01)

"""An MoE model under manual Megatron TP: every expert's hidden split over tensor (Megatron-Core's default expert
tensor parallelism). Layouts: TP x FSDP (data=2 x fsdp=2 x tensor=2, the router replicated); expert x TP
(expert=2 x data=2 x tensor=2, the all_to_all exchange written by hand); SP x expert x FSDP (the router on s/t
tokens, its statistics averaged over tensor). One device is the oracle: losses, gradient norms, the per-layer
router telemetry, the parameters and the aux-free bias; the Switch balance loss is taken over the whole batch
(`MoEOps.batch_mean`), so it is the single device's too. Each compiled program sends the bytes per mesh axis
that the strategy's `predict` says."""
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.measure.hlo import collectives
from jaxpar.model.moe import moe_feed_forward
from jaxpar.model.ops import Ops
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.megatron import sequence_parallel_ops
from jaxpar.parallel.registry import build_strategy, predicted_collective_bytes
from jaxpar.parallel.tensor import TensorStrategy
from jaxpar.parallel.tensor_moe import tensor_moe_ops

VOCAB, STEPS = 512, 3
FAST = {"xla_backend_optimization_level": 0}   # LLVM's -O0: faster compiles, the same HLO and numbers
# fine-grained experts plus a shared one, the sigmoid router with its bias update; clipping below every norm
MOE = ["model.moe.experts=4", "model.moe.router=sigmoid", "model.moe.bias_rate=0.01", "model.moe.shared_experts=1",
       "model.moe.expert_mlp_dim=64", "model.kv_heads=4", "train.warmup_steps=1", "train.grad_clip=0.05"]
TELEMETRY = ("loss", "grad_norm", "ce_loss", "moe_balance_loss", "moe_z_loss", "moe_routed", "moe_dropped",
             "moe_entropy")
LAYOUTS = {   # tensor=2 x fsdp=2 x data=2 and tensor=4 x data=2: lab 07's layouts part (labs/moe/layouts.py)
           "expert-tp": ["mesh.expert=2", "mesh.data=2", "mesh.tensor=2", "parallel.expert=manual"],
           "sp-expert-fsdp": ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.expert=manual",
                              "parallel.sequence=true"],
           "sp-rings-expert": ["mesh.expert=2", "mesh.data=2", "mesh.tensor=2", "parallel.expert=manual",
                               "parallel.sequence=true", "parallel.tensor_overlap=collective_matmul"]}


def make(overrides, devices):
    config = load_config("configs/test.py")
    apply_overrides(config, MOE + overrides)
    return build_strategy(config, jax.devices()[:devices], VOCAB)


def train(strategy):
    """(state after STEPS steps, each step's telemetry, the compiled step's HLO text)."""
    with jax.set_mesh(strategy.mesh):
        step = strategy.lower_step().compile(compiler_options=FAST)
    state, records = strategy.init_state(), []
    for batch in counting_batches(strategy.config, STEPS, VOCAB):
        with jax.set_mesh(strategy.mesh):
            state, metrics = step(state, jax.device_put(batch, strategy.batch_sharding))
        records.append({k: np.asarray(metrics[k]) for k in TELEMETRY})
    return state, records, step.as_text()


@pytest.fixture(scope="module")
def oracle():
    return train(make(["mesh.data=1"], 1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_with_manual_tp_matches_one_device(layout, oracle):
    """Every step's loss, gradient norm (the gradient check: the router's reaches the gates through Megatron's
    f) and router telemetry per layer; the parameters after the steps, the aux-free bias included. Then the
    compiled program's bytes per mesh axis against `predict`."""
    manual = make([*LAYOUTS[layout], "parallel.tensor=manual"], 8)
    assert isinstance(manual, TensorStrategy)
    want_state, want, _ = oracle
    got_state, got, hlo = train(manual)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in TELEMETRY:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-4, atol=1e-7, err_msg=f"step {step} {key}")
    bias = got_state["params"]["moe_blocks"]["router_bias"]
    assert np.abs(np.asarray(bias)).max() > 0
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_state["params"]),
                            jax.tree.leaves(want_state["params"])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
    measured, ops = defaultdict(float), set()
    for c in collectives(hlo, manual.mesh):
        measured[c.axis_label] += c.bytes_per_step
        ops.add(c.op)
    if manual.overlap != "none":   # attention's gathers and reduce-scatters are rings; the MoE layers' are whole
        assert {"collective-permute", "all-gather", "reduce-scatter"} <= ops, ops
    predicted = predicted_collective_bytes(manual.config, manual.model_cfg, dict(manual.mesh.shape), "cpu")
    live = {a for a, size in manual.mesh.shape.items() if size > 1}
    assert set(predicted) == live
    for axis, value in predicted.items():    # the scalars and router statistics over two axes at once are left out
        assert measured[axis] == pytest.approx(value, rel=1e-4), axis


def test_sp_router_sees_its_part_of_the_sequence():
    """One MoE layer under SP on tensor=2, the noisy router and capacity dispatch (noise and dropped tokens, which
    the layouts above do not have): each rank draws its part of the sequence's noise and reports the drops of its
    own tokens, so the output and every loss and statistic are one device's."""
    config = load_config("configs/test.py")
    apply_overrides(config, ["model.moe.experts=4", "model.moe.router=noisy", "model.moe.dispatch=capacity",
                             "model.moe.capacity_factor=1.0", "model.moe.expert_mlp_dim=64"])
    cfg = ModelConfig.from_config(config.model, VOCAB)
    D, E, F = cfg.d_model, cfg.moe.experts, cfg.moe.expert_mlp_dim
    shapes = {"router": (D, E), "router_noise": (D, E), "expert_gate": (E, D, F), "expert_up": (E, D, F),
              "expert_down": (E, F, D)}
    w = {name: 0.1 * jax.random.normal(jax.random.key(i), shape) for i, (name, shape) in enumerate(shapes.items())}
    x = jax.random.normal(jax.random.key(9), (2, 32, D))
    noise = (jnp.arange(2, dtype=jnp.uint32), 0)
    want_y, want = jax.jit(lambda x, w: moe_feed_forward(x, w, cfg.moe, Ops(), noise))(x, w)
    assert float(want["moe_dropped"].sum()) > 0
    ops = tensor_moe_ops(sequence_parallel_ops(Ops(), "tensor"), cfg.moe, {"expert": 1, "tensor": 2}, (), True)
    P = jax.sharding.PartitionSpec
    specs = {name: P() for name in w} | {"expert_gate": P(None, None, "tensor"), "expert_up": P(None, None, "tensor"),
                                        "expert_down": P(None, "tensor", None)}
    layer = jax.shard_map(lambda x, w: moe_feed_forward(x, w, cfg.moe, ops, noise),
                          mesh=jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",)),
                          in_specs=(P(None, "tensor"), specs), out_specs=(P(None, "tensor"), P()), check_vma=False)
    got_y, got = jax.jit(layer)(x, w)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-4, atol=1e-6)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-7, err_msg=key)

"""An MoE model under manual Megatron TP x FSDP (data=2 x fsdp=2 x tensor=2): every expert's hidden split over
tensor (Megatron-Core's default expert tensor parallelism), the router replicated. One device is the oracle:
losses, gradient norms, the per-layer router telemetry, the parameters and the aux-free bias.

The Switch balance loss E·Σ f_i·P_i is a product of two batch means: each batch shard computes its own, as
every data-parallel strategy (and Megatron-Core) does, which is not the whole batch's. It is switched off
here (the sigmoid router balances with its bias), so that one device's numbers are the exact oracle."""
import jax
import numpy as np
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.parallel.registry import build_strategy
from jaxpar.parallel.tensor import TensorStrategy

VOCAB, STEPS = 512, 3
FAST = {"xla_backend_optimization_level": 0}   # LLVM's -O0: faster compiles, the same HLO and numbers
# fine-grained experts plus a shared one, the sigmoid router with its bias update; clipping below every norm
MOE = ["model.moe.experts=4", "model.moe.router=sigmoid", "model.moe.bias_rate=0.01", "model.moe.balance_loss=0",
       "model.moe.shared_experts=1",
       "model.moe.expert_mlp_dim=64", "model.kv_heads=4", "train.warmup_steps=1", "train.grad_clip=0.05"]
TELEMETRY = ("loss", "grad_norm", "ce_loss", "moe_z_loss", "moe_routed", "moe_dropped", "moe_entropy")


def make(overrides, devices):
    config = load_config("configs/test.py")
    apply_overrides(config, MOE + overrides)
    return build_strategy(config, jax.devices()[:devices], VOCAB)


def train(strategy):
    with jax.set_mesh(strategy.mesh):
        step = strategy.lower_step().compile(compiler_options=FAST)
    state, records = strategy.init_state(), []
    for batch in counting_batches(strategy.config, STEPS, VOCAB):
        with jax.set_mesh(strategy.mesh):
            state, metrics = step(state, jax.device_put(batch, strategy.batch_sharding))
        records.append({k: np.asarray(metrics[k]) for k in TELEMETRY})
    return state, records


def test_moe_with_manual_tp_and_fsdp_matches_one_device():
    """Every step's loss, gradient norm (the gradient check: the router's reaches the gates through Megatron's
    f) and router telemetry per layer; the parameters after the steps, the aux-free bias included."""
    single = make(["mesh.data=1"], 1)
    manual = make(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.tensor=manual"], 8)
    assert isinstance(manual, TensorStrategy)
    want_state, want = train(single)
    got_state, got = train(manual)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in TELEMETRY:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-4, atol=1e-7, err_msg=f"step {step} {key}")
    bias = got_state["params"]["moe_blocks"]["router_bias"]
    assert np.abs(np.asarray(bias)).max() > 0
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_state["params"]),
                            jax.tree.leaves(want_state["params"])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))

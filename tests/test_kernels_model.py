"""The kernels inside the model and the strategies: model.attention / norm / loss selected per run, the
pallas run reproducing the dot run on one device, under fsdp=8, tensor=4 x data=2 and the manual zero3, the kernels
running on each device's shard, and what the flash kernel does to activation memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.config_checks import validate_fields
from jaxpar.kernels.kernel_ops import kernel_ops, resolve
from jaxpar.measure.memory import compiled_memory
from jaxpar.mesh import make_mesh
from jaxpar.model.ops import Ops
from jaxpar.model.transformer import ModelConfig, init_params, loss
from jaxpar.parallel.registry import make_strategy

STEPS = 5
VOCAB = 512
# small blocks so the test model's 32 positions span several blocks and chunks
SMALL = ["train.warmup_steps=1", "model.kv_heads=4", "model.attention_block_q=16", "model.attention_block_kv=16",
         "model.loss_chunk=8"]
KERNELS = ["model.attention=pallas", "model.norm=pallas", "model.loss=chunked"]
MESHES = {"single device": ["mesh.data=1"],      # fsdp=8, tensor=4 x data=2 and every hand-written strategy: lab 08
          "manual zero3, data=8": ["mesh.data=8", "parallel.data=zero3"]}


def configured(*overrides):
    config = load_config("configs/test.py")
    apply_overrides(config, [*SMALL, *overrides])
    return config


def build(*overrides):
    config = configured(*overrides)
    devices = jax.devices()[:1] if "mesh.data=1" in overrides and "mesh.fsdp=8" not in overrides else jax.devices()
    return make_strategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, devices))


def run(strategy):
    """[STEPS, 2]: each step's loss and gradient norm."""
    state, seen = strategy.init_state(), []
    for batch in counting_batches(strategy.config, STEPS, VOCAB):
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        seen.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return np.array(seen)


@pytest.fixture(scope="module")
def dot_losses():
    seen = run(build("mesh.data=1"))
    assert seen[-1, 0] < seen[0, 0]
    return seen


@pytest.mark.parametrize("mesh", MESHES)
def test_pallas_run_matches_dot_run(mesh, dot_losses):
    """Flash attention, fused RMSNorm and the chunked loss: the dot run's first 5 losses and gradient norms
    within 1e-4 (fp32). Under the manual zero3 the kernels run inside its shard_map (interpreted on CPU)."""
    np.testing.assert_allclose(run(build(*MESHES[mesh], *KERNELS)), dot_losses, rtol=1e-4)


def test_xla_attention_and_chunked_loss_give_the_same_loss():
    """xla attention (jax.nn.dot_product_attention) with the chunked loss: one forward pass, the dot run's value
    (pallas is compared over 5 training steps above)."""
    config = configured("mesh.data=1")
    cfg = ModelConfig.from_config(config.model, VOCAB)
    params, tokens = init_params(cfg, 0), jnp.asarray(counting_batches(config, 1, VOCAB)[0])
    apply_overrides(config, ["model.attention=xla", "model.loss=chunked"])
    ops = kernel_ops(Ops(), config, "cpu")
    assert ops.attention is not Ops().attention and ops.cross_entropy is not Ops().cross_entropy
    both = jax.jit(lambda p, t: (loss(p, t, cfg)[0], loss(p, t, cfg, ops)[0]))
    want, got = both(params, tokens)
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_kernels_run_on_each_devices_shard():
    """Under fsdp=8 the automatic path hands the Pallas kernels each device's batch rows (shard_local),
    not the global batch the partitioner would otherwise gather onto every device."""
    strategy = build("mesh.data=1", "mesh.fsdp=8", *KERNELS)
    with jax.set_mesh(strategy.mesh):
        jaxpr = strategy.step_fn.trace(strategy.abstract_state, strategy.abstract_batch()).jaxpr

    batches = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                batches.append(eqn.invars[0].aval.shape[0])
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)
    walk(jaxpr.jaxpr)
    global_batch = strategy.config.train.batch_size
    attention_rows = [b for b in batches if b < global_batch * 32]      # norms see [rows, D]; attention [B, ...]
    assert batches and attention_rows
    assert all(b in (global_batch // 8, global_batch // 8 * 32) for b in batches), batches


@pytest.mark.parametrize("overrides, field", [
    (["model.attention=flash"], "model.attention"),
    (["model.loss=fused"], "model.loss"),
    (["model.attention_block_q=24"], "model.attention_block_q"),
    (["model.attention=pallas", "model.d_model=96", "model.heads=4"], "model.head_dim"),
    (["model.loss_chunk=0"], "model.loss_chunk"),
    (["model.attention=cudnn"], "model.attention"),
])
def test_bad_kernel_choices_are_config_errors(overrides, field):
    """Checked before anything compiles: values, block sizes, head dims, cuDNN without a GPU."""
    with pytest.raises(ConfigError) as err:
        build("mesh.data=1", *overrides)
    assert err.value.field == field


def test_auto_picks_per_backend():
    config = configured("model.attention=auto", "model.norm=auto", "model.loss=auto")
    assert resolve(config, "gpu", jnp.bfloat16) == {"attention": "cudnn", "norm": "pallas", "loss": "chunked"}
    assert resolve(config, "gpu", jnp.float32) == {"attention": "pallas", "norm": "pallas", "loss": "chunked"}
    assert resolve(config, "cpu", jnp.float32) == {"attention": "dot", "norm": "xla", "loss": "chunked"}
    assert resolve(config, "tpu", jnp.bfloat16)["attention"] == "xla"


def test_resolve_and_the_config_check_share_the_kernel_rules():
    """One rule each, in config_checks: a bad kernel name reaching `resolve` unchecked is refused with the config
    check's line, and `auto` on GPU falls back to xla for the head dims the check refuses pallas for."""
    bad = configured("model.loss=fused")
    with pytest.raises(ConfigError) as by_resolve:
        resolve(bad, "cpu", jnp.float32)
    with pytest.raises(ConfigError) as by_check:
        validate_fields(bad)
    assert (by_resolve.value.field, str(by_resolve.value)) == (by_check.value.field, str(by_check.value))
    odd = configured("model.attention=auto", "model.d_model=96", "model.heads=4")     # head_dim 24
    assert resolve(odd, "gpu", jnp.float32)["attention"] == "xla"
    with pytest.raises(ConfigError, match="power of two"):
        validate_fields(configured("model.attention=pallas", "model.d_model=96", "model.heads=4"))


def attention_temp_bytes(attention, seq_len, B=1, H=4, Dh=16):
    """Compiled temp bytes of attention forward + backward (q, k, v gradients) at one sequence length."""
    q = jax.ShapeDtypeStruct((B, seq_len, H, Dh), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, seq_len, H // 2, Dh), jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), (0, 1, 2))
    return compiled_memory(jax.jit(grad).lower(q, kv, kv).compile(), "cpu").temp


def test_flash_attention_memory_does_not_grow_with_s_squared():
    """S x 4: the dot attention's temp bytes grow ~16x (the [S, S] scores), flash attention's ~4x (O(S))."""
    config = configured("model.attention=pallas", "model.attention_block_q=64", "model.attention_block_kv=64")
    flash = kernel_ops(Ops(), config, "cpu").attention
    dot = Ops().attention
    short, long = 128, 512
    dot_growth = attention_temp_bytes(dot, long) / attention_temp_bytes(dot, short)
    flash_growth = attention_temp_bytes(flash, long) / attention_temp_bytes(flash, short)
    assert dot_growth > 10, dot_growth
    assert flash_growth < 5, flash_growth

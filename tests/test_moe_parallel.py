"""An MoE model under manual ZeRO-3: the aux-free bias update after the optimizer reaches each device's
slice of the bias. (Expert parallelism against the single device: tests/test_moe_lab.py and
tests/test_moe_multiprocess.py.)"""
import jax
import numpy as np
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.registry import make_strategy

VOCAB = 512


def test_zero3_applies_the_aux_free_bias_update_to_its_slice():
    """Each of 2 devices stores half of the router bias [layers, 8]: after every step the gathered bias is
    before + rate·sign(mean load - load) exactly, whatever AdamW's weight decay did to it."""
    config = load_config("configs/test.py")
    apply_overrides(config, ["train.warmup_steps=1", "model.moe.experts=8", "mesh.data=2", "parallel.data=zero3",
                             "model.layers=1", "model.moe.router=sigmoid", "model.moe.bias_rate=0.01",
                             "train.weight_decay=0.5"])
    strategy = make_strategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, jax.devices()[:2]))
    assert strategy.state_specs["params"]["moe_blocks"]["router_bias"] == jax.sharding.PartitionSpec(None, "data")
    state = strategy.init_state()
    for batch in counting_batches(config, 2, VOCAB):
        before = np.asarray(state["params"]["moe_blocks"]["router_bias"])
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        routed = np.asarray(metrics["moe_routed"])
        want = before + 0.01 * np.sign(routed.mean(-1, keepdims=True) - routed)
        np.testing.assert_allclose(np.asarray(state["params"]["moe_blocks"]["router_bias"]), want, atol=1e-7)
    assert np.abs(want).max() > 0

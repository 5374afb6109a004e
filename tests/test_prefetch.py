"""ZeRO-3 with prefetch (parallel/prefetch.py): one device's losses, gradient norms and parameters on 8
devices, the gathered layers one ahead of the compute in the program, and the memory that costs."""
import jax
import numpy as np
import pytest
from synthetic import build_strategy_for, run_counting_steps

from jaxpar.config import ConfigError, apply_overrides, load_config, validate
from jaxpar.measure.hlo import collectives
from jaxpar.model.counting import param_count

VOCAB = 512
BASE = ["train.warmup_steps=1", "train.grad_clip=0.05"]


def _strategy(overrides, devices):
    return build_strategy_for(BASE, overrides, devices, VOCAB)


def _run(strategy, steps=2):
    return run_counting_steps(strategy, VOCAB, steps)


def test_prefetch_matches_one_device_and_costs_a_gathered_layer():
    one = _run(_strategy(["mesh.data=1"], 1))
    strategy = _strategy(["mesh.data=8", "parallel.data=zero3", "parallel.prefetch=true"], 8)
    prefetch = _run(strategy)
    np.testing.assert_allclose(prefetch[0], one[0], rtol=1e-4)
    np.testing.assert_allclose(prefetch[1], one[1], rtol=1e-4)          # the global gradient norm
    for got, want in zip(jax.tree.leaves(prefetch[2]["params"]), jax.tree.leaves(one[2]["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-5)
    step = prefetch[3]
    # the forward loop gathers the next layer: L-1 trips (layer 0 before the loop), the backward likewise
    model = strategy.model_cfg
    gathers = [c for c in collectives(step.as_text()) if c.op == "all-gather" and c.runs_per_step == model.layers - 1]
    assert len(gathers) >= 2, [(c.op, c.runs_per_step) for c in collectives(step.as_text())]
    # memory: ZeRO-3 with the same recomputation (remat full) holds one gathered layer; prefetch two
    plain = _strategy(["mesh.data=8", "parallel.data=zero3", "train.remat=full"], 8)
    with jax.set_mesh(plain.mesh):
        base = plain.lower_step().compile().memory_analysis().temp_size_in_bytes
    layer = param_count(model)["blocks"] / model.layers * 4
    assert step.memory_analysis().temp_size_in_bytes - base >= layer


def test_prefetch_needs_zero3():
    config = load_config("configs/test.py")
    apply_overrides(config, ["mesh.data=-1", "parallel.data=zero2", "parallel.prefetch=true"])
    with pytest.raises(ConfigError, match="parallel.prefetch") as err:
        validate(config, 8)
    assert "parallel.data=zero3" in str(err.value)

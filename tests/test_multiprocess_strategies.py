"""On 2 processes x 4 devices (one global mesh over gloo), the hand-written ZeRO-3 reproduces one device's losses
(strategies_worker.STRATEGIES: why it stands for the manual stages, and where XLA's strategies run on 2 processes)."""
import io
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from strategies_worker import STEPS, STRATEGIES, VOCAB
from synthetic import counting_batches

from jaxpar.config import apply_overrides, load_config
from jaxpar.launch import launch
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.registry import make_strategy

TESTS_DIR = str(Path(__file__).parent)


def single_device_losses():
    config = load_config("configs/test.py")
    apply_overrides(config, ["train.warmup_steps=1", "mesh.data=1"])
    strategy = make_strategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, jax.devices()[:1]))
    state, losses = strategy.init_state(), []
    for batch in counting_batches(config, STEPS, VOCAB):
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.mark.slow
def test_manual_zero3_on_two_processes_matches_one_device(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))
    out = io.StringIO()
    assert launch(2, 4, ["all"], module="strategies_worker", out=out, timeout=400) == 0, out.getvalue()[-3000:]
    found = {}
    for line in out.getvalue().splitlines():
        if line.startswith("[p0] LOSSES "):
            _, _, name, values = line.split(" ", 3)
            found[name] = np.array(json.loads(values))
    assert set(found) == set(STRATEGIES)
    oracle = single_device_losses()
    assert oracle[-1] < oracle[0]
    for name, losses in found.items():
        np.testing.assert_allclose(losses, oracle, rtol=1e-4, err_msg=name)

"""On 2 processes x 4 devices (one global mesh, `jaxpar launch`'s runtime), dropless MoE with manual expert
parallelism reproduces one device's losses. This file is also the worker the test launches:
`python -m test_moe_multiprocess worker --cpu-devices 4` (tests/ on PYTHONPATH)."""
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

RUNS = {   # expert=8 spans both processes: half of every all_to_all crosses the process boundary
    "expert=8": ["mesh.data=1", "mesh.expert=8", "parallel.expert=manual"],
}
BASE = ["train.warmup_steps=1", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.dispatch=dropless"]
STEPS, VOCAB = 5, 512
TESTS_DIR = str(Path(__file__).parent)


def train(overrides, devices=None) -> list[float]:
    import jax
    from synthetic import counting_batches

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_trainer

    config = load_config("configs/test.py")
    apply_overrides(config, [*BASE, *overrides])
    trainer = make_trainer(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, devices))
    state, losses = trainer.init_state(), []
    for batch in counting_batches(config, STEPS, VOCAB):
        tokens = jax.make_array_from_callback(batch.shape, trainer.batch_sharding, lambda index, batch=batch: batch[index])
        state, metrics = trainer.step(state, tokens)
        losses.append(float(metrics["loss"]))
    return losses


def worker(argv: list[str]) -> int:
    from jaxpar import mesh as jmesh
    jmesh.set_cpu_devices(int(argv[argv.index("--cpu-devices") + 1]))
    jmesh.init_distributed()
    import jax
    for name, overrides in RUNS.items():
        losses = train(overrides)
        if jax.process_index() == 0:
            print(f"LOSSES {name} {json.dumps(losses)}", flush=True)
    return 0


@pytest.mark.slow
def test_manual_expert_parallel_on_two_processes_matches_one_device(monkeypatch):
    import jax

    from jaxpar.launch import launch

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))
    out = io.StringIO()
    assert launch(2, 4, ["worker"], module="test_moe_multiprocess", out=out, timeout=400) == 0, out.getvalue()[-3000:]
    found = {}
    for line in out.getvalue().splitlines():
        if line.startswith("[p0] LOSSES "):
            name, values = line[len("[p0] LOSSES "):].split(" [", 1)
            found[name] = np.array(json.loads("[" + values))
    assert set(found) == set(RUNS)
    oracle = np.array(train(["mesh.data=1"], jax.devices()[:1]))
    assert oracle[-1] < oracle[0]
    for name, losses in found.items():
        np.testing.assert_allclose(losses, oracle, rtol=1e-4, err_msg=name)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))

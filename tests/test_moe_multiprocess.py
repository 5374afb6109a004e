"""On 2 processes x 4 devices (one global mesh, `jaxpar launch`'s runtime), dropless MoE with manual expert
parallelism reproduces one device's losses and gradient norms, alone and inside a 1F1B pipeline (the
4-axis layout data x pipe x expert, its oracle one device accumulating the pipeline's microbatches).
This file is also the worker the test launches: `python -m test_moe_multiprocess worker --cpu-devices 4`
(tests/ on PYTHONPATH)."""
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

RUNS = {   # name: (overrides, the single device's). expert=8 spans both processes: half of every all_to_all
    # crosses the process boundary; in the pipeline, data (outermost) does, and each stage's all_to_alls stay inside
    "expert=8": (["mesh.data=1", "mesh.expert=8", "parallel.expert=manual"], []),
    "data=2 x pipe=2 x expert=2 1f1b": (["mesh.data=2", "mesh.pipe=2", "mesh.expert=2", "parallel.expert=manual",
                                         "parallel.pipe=1f1b", "parallel.pipe_microbatches=2"],
                                        ["train.microbatches=2"]),
}
BASE = ["train.warmup_steps=1", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.dispatch=dropless"]
STEPS, VOCAB = 5, 512
TESTS_DIR = str(Path(__file__).parent)


def train(overrides, devices=None) -> list[list[float]]:
    """[loss, grad_norm] of each step."""
    import jax
    from synthetic import counting_batches

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    config = load_config("configs/test.py")
    apply_overrides(config, [*BASE, *overrides])
    strategy = make_strategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, devices))
    state, losses = strategy.init_state(), []
    for batch in counting_batches(config, STEPS, VOCAB):
        tokens = jax.make_array_from_callback(batch.shape, strategy.batch_sharding,
                                              lambda index, batch=batch: batch[index])
        state, metrics = strategy.step(state, tokens)
        losses.append([float(metrics["loss"]), float(metrics["grad_norm"])])
    return losses


def worker(argv: list[str]) -> int:
    from jaxpar import mesh as jmesh
    jmesh.set_cpu_devices(int(argv[argv.index("--cpu-devices") + 1]))
    jmesh.init_distributed()
    import jax
    for name, (overrides, _) in RUNS.items():
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
    assert launch(2, 4, ["worker"], module="test_moe_multiprocess", out=out, timeout=600) == 0, out.getvalue()[-3000:]
    found = {}
    for line in out.getvalue().splitlines():
        if line.startswith("[p0] LOSSES "):
            name, values = line[len("[p0] LOSSES "):].split(" [", 1)
            found[name] = np.array(json.loads("[" + values))
    assert set(found) == set(RUNS)
    for name, losses in found.items():
        oracle = np.array(train(["mesh.data=1", *RUNS[name][1]], jax.devices()[:1]))
        assert oracle[-1, 0] < oracle[0, 0]
        np.testing.assert_allclose(losses, oracle, rtol=1e-4, err_msg=name)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))

"""`jaxpar launch --nproc 2 --cpu-devices 4 -- train ...` with dropless MoE and manual expert parallelism
reproduces the one-device run's losses, through the CLI's own data path: each process loads only the batch
rows its devices hold, which here are not one block (the batch is split expert-outermost, the processes
split data). Alone (data x expert) and inside a 1F1B pipeline (data x pipe x expert, its oracle one device
accumulating the pipeline's microbatches)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.launch import launch

MOE = ["--config", "configs/test.py", "--set", "train.steps=4", "--set", "train.warmup_steps=1",
       "--set", "train.sample_tokens=0", "--set", "model.moe.experts=8", "--set", "model.moe.top_k=2",
       "--set", "model.moe.dispatch=dropless"]
RUNS = {   # name: (the 2-process run's overrides, the single device's)
    "data2-expert4": (["mesh.data=2", "mesh.expert=4", "parallel.expert=manual"], []),
    "data2-pipe2-expert2-1f1b": (["mesh.data=2", "mesh.pipe=2", "mesh.expert=2", "parallel.expert=manual",
                                  "parallel.pipe=1f1b", "parallel.pipe_microbatches=2"], ["train.microbatches=2"]),
}


def records(run_dir) -> dict[str, list[float]]:
    """The training losses of each step and the validation losses (step 4) from metrics.jsonl."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {key: [r[key] for r in lines if key in r] for key in ("loss", "val_loss")}


def sets(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_two_processes_with_expert_parallelism_match_one_device(name, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    overrides, oracle = RUNS[name]
    out = tmp_path / "launch.log"
    with open(out, "w") as log:
        code = launch(2, 4, ["train", *MOE, "--run-dir", str(two), *sets(overrides)], out=log, timeout=300)
    assert code == 0, out.read_text()[-3000:]
    done = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--cpu-devices", "1", *MOE,
                           "--run-dir", str(one), *sets(["mesh.data=1", *oracle])], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = records(two), records(one)
    assert len(want["loss"]) == 4 and len(want["val_loss"]) == 1 and want["loss"][-1] < want["loss"][0]
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{name}: {key}")

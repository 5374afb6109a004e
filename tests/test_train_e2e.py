"""End to end: `jaxpar train` writes a run, resumes exactly after a crash, runs on 2 processes, samples."""
import contextlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.launch import launch

TINY = ["--config", "configs/test.py"]


def metrics(run_dir):
    """{step: loss} from metrics.jsonl (the last record of each step wins)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def reference_output(tmp_path_factory):
    """The reference run (8 steps, log every step, evaluate every 4) and what it printed (not a terminal)."""
    run_dir = tmp_path_factory.mktemp("runs") / "reference"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["train", *TINY, "--run-dir", str(run_dir)]) == 0
    return run_dir, out.getvalue()


@pytest.fixture(scope="module")
def reference_run(reference_output):
    return reference_output[0]


def test_console_shows_the_first_loss_fresh_validation_and_unwrapped_lines(reference_output):
    run_dir, printed = reference_output
    lines = printed.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert steps[0].startswith("step     1/8  loss ")                       # the initial loss is shown
    assert [("val" in line) for line in steps] == [s in (4, 8) for s in range(1, 9)]  # only when evaluated
    corpus = next(line for line in lines if line.startswith("corpus: "))
    assert len(corpus) > 80 and corpus.endswith("sequences of 32")          # one line, not wrapped at 80
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "grad_norm", "lr", "step_time_s"} <= set(records[0])     # the step's metrics pass through


def test_run_directory_holds_config_metrics_checkpoints_and_sample(reference_run):
    assert json.loads((reference_run / "config.json").read_text())["model"]["d_model"] == 64
    losses = metrics(reference_run)
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < 0.9 * losses[1]
    steps = sorted(int(p.name) for p in (reference_run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [4, 8]
    summary = json.loads((reference_run / "summary.json").read_text())
    assert summary["sample"] and summary["final_val_loss"] < losses[1]


def test_sample_command_decodes_from_the_checkpoint(reference_run, capsys):
    assert main(["sample", "--run-dir", str(reference_run), "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[step 8] ")
    assert main(["sample", "--run-dir", str(reference_run), "--max-tokens", "6",
                 "--temperature", "0.8", "--top-k", "20", "--seed", "1"]) == 0


@pytest.mark.slow
def test_resume_after_kill_reproduces_the_uninterrupted_losses(reference_run, tmp_path):
    run_dir = tmp_path / "crashed"
    crashed = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "train", *TINY, "--run-dir", str(run_dir), "--cpu-devices", "8",
         "--set", "train.fault_at_step=6"], capture_output=True, text=True, timeout=300)
    assert crashed.returncode == -9, crashed.stderr[-2000:]        # SIGKILL between checkpoints 4 and 8
    assert max(metrics(run_dir)) == 6
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--set", "train.fault_at_step=0"]) == 0
    resumed, reference = metrics(run_dir), metrics(reference_run)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):                                       # resumed from the step-4 checkpoint
        assert resumed[step] == reference[step], step              # exactly, not approximately


@pytest.mark.slow
def test_two_processes_on_three_axes_match_one(reference_run, tmp_path):
    """2 processes x 4 devices on data=2 x fsdp=2 x tensor=2 reproduce the 1-process reference run (data=8: every
    mesh matches one device to fp32 rounding, tests/test_strategies.py). data=8 on 2 processes: test_slurm and the
    journeys' `jaxpar launch`."""
    run_dir = tmp_path / "two-process"
    mesh = ["--set", "mesh.data=2", "--set", "mesh.fsdp=2", "--set", "mesh.tensor=2"]
    assert launch(2, 4, ["train", *TINY, "--run-dir", str(run_dir), *mesh], timeout=300) == 0
    two, one = metrics(run_dir), metrics(reference_run)
    assert sorted(two) == sorted(one) == list(range(1, 9))
    np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-4)

"""Elastic operation: restarts, preemption, and resuming on another process count or strategy.

The oracle is one uninterrupted run of 1 process x 8 devices. A 2-process job whose
process 1 is killed at step 6 is restarted by `jaxpar launch --max-restarts 1` and
ends with the oracle's losses; its checkpoint resumes on 1 process x 8 devices, and
the oracle's step-4 checkpoint resumes on 2 processes x 4 devices under FSDP. A 2-process
job preempted mid-run (SIGTERM to the launcher and both processes) saves, exits 75 and
resumes with the oracle's losses.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ops_helpers import TINY, children_share_a_compilation_cache, losses, reference  # noqa: F401 (fixtures)

from jaxpar.cli import main
from jaxpar.launch import launch, restart_command
from jaxpar.train.preemption import EXIT_PREEMPTED


def assert_same_losses(run_dir, reference, steps, rtol=1e-4):
    got, want = losses(run_dir), losses(reference)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=rtol)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """2 processes x 4 devices; process 1 is SIGKILLed after step 6; one automatic restart."""
    run_dir = tmp_path_factory.mktemp("elastic") / "restarted"
    log = tmp_path_factory.mktemp("elastic") / "launch.log"
    with open(log, "w") as out:
        code = launch(2, 4, ["train", *TINY, "--run-dir", str(run_dir), "--set", "train.fault_at_step=6",
                             "--set", "train.fault_process=1"], max_restarts=1, timeout=400, out=out)
    return code, run_dir, log.read_text()


def test_restart_command_resumes_the_run():
    assert restart_command(["train", "--run-dir", "r", "--overwrite"]) == ["train", "--run-dir", "r", "--auto-resume"]
    assert restart_command(["train", "--run-dir", "r", "--resume"]) == ["train", "--run-dir", "r", "--resume"]
    assert restart_command(["crash"]) == ["crash"]


@pytest.mark.slow
def test_max_restarts_completes_with_the_uninterrupted_losses(restarted, reference):
    code, run_dir, log = restarted
    assert code == 0, log[-3000:]
    assert "[p1] fault injection: SIGKILL to process 1 after step 6" in log
    assert "restart 1/1 from the last checkpoint" in log
    assert "[p0] resumed from step 4" in log
    assert_same_losses(run_dir, reference, range(1, 9))
    goodput = json.loads((run_dir / "summary.json").read_text())["goodput"]
    assert goodput["restarts"] == 1 and goodput["redone_steps"] >= 2       # steps 5 and 6 ran twice
    assert goodput["badput_s"]["restart"] > 0 and 0 < goodput["goodput"] < 1


@pytest.mark.slow
def test_two_processes_resume_on_one(restarted, reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(restarted[1], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "8")                          # as if it had stopped after step 4..7
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0   # 1 process x 8 devices
    assert "resumed from step 4 (global sample 64) on 1 process(es) x 8 devices" in capsys.readouterr().out
    assert_same_losses(run_dir, reference, range(5, 9))


@pytest.mark.slow
def test_one_process_resumes_on_two_with_another_strategy(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "8")
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        code = launch(2, 4, ["train", "--run-dir", str(run_dir), "--resume", "--set", "mesh.data=1",
                             "--set", "mesh.fsdp=8"], timeout=300, out=out)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "[p0] resumed from step 4 (global sample 64) on 2 process(es) x 4 devices" in text
    assert_same_losses(run_dir, reference, range(5, 9))


@pytest.mark.parametrize("change, field", [(["--set", "train.batch_size=32"], "train.batch_size"),
                                           (["--set", "model.layers=3"], "model.layers")])
def test_what_cannot_change_is_refused_in_one_line(reference, tmp_path, capsys, change, field):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--set", "mesh.data=4", "--set", "mesh.fsdp=2",
                 *change]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err


@pytest.mark.slow
def test_sigterm_saves_and_exits_preempted(tmp_path, capsys):
    """One process: a real SIGTERM (sent by the process to itself after step 5, `train.fault_signal`, as a batch
    system would) stops it after the next step with a checkpoint and exit 75. Resuming from such a checkpoint
    with identical losses is tests/test_slurm.py's preemption test (2 processes, requeued by Slurm)."""
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--set", "train.fault_at_step=5",
                 "--set", "train.fault_signal=SIGTERM"]) == EXIT_PREEMPTED
    out, err = capsys.readouterr()
    assert "fault injection: SIGTERM to process 0 after step 5" in out
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [4, 6], saved                       # the signal arrived during step 5: step 6 saved, then out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preempted: saved a checkpoint at step 6 of 8"), err
    assert max(losses(run_dir)) == 6


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue   # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_launch_signalled_as_a_whole_group_saves_exits_75_and_resumes_the_same(reference, tmp_path):
    """SIGTERM to `jaxpar launch` and to both of its processes mid-run (what a scheduler killing the job's
    processes does; each process also gets it again from the launcher): both save the same step, every process
    exits 75, the launch exits 75, and the run resumed (on 1 process x 8 devices) has the oracle's losses.
    The processes are stopped while the signals are sent, so that they land mid-run on a loaded machine too."""
    run_dir = tmp_path / "run"
    with open(tmp_path / "launch.log", "w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "2", "--cpu-devices", "4",
                                     "--", "train", *TINY, "--run-dir", str(run_dir)],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while max(losses(run_dir) if (run_dir / "metrics.jsonl").is_file() else [0]) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
        time.sleep(0.02)
    children = children_of(launcher.pid)
    assert len(children) == 2, children
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    for pid in [launcher.pid, *children]:
        os.kill(pid, signal.SIGTERM)
    for pid in children:
        os.kill(pid, signal.SIGCONT)
    code = launcher.wait(timeout=300)
    text = (tmp_path / "launch.log").read_text()
    assert code == EXIT_PREEMPTED, text[-3000:]
    assert "jaxpar launch: preemption signal; asking every process to save and stop" in text, text[-3000:]
    last = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert 2 <= last < 8, last
    for i in range(2):
        assert f"[p{i}] preempted: saved a checkpoint at step {last} of 8" in text, text[-3000:]
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--resume"]) == 0
    assert_same_losses(run_dir, reference, range(1, 9))

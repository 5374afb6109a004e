"""A real Slurm cluster on this machine (scripts/slurm/local-cluster.sh) runs the script `jaxpar slurm` renders.

- a 2-task CPU job (2 processes x 4 devices) reproduces the single-process 8-device losses;
- the preemption signal (USR1 to the batch shell, what `--signal=B:USR1@90` sends) makes the
  job save, requeue itself and resume with the uninterrupted job's losses, exactly;
- kill -9 of one task ends the job non-zero, and every task is gone within seconds.

Needs slurmctld, slurmd, munge (CI installs them with apt); skipped with the reason otherwise.
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
from jaxpar.cluster.slurm import render

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "slurm" / "local-cluster.sh"
TRAIN = TINY
MISSING = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(b) is None]

needs_slurm = pytest.mark.skipif(bool(MISSING), reason=f"Slurm is not installed here (no {', '.join(MISSING)}); "
                                 "`scripts/slurm/local-cluster.sh install` installs it (apt, root)")


def test_the_shipped_script_is_the_rendered_one(capsys):
    assert main(["slurm", "--nodes", "2", "--gpus-per-node", "8", "--", "--config", "configs/llama_1b.py"]) == 0
    text = capsys.readouterr().out
    assert text == (ROOT / "scripts" / "slurm" / "train.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=B:USR1@90", "#SBATCH --requeue", "srun --kill-on-bad-exit=1"):
        assert line in text
    per_gpu = render(nodes=2, gpus_per_node=8, tasks_per="gpu")
    assert "#SBATCH --ntasks-per-node=8" in per_gpu and "#SBATCH --gpus-per-task=1" in per_gpu
    assert main(["slurm", "--nodes", "0"]) == 2


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running single-node cluster, stopped after the module."""
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(state), "8"], capture_output=True, text=True,
                             timeout=60)
    assert started.returncode == 0, started.stderr
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    yield env
    subprocess.run(["bash", str(CLUSTER), "stop", str(state)], timeout=30)




def submit(env, tmp_path, name, extra=()):
    run_dir = tmp_path / name
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render(nodes=1, tasks_per_node=2, cpu_devices=4, run_dir=str(run_dir), python=sys.executable,
                             workdir=str(ROOT), loopback=True, time="10:00", job_name=name,
                             output=str(tmp_path / f"{name}-%j.out"), train_args=[*TRAIN, *extra]))
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert job.returncode == 0, job.stderr
    return job.stdout.strip().split(";")[0], run_dir


def job_state(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields.get("JobState"), fields.get("ExitCode"), fields.get("Reason")


def in_queue(env, job) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True,
                               timeout=30).stdout.strip())


def wait_until(predicate, timeout, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def reached_step(run_dir, step):
    try:
        return max(losses(run_dir), default=0) >= step
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def job_log(tmp_path, name):
    return "\n".join(p.read_text() for p in tmp_path.glob(f"{name}-*.out"))


def task_pids(job):
    """Pids of this job's training processes, by their Slurm environment: {SLURM_PROCID: pid}."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"jaxpar.cli" in cmdline and f"SLURM_JOB_ID={job}".encode() in environ:
            rank = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"SLURM_PROCID=")), None)
            if rank is not None:
                found[int(rank)] = int(proc.name)
    return found


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slurm-jobs")
    job, run_dir = submit(slurm, tmp, "plain")
    assert wait_until(lambda: not in_queue(slurm, job), 300, 0.5), job_log(tmp, "plain")[-3000:]
    state, code, _ = job_state(slurm, job)
    assert (state, code) == ("COMPLETED", "0:0"), job_log(tmp, "plain")[-3000:]
    return run_dir


@pytest.mark.slow
@needs_slurm
def test_two_task_job_matches_the_single_process_run(uninterrupted, reference):
    two, one = losses(uninterrupted), losses(reference)                  # reference: 1 process x 8 devices
    assert sorted(two) == list(range(1, 9))
    np.testing.assert_allclose([two[s] for s in range(1, 9)], [one[s] for s in range(1, 9)], rtol=1e-4)


@pytest.mark.slow
@needs_slurm
def test_preemption_saves_requeues_and_resumes_exactly(slurm, uninterrupted, tmp_path):
    job, run_dir = submit(slurm, tmp_path, "preempted")
    assert wait_until(lambda: reached_step(run_dir, 2), 300), job_log(tmp_path, "preempted")[-3000:]
    # What `#SBATCH --signal=B:USR1@90` delivers before the time limit: USR1 to the batch shell.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True, timeout=30)
    # Slurm holds a requeued job back for the credential lifetime (AuthInfo=cred_expire, 10 s on the test cluster).
    assert wait_until(lambda: not in_queue(slurm, job), 300, 0.5), job_log(tmp_path, "preempted")[-3000:]
    log = job_log(tmp_path, "preempted")
    state, code, _ = job_state(slurm, job)
    assert (state, code) == ("COMPLETED", "0:0"), log[-3000:]
    assert "preempted after saving; requeueing" in log and "start 1 on" in log, log[-3000:]
    resumed_at = int(log.split("resumed from step ")[1].split()[0])
    assert 2 <= resumed_at < 8
    got, want = losses(run_dir), losses(uninterrupted)
    assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]   # exactly
    goodput = json.loads((run_dir / "summary.json").read_text())["goodput"]
    assert goodput["restarts"] == 1


@pytest.mark.slow
@needs_slurm
def test_a_killed_task_ends_the_job_quickly(slurm, tmp_path, record_property):
    job, run_dir = submit(slurm, tmp_path, "killed", extra=["--set", "train.steps=400"])
    assert wait_until(lambda: reached_step(run_dir, 2), 300), job_log(tmp_path, "killed")[-3000:]
    pids = task_pids(job)
    assert sorted(pids) == [0, 1], pids
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    assert wait_until(lambda: not task_pids(job), 30, 0.05), job_log(tmp_path, "killed")[-3000:]
    all_gone_s = time.monotonic() - killed_at
    assert wait_until(lambda: not in_queue(slurm, job), 30, 0.1), job_log(tmp_path, "killed")[-3000:]
    job_end_s = time.monotonic() - killed_at
    state, code, _ = job_state(slurm, job)
    assert state == "FAILED" and code != "0:0", (state, code)
    print(f"\nkill -9 of task 1: every task gone after {all_gone_s:.1f} s, "
          f"job {state} ({code}) after {job_end_s:.1f} s")
    record_property("all_tasks_gone_s", all_gone_s)
    assert job_end_s <= 30

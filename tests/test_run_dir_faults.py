"""A run directory shared by accident, torn by a crash, changed by a failed resume, or deleted (issue 32).

Each is a row of lab 09's fault table: a second run on a locked folder is refused in one
line naming the holder, and a lock whose holder died is free; a torn metrics tail is left
out on resume, damage before it is refused; a resume that fails leaves config.json as it
was; a run whose folder is deleted stops in one line, exit 74.
"""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from ops_helpers import TINY, children_share_a_compilation_cache, losses, reference  # noqa: F401 (fixtures)

from jaxpar import training as loop
from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.train.checkpoint import EXIT_SAVE_FAILED
from jaxpar.train.guard import EXIT_NON_FINITE
from jaxpar.train.rundir import metrics_records
from jaxpar.train.runlock import LOCK_FILE, RunLock

HOLD = ("import sys; from jaxpar.train.runlock import RunLock; lock = RunLock(); lock.acquire(sys.argv[1]); "
        "print('held', flush=True); sys.stdin.read()")


@pytest.fixture
def holder():
    """hold(run_dir): another process takes the run directory's lock and keeps it until killed."""
    started = []

    def hold(run_dir):
        process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout.readline() == "held\n"
        return process

    yield hold
    for process in started:
        process.kill()
        process.wait()


@pytest.fixture
def run_dir(reference, tmp_path):
    """A copy of the 8-step reference run (checkpoints at 4 and 8)."""
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    return target


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# 1. One run per run directory ------------------------------------------------------------------------------------

def test_the_lock_names_its_holder_and_dies_with_it(tmp_path, holder):
    process = holder(tmp_path)
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {process.pid} on host "
                                          f"{socket.gethostname()} since 20"):
        RunLock().acquire(tmp_path)
    process.kill()        # kill -9: the holder cannot clean up; its lock file stays, and the kernel frees the lock
    process.wait()
    assert (tmp_path / LOCK_FILE).is_file()
    with RunLock() as lock:
        lock.acquire(tmp_path)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_locked_run_directory_is_neither_resumed_nor_overwritten(run_dir, holder, capsys):
    """A requeued job while the old one still runs: `--resume` and `--overwrite` are both refused in one line naming
    the holder, before anything is built or deleted."""
    process = holder(run_dir)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    for how in ("--resume", "--overwrite"):
        assert main(["train", *TINY, "--run-dir", str(run_dir), how]) == 2
        line = one_line(capsys)
        assert line.startswith(f"error: --run-dir: '{run_dir}' is in use by another run (pid {process.pid} on"), line
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_second_train_is_refused_while_the_first_runs(run_dir, monkeypatch, capsys):
    """Two `jaxpar train` on one folder: while this process's run is between steps, a second `jaxpar train
    --auto-resume` (a shell's) exits 2 naming this process; once the run has ended, the lock is free."""
    second = []
    write = loop.MetricsLog.write

    def write_and_start_a_second_run(self, record):
        if not second:
            second.append(subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--run-dir", str(run_dir),
                                          "--auto-resume"], capture_output=True, text=True, timeout=120))
        write(self, record)

    monkeypatch.setattr(loop.MetricsLog, "write", write_and_start_a_second_run)
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--resume", "--set", "train.steps=9"]) == 0
    result = second[0]
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: --run-dir: '{run_dir}' is in use by another run (pid {os.getpid()} on host {socket.gethostname()} "
        f"since {result.stderr.split(' since ')[1].split(')')[0]}); wait for it to end or stop it, or choose another "
        "--run-dir"]
    assert max(losses(run_dir)) == 9
    with RunLock() as lock:
        lock.acquire(run_dir)   # released when `train` returned


# 2. A torn metrics log -------------------------------------------------------------------------------------------

TORN = {"partial object": b'{"step": 9, "loss": 5.1', "NUL bytes": b"\0" * 300}


@pytest.mark.parametrize("tail", TORN.values(), ids=TORN.keys())
def test_a_torn_last_line_is_left_out(tmp_path, tail):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n' + tail)
    assert [record for _, record in metrics_records(path)[0]] == [{"step": 1}, {"step": 2}]
    assert metrics_records(path)[1] == len(tail)


def test_a_resume_after_a_crash_that_tore_the_metrics_log(run_dir, reference, capsys):
    """ext4 after a crash: the log's last block is NUL bytes. The resume used to end in a JSONDecodeError
    traceback (so did every requeue); now it leaves the tail out and logs the step again. (The resume changes
    train.steps: its config.json is written with step 9's checkpoint, the run's earlier one kept beside it.)"""
    metrics = run_dir / "metrics.jsonl"
    config_before = json.loads((run_dir / "config.json").read_text())
    metrics.write_bytes(metrics.read_bytes() + b"\0" * 4096)
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--resume", "--set", "train.steps=9"]) == 0
    assert f"{metrics}: left out its torn last line (4096 bytes written as the run stopped)" in capsys.readouterr().out
    assert b"\0" not in metrics.read_bytes()
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 10)) and all(got[s] == losses(reference)[s] for s in range(1, 9))
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 9
    kept = list(run_dir.glob("config.before-resume-*"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == config_before


def test_damage_before_the_last_line_is_refused_in_one_line(run_dir, capsys):
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], lines[1][:7], *lines[2:]]) + "\n")
    before = metrics.read_bytes()
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--resume"]) == 2
    assert one_line(capsys) == (f"error: --run-dir: line 2 of '{metrics}' is damaged (not a JSON record) and "
                                "records follow it; repair or delete that line and resume again")
    assert metrics.read_bytes() == before


# 3. A resume that fails keeps the run's config ------------------------------------------------------------------

def test_a_failed_resume_leaves_config_json_as_it_was(run_dir, capsys):
    """`--set train.lr=1e30` explodes (exit 3) before anything is saved under it: config.json must still hold the
    run's config, so that the next plain `--resume` (a requeue) does not explode again."""
    before = (run_dir / "config.json").read_bytes()
    code = main(["train", *TINY, "--run-dir", str(run_dir), "--resume", "--set", "train.steps=12",
                 "--set", "train.lr=1e30"])
    assert code == EXIT_NON_FINITE, capsys.readouterr().err[-2000:]
    assert (run_dir / "config.json").read_bytes() == before
    assert not list(run_dir.glob("config.before-resume-*"))


# 4. The run directory deleted mid-run ----------------------------------------------------------------------------

def test_a_run_directory_deleted_mid_run_is_one_line_and_exit_74(run_dir, monkeypatch, capsys):
    write = loop.MetricsLog.write

    def delete_then_write(self, record):
        if record.get("step") == 10:
            shutil.rmtree(run_dir)
        write(self, record)

    monkeypatch.setattr(loop.MetricsLog, "write", delete_then_write)
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--resume", "--set", "train.steps=12"]) == EXIT_SAVE_FAILED
    assert one_line(capsys) == (f"run directory: cannot write {run_dir / 'metrics.jsonl'}: '{run_dir}' was deleted "
                                "while the run used it; stopped")

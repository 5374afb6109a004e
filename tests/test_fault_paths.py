"""Faults an operator meets that must never lose a run (issue 16, lab 09's fault table).

A save that cannot be written ends the run in one line and keeps the last good step;
a run that dies before its first checkpoint starts again; a preemption notice during
start-up exits 75; a checkpoint whose checksum record is missing is damaged; the
metrics server and the launcher's coordinator listen on loopback. The exploding-update
case is tests/test_checkpoint_integrity.py's NaN test.
"""
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ops_helpers import TINY, children_share_a_compilation_cache, losses, reference  # noqa: F401 (fixtures)

from jaxpar.cli import main
from jaxpar.cluster.metrics import PrometheusExporter, Sinks
from jaxpar.launch import launch
from jaxpar.train.checkpoint import EXIT_SAVE_FAILED, Checkpoints
from jaxpar.train.guard import STATE_LIMIT, NonFiniteError, NonFiniteGuard
from jaxpar.train.preemption import EXIT_PREEMPTED

TESTS_DIR = str(Path(__file__).resolve().parent)


def sharded_state(seed=0):
    """A small train-state-like tree over the 8 test devices (random: it does not compress away)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jax.device_put(jax.random.normal(jax.random.key(seed), (512, 512)), NamedSharding(mesh, P("d")))
    return {"params": {"w": w}, "opt_state": {"mu": w * 0.1},
            "step": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P()))}


def abstract(state):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


@pytest.fixture
def worker_path(monkeypatch):
    """tests/ (launch_worker.py, this file) importable in child processes."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))


def notices():
    lines = []
    return lines, lines.append


# 1. Failed saves -----------------------------------------------------------------------------------------------

def test_a_save_into_a_read_only_folder_is_one_line_and_a_prompt_exit(reference, tmp_path):
    """The checkpoints folder refuses writes even to root (the immutable attribute, as a read-only mount does):
    the resumed run's save fails; the process exits 74 at once (it used to hang on Orbax's threads) with one
    line naming the folder and the cause, and steps 4 and 8 stay."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    checkpoints = run_dir / "checkpoints"
    if subprocess.run(["chattr", "+i", str(checkpoints)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a file system with the immutable attribute)")
    try:
        result = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--run-dir", str(run_dir), "--resume",
                                 "--set", "train.steps=9", "--cpu-devices", "8"],
                                capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["chattr", "-i", str(checkpoints)], check=True)
    assert result.returncode == EXIT_SAVE_FAILED, (result.stdout + result.stderr)[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"checkpoint: cannot save step 9 in {checkpoints}: Operation not permitted; stopped (the last good "
        "checkpoint, step 8, is kept)"], result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["4", "8"]


@pytest.fixture
def small_disk(tmp_path):
    """A 3.2 MB tmpfs: room for one 2 MB checkpoint, not two (skips where mounting is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3200k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


# As `jaxpar train` handles it (a process of its own: what Orbax leaves behind must not print at exit either).
FILL_THE_DISK = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
from test_fault_paths import sharded_state
from jaxpar.train.checkpoint import Checkpoints, SaveFailed
checkpoints = Checkpoints(sys.argv[1], keep=3)
try:
    for step in (1, 2):
        checkpoints.save(step, sharded_state(step), 4)
    checkpoints.close()
except SaveFailed as err:
    print(err, file=sys.stderr)
    sys.exit(err.exit_code)
"""


def test_a_full_disk_is_one_line_and_keeps_the_last_good_step(small_disk, worker_path):
    directory = small_disk / "checkpoints"
    result = subprocess.run([sys.executable, "-c", FILL_THE_DISK, str(directory)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == EXIT_SAVE_FAILED, (result.stdout + result.stderr)[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"checkpoint: cannot save step 2 in {directory}: No space left on device; stopped (the last good "
        "checkpoint, step 1, is kept)"], (result.stdout + result.stderr)[-3000:]
    assert sorted(p.name for p in directory.iterdir()) == ["1"]          # the partial step 2 is gone
    step, state = Checkpoints(directory, keep=3).restore(abstract(sharded_state(1)))
    assert step == 1 and np.array_equal(state["params"]["w"], sharded_state(1)["params"]["w"])


# 2. A run that dies before its first checkpoint; exit 2 is not restarted ------------------------------------------

@pytest.mark.slow
def test_a_job_that_dies_before_its_first_checkpoint_is_restarted_from_step_0(reference, tmp_path, monkeypatch):
    """Issue 16's scenario, small: process 1 of 2 is killed after step 2, before the first save (step 4);
    `--max-restarts 2` starts the run again from step 0 (it used to refuse: "already holds a run", exit 2)."""
    # No shared compilation cache: only process 0 writes it, so in the restart process 0 would load every
    # program while process 1 compiles them again, and on a loaded machine process 0 can wait longer than gloo's
    # 30 s for process 1 at the first collective.
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    run_dir = tmp_path / "run"
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        code = launch(2, 4, ["train", *TINY, "--run-dir", str(run_dir), "--set", "train.fault_at_step=2",
                             "--set", "train.fault_process=1"], max_restarts=2, timeout=400, out=out)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "[p1] fault injection: SIGKILL to process 1 after step 2" in text
    assert "restart 1/2 from the last checkpoint" in text and "restart 2/2" not in text
    assert f"[p0] no checkpoint in {run_dir}: the run stopped before its first save; starting it again" in text
    got, want = losses(run_dir), losses(reference)
    np.testing.assert_allclose([got[s] for s in range(1, 9)], [want[s] for s in range(1, 9)], rtol=1e-4)
    assert (run_dir / "summary.json").is_file()


def test_auto_resume_refuses_a_changed_run_without_checkpoint(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--auto-resume", "--set", "model.layers=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.layers: was 2 in the run being resumed"), err


def test_the_launcher_does_not_restart_bad_input(worker_path, capsys):
    assert launch(2, 1, ["refuse"], module="launch_worker", max_restarts=2, timeout=60) == 2
    out = capsys.readouterr().out
    assert out.count("[p0] error: --set: refused") == 1, out          # one attempt
    assert "restart" not in out.replace("not restarting", ""), out
    assert "jaxpar launch: a process refused its input (exit 2); not restarting" in out


# 3. Preemption during start-up ----------------------------------------------------------------------------------

@pytest.mark.parametrize("moment", ["joining", "loading data"])
def test_a_preemption_notice_during_start_up_exits_75(tmp_path, capsys, monkeypatch, moment):
    """SIGUSR1 while the process joins the job (before JAX's handlers exist) or loads its data: exit 75 with one
    line, nothing saved and, as nothing was written yet, no run directory. (Before, the default action killed
    the process; here a stand-in handler keeps the test process alive, so the old code trained on.)"""
    import jaxpar.mesh
    from jaxpar import training as loop

    def notice_during(function):
        def wrapped(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGUSR1)
            return function(*args, **kwargs)
        return wrapped

    if moment == "joining":
        monkeypatch.setattr(jaxpar.mesh, "init_distributed", notice_during(jaxpar.mesh.init_distributed))
    else:
        monkeypatch.setattr(loop, "build_token_data", notice_during(loop.build_token_data))
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
    try:
        code = main(["train", *TINY, "--run-dir", str(tmp_path / "run")])
    finally:
        restored = signal.signal(signal.SIGUSR1, previous)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_PREEMPTED, err
    assert len(err) == 1 and err[0].startswith("preempted during start-up (before the run directory was written)"), err
    assert not (tmp_path / "run").exists() and not seen
    assert getattr(restored, "__name__", "") == "<lambda>"   # the handlers before the run are back


def test_a_notice_in_the_first_second_exits_75_at_once(tmp_path):
    """SIGTERM 0.3 s after `python -m jaxpar.cli train` starts (importing): exit 75 with one line within 2 s,
    no run directory. (Before, the listener came after jaxpar.config's import: 143 under load, else 75 only
    once JAX had started and the data was built, 3-7 s after the notice on a loaded 2-core machine.)"""
    import time
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "train", *TINY, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    noticed = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - noticed
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert err.strip().splitlines() == ["preempted during start-up (before the run directory was written); "
                                        "nothing new to save, nothing saved; start the run again to continue it"]
    assert took < 2, f"exit {took:.1f} s after the notice"
    assert not run_dir.exists()


def test_a_notice_during_the_first_compile_exits_75_without_waiting_for_it(tmp_path):
    """SIGTERM 0.5 s into the first step's compile (16 layers with full remat: 9.7 s to compile on a loaded
    2-core machine, uncached): exit 75 with one line, the compile abandoned (no step ran), and a run directory
    that `--auto-resume` starts again. (Before, the handler ran only once XLA returned: the process compiled,
    ran step 1, saved it and exited 75 seconds later.)"""
    import time

    from jaxpar.train.rundir import check_run_dir
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}   # a real compile, not a read
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "train", *TINY, "--set", "model.layers=16",
                             "--set", "train.remat=full", "--cpu-devices", "8", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out = []
    for line in proc.stdout:   # the last line before the step loop, whose first step compiles
        out.append(line)
        if line.startswith("MFU "):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    noticed = time.monotonic()
    rest, err = proc.communicate(timeout=120)
    print(f"exit {proc.returncode} {time.monotonic() - noticed:.2f} s after the notice")
    out = "".join(out) + rest
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert err.strip().splitlines() == ["preempted during start-up (compiling step 1); nothing new to save, "
                                        "nothing saved; start the run again to continue it"]
    assert "first step" not in out and not (run_dir / "checkpoints" / "1").exists(), out
    assert check_run_dir(run_dir, resume=False, overwrite=False, restart=True)   # --auto-resume starts it again


def test_a_launch_whose_process_saved_and_exited_75_exits_75(worker_path, tmp_path):
    """SIGUSR1 to `jaxpar launch`: process 0 saves and exits 75, its slower peer is aborted (JAX's distributed
    service does that once process 0, its host, is gone). The launch exits 75, so the scheduler requeues;
    before, the abort made it 143."""
    import threading
    import time
    log = tmp_path / "launch.log"

    def notice_when_ready():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and log.read_text().count("ready") < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    with open(log, "w") as out:
        threading.Thread(target=notice_when_ready, daemon=True).start()
        code = launch(2, 1, ["preempted"], module="launch_worker", timeout=60, out=out)
    text = log.read_text()
    assert "[p0] saved; exiting 75" in text and "jaxpar launch: preemption signal" in text, text
    assert code == EXIT_PREEMPTED, text


def test_a_launch_whose_preemption_save_is_durable_exits_75_though_its_processes_were_killed(worker_path):
    """Process 0 records the durable save in the file `jaxpar launch` names (ENV_PREEMPTION_RECORD), then both
    processes die by SIGKILL: the launch exits 75, not 137, so the scheduler requeues."""
    out = io.StringIO()
    assert launch(2, 1, ["durable"], module="launch_worker", timeout=60, out=out) == EXIT_PREEMPTED, out.getvalue()


# 4. The state check before a save (the run-level case is test_checkpoint_integrity's NaN test) ------------------

def test_the_guard_refuses_to_save_an_exploded_or_non_finite_state():
    guard = NonFiniteGuard(0)
    state = sharded_state()
    guard.check_state(8, state)                                            # a healthy state passes
    for where, value in [("params", 3.5e29), ("opt_state", np.inf), ("params", np.nan)]:
        bad = {**state, where: jax.tree.map(lambda x, v=value: x.at[3, 5].set(v), state[where])}
        with pytest.raises(NonFiniteError, match=r"the state after step 9 has exploded \(\['" + where):
            guard.check_state(9, bad)
    edge = {**state, "params": {"w": state["params"]["w"].at[0, 0].set(STATE_LIMIT)}}
    guard.check_state(10, edge)                                            # the limit itself is allowed


# 5. A missing checksum record ------------------------------------------------------------------------------------

@pytest.fixture
def two_steps(tmp_path):
    directory = tmp_path / "checkpoints"
    checkpoints = Checkpoints(directory, keep=3)
    for step in (1, 2):
        checkpoints.save(step, sharded_state(step), 4)
    checkpoints.close()
    return directory


@pytest.mark.parametrize("damage", ["meta removed", "checksums empty"])
def test_a_step_without_its_checksum_record_is_damaged(two_steps, damage):
    """Such a step restored unchecked and silently, so bytes changed on disk went unnoticed (issue 16: the run
    then trained to NaN). Its intact arrays here make the reason unambiguous: the record alone is missing."""
    if damage == "meta removed":
        shutil.rmtree(two_steps / "2" / "meta")
    else:
        record = two_steps / "2" / "meta" / "metadata"
        record.write_text(json.dumps({**json.loads(record.read_text()), "checksums": {}}))
    lines, notice = notices()
    checkpoints = Checkpoints(two_steps, keep=3, notice=notice)
    step, state = checkpoints.restore(abstract(sharded_state(1)))
    checkpoints.close()
    assert step == 1 and np.array_equal(state["params"]["w"], sharded_state(1)["params"]["w"])
    assert lines == ["checkpoint step 2 is damaged (its checksum record is missing or empty); trying an older one"]


def test_a_step_from_before_checksums_restores_unchecked_with_a_notice(tmp_path):
    """Saved as jaxpar did before checksums existed: the state item alone, no format marker."""
    directory = tmp_path / "checkpoints"
    state = sharded_state(3)
    old = ocp.CheckpointManager(directory, item_names=("state",))
    old.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    old.wait_until_finished()
    old.close()
    lines, notice = notices()
    checkpoints = Checkpoints(directory, keep=3, notice=notice)
    step, restored = checkpoints.restore(abstract(state))
    checkpoints.close()
    assert step == 5 and np.array_equal(restored["params"]["w"], state["params"]["w"])
    assert lines == ["checkpoint step 5 predates checksums: restored unchecked"]


# 8. Loopback by default -------------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_metrics_server_binds_loopback_unless_told_otherwise():
    exporter = PrometheusExporter(free_port(), 0)
    try:
        assert exporter.server.server_address[0] == "127.0.0.1"
    finally:
        exporter.close()
    sinks = Sinks((free_port(), "0.0.0.0"), None, 0)                      # --metrics-host 0.0.0.0
    try:
        assert sinks.prometheus.server.server_address[0] == "0.0.0.0"
    finally:
        sinks.close()


def test_the_launchers_coordinator_listens_on_loopback_only(worker_path, capsys):
    assert launch(2, 1, ["listen"], module="launch_worker", timeout=120) == 0
    out = capsys.readouterr().out
    assert "[p0] coordinator listens on 127.0.0.1\n" in out, out

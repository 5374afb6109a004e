"""`jaxpar launch`: N local processes form one multi-process JAX job.

The children run tests/launch_worker.py (jaxpar.cli is not needed): it joins the
job, builds a mesh over every device of every process and sums a sharded array.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from jaxpar import launch as launch_mod
from jaxpar.config import ConfigError
from jaxpar.launch import add_launch_arguments, launch, run_launch

WORKER = "launch_worker"
TESTS_DIR = str(Path(__file__).resolve().parent)


@pytest.fixture
def worker_path(monkeypatch):
    """Make tests/launch_worker.py importable as a top-level module in the children."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))


class Recorder(io.TextIOBase):
    """A thread-safe text sink that can wait for a pattern to appear."""

    def __init__(self):
        self.text = ""
        self.cond = threading.Condition()

    def write(self, s):
        with self.cond:
            self.text += s
            self.cond.notify_all()
        return len(s)

    def wait_for(self, pattern, count=1, timeout=30.0):
        with self.cond:
            return self.cond.wait_for(lambda: len(re.findall(pattern, self.text)) >= count, timeout)


def _assert_whole_prefixed_lines(text, nproc):
    prefixes = tuple(f"[p{i}] " for i in range(nproc)) + ("jaxpar launch: ",)
    for line in text.splitlines():
        assert line.startswith(prefixes), line


def _assert_reaped(text):
    for pid in map(int, re.findall(r"pid=(\d+)", text)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_two_processes_form_one_eight_device_job(worker_path, capsys):
    t0 = time.monotonic()
    rc = launch(2, 4, ["run"], module=WORKER, timeout=60)
    elapsed = time.monotonic() - t0
    out = capsys.readouterr().out
    assert rc == 0, out
    for i in range(2):
        assert f"[p{i}] process={i}/2 devices=8 local=4" in out, out
        # 1 + 2 + ... + 16: every process sees the whole cross-process sum.
        assert f"[p{i}] sum=136\n" in out, out
    _assert_whole_prefixed_lines(out, 2)
    assert elapsed < 40


@pytest.mark.slow
def test_a_crashing_process_takes_the_job_down(worker_path):
    out = Recorder()
    t0 = time.monotonic()
    rc = launch(2, 4, ["crash"], module=WORKER, out=out, timeout=60)
    elapsed = time.monotonic() - t0
    assert rc == 3, out.text
    assert "[p1] crashing" in out.text
    assert "[p0] sum=" not in out.text        # process 0 was stopped inside the collective
    assert "exited with code 3" in out.text
    _assert_whole_prefixed_lines(out.text, 2)
    # Well before gloo's own 30 s timeout: the launcher, not JAX, ended process 0.
    assert elapsed < 20, elapsed


@pytest.mark.slow
def test_an_uncaught_exception_ends_its_process_at_once(worker_path):
    out = Recorder()
    t0 = time.monotonic()
    rc = launch(2, 4, ["raise"], module=WORKER, out=out, timeout=120)
    elapsed = time.monotonic() - t0
    assert rc == 1, out.text
    assert "[p1] RuntimeError: a bug in process 1" in out.text
    # Not distributed.shutdown_timeout_s (30 s) in JAX's exit barrier: the excepthook exits at once.
    assert elapsed < 25, elapsed


@pytest.mark.slow
def test_every_process_learns_of_a_notice_to_any_process_at_the_same_call(worker_path):
    """jaxpar's preemption agreement (train/agreement.py) between two processes: a notice to process 1 alone at
    call 2 is the answer of call 2 on both; a peer that announced leaving ends a wait for the others."""
    out = Recorder()
    assert launch(2, 1, ["agree"], module=WORKER, timeout=120, out=out) == 0, out.text
    for i in range(2):
        assert f"[p{i}] answers=[False, True, False]" in out.text, out.text
    assert "[p0] peer left" in out.text, out.text


@pytest.mark.slow
def test_timeout_stops_everything(worker_path):
    out = Recorder()
    t0 = time.monotonic()
    rc = launch(2, 1, ["sleep"], module=WORKER, out=out, timeout=3, grace=1)
    assert rc == 124, out.text
    assert time.monotonic() - t0 < 15
    assert "timed out" in out.text
    _assert_reaped(out.text)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_everything(worker_path, signum, code):
    out = Recorder()

    def interrupt():
        if out.wait_for(r"sleeping pid=", count=2):
            os.kill(os.getpid(), signum)

    previous = signal.getsignal(signal.SIGTERM)
    # Ctrl-C in a shell meets Python's own SIGINT handler; an earlier test in this worker may have left another
    old_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        rc = launch(2, 1, ["sleep"], module=WORKER, out=out, timeout=30, grace=1)
    finally:
        signal.signal(signal.SIGINT, old_sigint)
    assert rc == code, out.text
    assert signal.getsignal(signal.SIGTERM) is previous
    assert out.text.count("sleeping pid=") == 2
    _assert_reaped(out.text)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(nproc=0), "--nproc"),
        (dict(nproc=True), "--nproc"),
        (dict(cpu_devices=0), "--cpu-devices"),
        (dict(command=[]), "command"),
        (dict(port=70000), "--port"),
        (dict(timeout=0), "--timeout"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs, field):
    args = dict(nproc=2, cpu_devices=4, command=["train"])
    args.update(kwargs)
    command = args.pop("command")
    with pytest.raises(ConfigError) as err:
        launch(args.pop("nproc"), args.pop("cpu_devices"), command, **args)
    assert err.value.field == field


def test_cli_arguments_strip_the_separator(monkeypatch):
    seen = {}

    def fake_launch(nproc, cpu_devices, command, *, port=None, timeout=None, max_restarts=0, preempt_grace=300.0):
        seen.update(nproc=nproc, cpu_devices=cpu_devices, command=command, port=port, timeout=timeout)
        return 0

    monkeypatch.setattr(launch_mod, "launch", fake_launch)
    parser = add_launch_arguments(argparse.ArgumentParser(prog="jaxpar launch"))
    args = parser.parse_args(["--nproc", "3", "--cpu-devices", "2", "--timeout", "9",
                              "--", "train", "--set", "train.steps=5"])
    assert run_launch(args) == 0
    assert seen == dict(nproc=3, cpu_devices=2, command=["train", "--set", "train.steps=5"],
                        port=None, timeout=9.0)

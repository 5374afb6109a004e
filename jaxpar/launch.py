"""`jaxpar launch`: run N JAX processes on this machine as if they were N hosts.

Each child is `python -m jaxpar.cli <command> --cpu-devices M` with the
environment `jaxpar.mesh.init_distributed` reads (coordinator address, process
count, process id), so N processes x M CPU devices form one N*M-device job and
cross-process collectives run over gloo, the way they would run over the network
between real hosts.

The launcher relays every child's output line by line, prefixed with `[p{i}] `,
and supervises the job: the first child to fail takes the others down with it
(a survivor would otherwise block forever in a collective waiting for its dead
peer), Ctrl-C stops them all, and an optional timeout bounds the whole run.

Like torchrun's elastic agent, `--max-restarts K` then starts every process
again, up to K times, and a `train` command resumes from its last checkpoint
(`--auto-resume`). An attempt that ends with exit status 2 (bad input, refused before
any work: the same command would fail the same way) is not restarted. SIGTERM or
SIGUSR1 to the launcher is a preemption notice: it
is passed on to the children as SIGTERM, and the launcher waits for them to save
and exit (up to `--preempt-grace` seconds) instead of killing them mid-save. The
launcher exits 75 whenever the preemption save is durable: a process exited 75, or
process 0 wrote the saved step into the file the launcher names (`ENV_PREEMPTION_RECORD`),
also when a process was then killed on its way out.

The coordinator listens on 127.0.0.1 only (`JAX_COORDINATOR_BIND_ADDRESS`): JAX would
otherwise bind every interface, and its service has no authentication.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from jaxpar.checks import non_negative_seconds
from jaxpar.cluster.goodput import ENV_ATTEMPT_START, ENV_RESTARTS
from jaxpar.config import ConfigError
from jaxpar.env import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PREEMPTION_RECORD, ENV_PROCESS_ID, EXIT_PREEMPTED

# Seconds a child has to exit after SIGTERM before it gets SIGKILL. A process
# stuck in a JAX collective or inside XLA often does not act on SIGTERM at all.
KILL_GRACE_S = 3.0
PREEMPT_GRACE_S = 300.0   # a preempted child is finishing a step and saving: do not cut that short
_POLL_S = 0.05

EXIT_INTERRUPTED = 130   # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TIMEOUT = 124       # what coreutils `timeout` returns
EXIT_TERMINATED = 143    # 128 + SIGTERM
EXIT_BAD_INPUT = 2       # jaxpar's "refused before starting": deterministic, never worth a restart
COORDINATOR_HOST = "127.0.0.1"


class _Terminated(Exception):
    """The launcher itself got SIGTERM or SIGUSR1 (a batch system, `timeout`): a preemption notice."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _wait_all(procs: list[subprocess.Popen], seconds: float, saved: Path | None = None,
              grace: float = KILL_GRACE_S) -> None:
    """Wait up to `seconds` for every process to end; once `saved` exists (the save is durable), `grace` more."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if saved is not None and saved.exists():
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(_POLL_S)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_code(returncode: int) -> int:
    """A child's exit status as a shell reports it: killed by signal S -> 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def _relay(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    """Copy `stream` to `out` one whole line at a time, each line prefixed."""
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with lock:
                out.write(f"{prefix}{line}\n")
                out.flush()
    except (OSError, ValueError):
        pass   # the pipe went away under us; nothing left to relay
    finally:
        stream.close()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the child's whole process group (it leads its own session)."""
    if proc.poll() is not None:
        return
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, sig)
        else:  # pragma: no cover - not POSIX
            proc.kill() if sig == getattr(signal, "SIGKILL", None) else proc.terminate()
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every child still running, then SIGKILL whoever is left after `grace` seconds."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL_S)
    for p in procs:
        _signal(p, getattr(signal, "SIGKILL", signal.SIGTERM))
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable child
            pass


def restart_command(command: list[str]) -> list[str]:
    """The command a restarted attempt runs: a `train` continues its run from the last checkpoint."""
    if not command or command[0] != "train" or "--resume" in command:
        return list(command)
    kept = [arg for arg in command if arg not in ("--overwrite", "--auto-resume")]
    return [*kept, "--auto-resume"]


def _validate(nproc, cpu_devices, command, port, timeout, max_restarts=0) -> None:
    def positive_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if not positive_int(nproc):
        raise ConfigError("--nproc", f"must be an integer >= 1, got {nproc!r}")
    if not positive_int(cpu_devices):
        raise ConfigError("--cpu-devices", f"must be an integer >= 1, got {cpu_devices!r}")
    if not command:
        raise ConfigError("command", "give the jaxpar command to run after `--`, e.g. `-- train`")
    if port is not None and not (positive_int(port) and port <= 65535):
        raise ConfigError("--port", f"must be an integer in 1..65535, got {port!r}")
    if timeout is not None and not timeout > 0:
        raise ConfigError("--timeout", f"must be > 0 seconds, got {timeout!r}")
    if not (isinstance(max_restarts, int) and max_restarts >= 0):
        raise ConfigError("--max-restarts", f"must be an integer >= 0, got {max_restarts!r}")
    if max_restarts and command and command[0] == "train" and "--run-dir" not in command:
        raise ConfigError("--max-restarts", "a restarted `train` resumes its run: give it --run-dir DIR")


def launch(
    nproc: int,
    cpu_devices: int,
    command: list[str],
    *,
    port: int | None = None,
    timeout: float | None = None,
    module: str = "jaxpar.cli",
    out: IO[str] | None = None,
    grace: float = KILL_GRACE_S,
    max_restarts: int = 0,
    preempt_grace: float = PREEMPT_GRACE_S,
) -> int:
    """Run `python -m <module> <command> --cpu-devices M` as processes 0..N-1 of one job.

    Returns 0 when every process exits 0; the first non-zero exit code otherwise
    (the other processes are then stopped; a child killed by signal S counts as
    128 + S; 75 when a preemption save is durable or any process exited 75), after
    `max_restarts` restarts of all of them; 130 on Ctrl-C; on SIGTERM or SIGUSR1 to the
    launcher, 75 when the save is durable or a child exited 75, else 143; 124 when `timeout`
    seconds pass first. Children that do not exit within `grace` seconds of being stopped
    are killed. `out` (default: sys.stdout at call time) receives
    the children's output, each line prefixed with `[p{i}] `.
    """
    _validate(nproc, cpu_devices, command, port, timeout, max_restarts)
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    deadline = None if timeout is None else time.monotonic() + timeout
    # Children run in their own sessions, so a signal meant for the job reaches
    # only us: pass it on instead of dying and leaving them running.
    own_signals = threading.current_thread() is threading.main_thread()
    previous = {}
    if own_signals:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            previous[sig] = signal.signal(sig, _raise_terminated)
    try:
        for attempt in range(max_restarts + 1):
            argv = [sys.executable, "-m", module, *(restart_command(command) if attempt else command),
                    "--cpu-devices", str(cpu_devices)]
            status = _attempt(nproc, argv, port if port is not None and attempt == 0 else free_port(),
                              attempt, deadline, timeout, out, lock, grace, preempt_grace)
            if status in (0, EXIT_TIMEOUT, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_PREEMPTED):
                return status
            if status == EXIT_BAD_INPUT:
                with lock:
                    out.write("jaxpar launch: a process refused its input (exit 2); not restarting: "
                              "the same command would fail the same way\n")
                    out.flush()
                return status
            with lock:
                if attempt < max_restarts:
                    out.write(f"jaxpar launch: a process exited with code {status}; stopped the others; "
                              f"restart {attempt + 1}/{max_restarts} from the last checkpoint\n")
                else:
                    out.write(f"jaxpar launch: a process exited with code {status}; stopped the others\n")
                out.flush()
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _attempt(nproc, argv, port, attempt, deadline, timeout, out, lock, grace, preempt_grace) -> int:
    """Start the N processes once and supervise them until they end; returns the job's status."""
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    status = 0
    records = tempfile.TemporaryDirectory(prefix="jaxpar-launch-")
    saved = Path(records.name) / "preemption-saved"   # process 0 writes it once a preemption save is durable
    try:
        started = time.time()
        for i in range(nproc):
            env = dict(os.environ)
            env.update({
                ENV_COORDINATOR: f"{COORDINATOR_HOST}:{port}",
                "JAX_COORDINATOR_BIND_ADDRESS": f"{COORDINATOR_HOST}:{port}",
                ENV_NUM_PROCESSES: str(nproc),
                ENV_PROCESS_ID: str(i),
                ENV_RESTARTS: str(attempt),
                ENV_ATTEMPT_START: repr(started),
                ENV_PREEMPTION_RECORD: str(saved),
                "PYTHONUNBUFFERED": "1",
            })
            # Simulated hosts are CPU hosts: on a GPU machine every child would
            # otherwise try to claim all of the GPUs. An explicit setting wins.
            env.setdefault("JAX_PLATFORMS", "cpu")
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Own session: Ctrl-C reaches only the launcher, which then stops
                # the children itself, and a signal reaches a child's own children too.
                start_new_session=True,
            )
            procs.append(proc)
            t = threading.Thread(target=_relay, args=(proc.stdout, f"[p{i}] ", out, lock),
                                 name=f"jaxpar-relay-p{i}", daemon=True)
            t.start()
            relays.append(t)

        while True:
            codes = [p.poll() for p in procs]
            failed = [_exit_code(c) for c in codes if c not in (None, 0)]
            if failed:
                status = _first_failure(procs, failed, saved)
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() >= deadline:
                with lock:
                    out.write(f"jaxpar launch: timed out after {timeout:g} s; stopping all processes\n")
                    out.flush()
                status = EXIT_TIMEOUT
                break
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
    except _Terminated:
        with lock:
            out.write("jaxpar launch: preemption signal; asking every process to save and stop\n")
            out.flush()
        for p in procs:
            _signal(p, signal.SIGTERM)
        _wait_all(procs, preempt_grace, saved, grace)
        # Exit 75 or the record means the checkpoint is durable; a peer still on its way out may have been
        # killed meanwhile (JAX's distributed service aborts it once process 0, which hosts it, is gone).
        codes = [_exit_code(p.returncode) for p in procs if p.poll() is not None]
        status = EXIT_PREEMPTED if EXIT_PREEMPTED in codes or saved.exists() else EXIT_TERMINATED
    finally:
        _stop_all(procs, grace)
        for t in relays:
            t.join(timeout=grace)
        records.cleanup()
    return status


def _first_failure(procs: list[subprocess.Popen], failed: list[int], saved: Path) -> int:
    """The job's status once a process failed: 75 when the preemption save is durable or a process exited 75
    (its peers may die with it: JAX's distributed service aborts them), else the first failure's."""
    if EXIT_PREEMPTED not in failed:   # a peer seen first may have died only because a preempted process left
        time.sleep(_POLL_S)
        failed += [_exit_code(c) for c in (p.poll() for p in procs) if c not in (None, 0)]
    return EXIT_PREEMPTED if EXIT_PREEMPTED in failed or saved.exists() else failed[0]


def add_launch_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of `jaxpar launch`."""
    parser.add_argument("--nproc", type=int, default=2,
                        help="number of processes (simulated hosts) to start (default: 2)")
    parser.add_argument("--cpu-devices", type=int, default=4,
                        help="CPU devices each process gets; the job has nproc x this many (default: 4)")
    parser.add_argument("--port", type=int, default=None,
                        help="coordinator port on 127.0.0.1 (default: a free port)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop every process after this many seconds and exit 124 (default: none)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="when a process fails, restart all of them up to this many times; a train "
                             "command resumes from its last checkpoint (default: 0)")
    parser.add_argument("--preempt-grace", type=non_negative_seconds, default=PREEMPT_GRACE_S,
                        help="seconds the processes get to save after SIGTERM/SIGUSR1 (default: 300)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the jaxpar command each process runs, after `--`, e.g. `-- train --set train.steps=20`")
    return parser


def run_launch(args: argparse.Namespace) -> int:
    """Run `jaxpar launch` from parsed arguments."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return launch(args.nproc, args.cpu_devices, command, port=args.port, timeout=args.timeout,
                  max_restarts=args.max_restarts, preempt_grace=args.preempt_grace)

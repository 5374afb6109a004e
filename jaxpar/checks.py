"""Checks of command-line values that can be made before anything is imported, loaded or built.

Each raises `ConfigError` naming the argument, so that bad input costs one line and
a fraction of a second, and never leaves a file behind. Nothing here imports JAX.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import tempfile
from pathlib import Path

from jaxpar.config import ConfigError
from jaxpar.env import ENV_NUM_PROCESSES


def writable_dir(path, field: str) -> None:
    """`path` is, or can become, a directory this process may write (probed with a temporary file)."""
    path = Path(path)
    try:
        nearest = next(p for p in (path, *path.absolute().parents) if p.exists())
    except OSError as err:   # a name too long for the file system; a working folder deleted under this process
        shown = f"{str(path)[:40]}...' ({len(str(path))} characters)" if len(str(path)) > 60 else f"{path}'"
        cause = err.strerror or type(err).__name__
        if isinstance(err, FileNotFoundError):   # only os.getcwd() raises it here (exists() says False)
            cause = "the working folder was deleted; cd to an existing folder or give an absolute path"
        raise ConfigError(field, f"'{shown} cannot be used: {cause}; choose another {field}") from None
    try:
        if not nearest.is_dir():
            raise NotADirectoryError(nearest)
        tempfile.TemporaryFile(dir=nearest).close()   # a real probe: permissions, read-only mounts, /proc
    except OSError as err:
        raise ConfigError(field, f"'{path}' cannot be written ({nearest}: "
                          f"{err.strerror or type(err).__name__}); choose another {field}") from None


def writable_file(path, field: str) -> None:
    """`path` names a file (not a folder) in a folder this process may write."""
    if Path(path).is_dir():
        raise ConfigError(field, f"'{path}' is a directory; give a file name")
    writable_dir(Path(path).absolute().parent, field)


def _bind(host: str, port: int) -> None:
    """Bind `host`:`port` the way an HTTP server binds it (so the answer is the server's), then let go."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]   # IPv4 or IPv6, as the server picks
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def bindable_address(host: str, field: str) -> None:
    """`host` is an address of this machine that a server can listen on."""
    try:
        _bind(host, 0)
    except OSError as err:   # also socket.gaierror: not an address at all
        raise ConfigError(field, f"cannot listen on '{host}' ({err.strerror or err}); give an address of this "
                          "machine, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None


def metrics_address(port: int | None, host: str | None) -> str:
    """`train --metrics-port/--metrics-host`: a port in range, an address of this machine (only beside a port);
    returns the address to bind (loopback by default: the endpoint has no authentication)."""
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError("--metrics-port", f"must be in 1..65535, got {port}")
    if host is None:
        return "127.0.0.1"
    if port is None:
        raise ConfigError("--metrics-host", "is the metrics server's address: give --metrics-port PORT too")
    bindable_address(host, "--metrics-host")
    return host


def port_free(port: int, field: str, host: str = "0.0.0.0") -> None:
    """Nothing listens on `port` of `host` (an address `bindable_address` accepted)."""
    try:
        _bind(host, port)
    except OSError as err:
        raise ConfigError(field, f"cannot listen on port {port} ({err.strerror}); choose another port") from None


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"is {text}; give a number of seconds >= 0")
    return value


def sample_arguments(run_dir, prompt: str, max_tokens: int, temperature: float, top_k: int) -> None:
    """`jaxpar sample`: a run directory, a prompt that is text, sampling settings a sampler can use."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file() or not (run_dir / "tokenizer.json").is_file():
        raise ConfigError("--run-dir", f"'{run_dir}' is not a jaxpar run directory (no config.json / tokenizer.json)")
    if max_tokens <= 0:
        raise ConfigError("--max-tokens", f"is {max_tokens}; must be positive")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt", "is not valid UTF-8 text; give the prompt in UTF-8") from None
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError("--temperature", f"is {temperature}; give 0 (greedy) or a positive number, e.g. 0.8")
    if top_k < 0:
        raise ConfigError("--top-k", f"is {top_k}; give 0 (every token) or a positive count, e.g. 20")
    if top_k:
        from tokenizers import Tokenizer
        vocab = Tokenizer.from_file(str(run_dir / "tokenizer.json")).get_vocab_size()
        if top_k > vocab:
            raise ConfigError("--top-k", f"is {top_k} but the run's vocabulary has {vocab} tokens; "
                              f"give 0 (every token) or 1..{vocab}")


def add_config_arguments(p: argparse.ArgumentParser, *, config_help: str | None = None, default: str | None = None,
                         set_help: str | None = None, config: bool = True) -> None:
    """`--config FILE` and `--set FIELD=VALUE` (repeatable, into `overrides`), the same in every command; a command
    says what its default config is (`config_help`) and what `--set` applies to (`set_help`)."""
    if config:
        p.add_argument("--config", metavar="FILE", default=default,
                       help=config_help or "config file defining get_config() (default: the embedded default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help=set_help or "override a config field, e.g. --set model.layers=4 --set mesh.fsdp=8 (repeatable)")


def config_before_jax(config, cpu_devices: int | None, resumed: bool, environ=os.environ) -> None:
    """Every config check that needs no device, before JAX is imported (which takes a minute on a loaded machine).

    The fields alone; then the mesh and parallel checks of `config_checks.validate` wherever the job's device
    count is known without JAX: `--cpu-devices N` on the CPU platform gives N per process (the processes that
    `jaxpar launch` or Slurm start). Otherwise the mesh's product stands in for the device count (`make_mesh`
    compares it with the real devices once JAX has them), a -1 axis counted as 1: the checks that depend on its
    size are divisibility by it, which a smaller size cannot fail where the real one passes; except that
    sequence parallelism refuses mesh.tensor=1, so a -1 tensor waits for JAX. Where JAX is imported already
    (the command run in-process), the real devices are a moment away and the stand-in is not used.
    """
    from jaxpar.config import mesh_axes, validate, validate_fields
    validate_fields(config)
    processes = int(environ.get(ENV_NUM_PROCESSES) or (environ.get("SLURM_STEP_ID") and environ.get("SLURM_NTASKS"))
                    or 1)
    if cpu_devices and cpu_devices > 0 and environ.get("JAX_PLATFORMS") == "cpu":
        devices = cpu_devices * processes
    elif int(config.mesh.tensor) > 0 and "jax" not in sys.modules:
        devices = math.prod(max(int(config.mesh[axis]), 1) for axis in mesh_axes())
    else:
        return
    validate(config, devices, processes=None if resumed else processes,
             platform="cpu" if cpu_devices and processes == 1 else None)

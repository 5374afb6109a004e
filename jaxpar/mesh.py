"""The device mesh and multi-process start-up.

One mesh with six named axes (and any a registered strategy adds, jaxpar/strategies.py)
serves every strategy; a strategy is a choice of axis sizes. The mesh uses
`AxisType.Auto` axes: sharding annotations are hints to XLA's SPMD partitioner
(GSPMD), which inserts the collectives, the behaviour MaxText-style logical-axis
rules are written for.
"""
from __future__ import annotations

import os
import sys
import traceback

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config import ConfigError, mesh_axes, validate
from jaxpar.env import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def set_cpu_devices(count: int | None) -> None:
    """Give the CPU backend `count` virtual devices; must run before JAX starts a backend."""
    if count is None:
        return
    if count < 1:
        raise ConfigError("--cpu-devices", f"is {count}; give a positive device count, e.g. --cpu-devices 8")
    jax.config.update("jax_num_cpu_devices", int(count))


def distributed_args(environ) -> dict | None:
    """The `jax.distributed.initialize` arguments an environment asks for, or None for a single process.

    `jaxpar launch` and the Kubernetes manifests (jaxpar/cluster/k8s.py) set the JAXPAR_*
    variables; inside a Slurm step (`srun`, more than one task) JAX detects the cluster itself
    and gets no address arguments.
    """
    if environ.get(ENV_COORDINATOR):
        return {"coordinator_address": environ[ENV_COORDINATOR],
                "num_processes": int(environ[ENV_NUM_PROCESSES]),
                "process_id": int(environ[ENV_PROCESS_ID])}
    if int(environ.get("SLURM_NTASKS", "1")) > 1 and environ.get("SLURM_STEP_ID"):
        return {}
    return None


def init_distributed(settings=None) -> None:
    """Join a multi-process job when one is configured; a no-op for a single process.

    `settings` is the config's `distributed` section (None: the defaults). A dead peer is
    noticed after `heartbeat_timeout_s`, not JAX's 100 s, and an uncaught exception exits the
    process at once instead of waiting in JAX's shutdown barrier (300 s by default) while its
    peers hang: the scheduler (Slurm's --kill-on-bad-exit, a JobSet's failure policy, `jaxpar
    launch`) then restarts or ends the whole job.
    """
    args = distributed_args(os.environ)
    if args is None:
        return
    if settings is None:
        from jaxpar.config import base_config
        settings = base_config().distributed
    # jaxpar handles preemption notices itself (train/preemption.py): JAX's service would take SIGTERM over
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(**args, heartbeat_timeout_seconds=int(settings.heartbeat_timeout_s),
                               shutdown_timeout_seconds=int(settings.shutdown_timeout_s))
    sys.excepthook = _exit_at_once


def _exit_at_once(kind, value, tb) -> None:
    """Print the traceback, then leave without JAX's shutdown barrier (os._exit skips atexit)."""
    traceback.print_exception(kind, value, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def make_mesh(config, devices=None, *, resumed: bool = False) -> Mesh:
    """Build the mesh the config asks for (`mesh_axes()`: data, fsdp, pipe, expert, context, tensor after any
    added axes), after validating it.

    A fresh run's train.fault_process must name a process of this job; a `resumed` run keeps the drill
    setting it started with, which on a job of fewer processes (an elastic resume) simply never fires.

    Devices are laid out in `jax.devices()` order (process-major), so the innermost
    axis, `tensor`, spans neighbouring devices: on a GPU node these share NVLink.
    """
    whole_job = devices is None   # the run's own mesh: its process count bounds train.fault_process
    devices = list(jax.devices() if whole_job else devices)
    sizes = validate(config, len(devices), processes=jax.process_count() if whole_job and not resumed else None,
                     platform=devices[0].platform if whole_job and jax.process_count() == 1 else None)
    axes = mesh_axes()
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes[axis] for axis in axes))
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def describe(mesh: Mesh) -> str:
    used = [f"{name}={size}" for name, size in mesh.shape.items() if size > 1]
    return " x ".join(used) or "single device"

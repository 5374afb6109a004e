"""The device mesh and multi-process start-up.

One mesh with five named axes serves every strategy; a strategy is a choice of
axis sizes. The mesh uses `AxisType.Auto` axes: sharding annotations are hints
to XLA's SPMD partitioner (GSPMD), which inserts the collectives, the behaviour
MaxText-style logical-axis rules are written for.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config import MESH_AXES, ConfigError, validate

# Environment the local launcher (`jaxpar launch`) sets for each process it starts.
ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"


def set_cpu_devices(count: int | None) -> None:
    """Give the CPU backend `count` virtual devices; must run before JAX starts a backend."""
    if count is None:
        return
    if count < 1:
        raise ConfigError("--cpu-devices", f"is {count}; give a positive device count, e.g. --cpu-devices 8")
    jax.config.update("jax_num_cpu_devices", int(count))


def init_distributed() -> None:
    """Join a multi-process job when one is configured; a no-op for a single process.

    Under `jaxpar launch` the coordinator comes from the environment; under Slurm
    (`srun`) JAX detects the cluster itself.
    """
    if os.environ.get(ENV_COORDINATOR):
        jax.distributed.initialize(
            coordinator_address=os.environ[ENV_COORDINATOR],
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=int(os.environ[ENV_PROCESS_ID]),
        )
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 and os.environ.get("SLURM_STEP_ID"):
        jax.distributed.initialize()


def make_mesh(config, devices=None) -> Mesh:
    """Build the (data, fsdp, pipe, expert, tensor) mesh the config asks for, after validating it.

    Devices are laid out in `jax.devices()` order (process-major), so the innermost
    axis, `tensor`, spans neighbouring devices: on a GPU node these share NVLink.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = validate(config, len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    used = [f"{name}={size}" for name, size in mesh.shape.items() if size > 1]
    return " x ".join(used) or "single device"

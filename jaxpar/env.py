"""What a launcher and the processes it starts agree on: environment variable names, exit codes, the platform.

`jaxpar launch`, the Slurm script and the Kubernetes manifests set these variables and read
these statuses; keeping them here (no JAX import) lets those commands start in a fraction of
a second.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

# Environment the local launcher and the Kubernetes pods set for each process (jaxpar/mesh.py reads it).
ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"

EXIT_BAD_INPUT = 2    # a configuration error: restarting cannot help
EXIT_PREEMPTED = 75   # EX_TEMPFAIL: "try again later"; saved after a preemption notice, the Slurm script requeues

# Device files of the accelerators JAX has plugins for: NVIDIA (CUDA), AMD (ROCm), TPU (accel*, vfio groups).
ACCELERATOR_DEVICE_FILES = ("nvidiactl", "nvidia[0-9]*", "kfd", "accel[0-9]*", "vfio/[0-9]*")


def has_accelerator(dev: Path = Path("/dev")) -> bool:
    """Whether this machine shows a GPU or TPU device file (no JAX import, no driver call)."""
    return any(any(dev.glob(pattern)) for pattern in ACCELERATOR_DEVICE_FILES)


def cpu_platform_only(environ: Mapping[str, str], wants_cpu: bool, dev: Path = Path("/dev")) -> bool:
    """Whether a command starts JAX with JAX_PLATFORMS=cpu.

    Yes when the command runs on (virtual) CPU devices (`wants_cpu`: --cpu-devices, a dry run) or the
    machine has no accelerator: otherwise an installed CUDA plugin (the deviceless GPU compiles need it)
    looks for a GPU at every start and prints a ~25-line "Unable to load CUDA" traceback. A deviceless
    compile does not need the GPU platform: it compiles for a topology (measure/targets.py). The user's
    JAX_PLATFORMS, when set, always wins.
    """
    if "JAX_PLATFORMS" in environ:
        return False
    return wants_cpu or not has_accelerator(dev)

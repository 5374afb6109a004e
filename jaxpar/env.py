"""What a launcher and the processes it starts agree on: environment variable names, exit codes, the platform.

`jaxpar launch`, the Slurm script and the Kubernetes manifests set these variables and read
these statuses; keeping them here (no JAX import) lets those commands start in a fraction of
a second.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

# Environment the local launcher and the Kubernetes pods set for each process (jaxpar/mesh.py reads it).
ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
# A file `jaxpar launch` names: process 0 writes the step there once a preemption save of it is durable.
ENV_PREEMPTION_RECORD = "JAXPAR_PREEMPTION_RECORD"

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


# XLA:GPU's pipelined collectives, as MaxText runs with them: in a layer loop, the next iteration's all-gather
# (and this one's reduce-scatter / all-reduce) is moved across the loop boundary, and the loop body double-buffered,
# so the scheduler can hide it behind a whole layer's compute. Measured by the filer of issue 29 on a deviceless H100
# compile of the 7B at fsdp=64: 57.7% of the communication hidden with them, 50.9% without (`jaxpar lab overlap`
# compiles both: its "pipelined off" rows).
PIPELINED_COLLECTIVES = ("--xla_gpu_enable_pipelined_all_gather", "--xla_gpu_enable_pipelined_reduce_scatter",
                         "--xla_gpu_enable_pipelined_all_reduce", "--xla_gpu_enable_while_loop_double_buffering")
GPU_DEVICE_FILES = ("nvidiactl", "nvidia[0-9]*")


def compiles_for_gpu(environ: Mapping[str, str], wants_cpu: bool, gpu_target: bool = False,
                     dev: Path = Path("/dev")) -> bool:
    """Whether a command's XLA compiles for an NVIDIA GPU: a deviceless compile for a GPU target, JAX_PLATFORMS
    naming CUDA, or (JAX_PLATFORMS unset) a machine with an NVIDIA GPU the command does not keep to CPU devices."""
    if gpu_target:
        return True
    if "JAX_PLATFORMS" in environ:
        return any(p.strip() in ("cuda", "gpu") for p in environ["JAX_PLATFORMS"].split(","))
    return not wants_cpu and any(any(dev.glob(pattern)) for pattern in GPU_DEVICE_FILES)


def with_gpu_defaults(xla_flags: str) -> str:
    """XLA_FLAGS with jaxpar's GPU defaults (PIPELINED_COLLECTIVES on) added; a flag the user set, on or off, stays
    as the user set it. XLA reads XLA_FLAGS once, when its first backend starts: set it before that."""
    present = {word.split("=", 1)[0] for word in xla_flags.split()}
    added = [f"{flag}=true" for flag in PIPELINED_COLLECTIVES if flag not in present]
    return " ".join([*xla_flags.split(), *added])


def start_platform(args) -> None:
    """Before JAX starts (`jaxpar` calls this first): JAX on the CPU platform alone where the command runs on CPU
    devices (`cpu_platform_only`), jaxpar's GPU XLA_FLAGS where it compiles for a GPU (`with_gpu_defaults`). The
    variables also reach the processes the command starts."""
    wants_cpu = bool(getattr(args, "cpu_devices", None)) or args.subcommand == "dryrun"
    gpu_target = args.subcommand == "dryrun" and getattr(args, "target", "cpu") != "cpu"
    if compiles_for_gpu(os.environ, wants_cpu, gpu_target):
        os.environ["XLA_FLAGS"] = with_gpu_defaults(os.environ.get("XLA_FLAGS", ""))
    if cpu_platform_only(os.environ, wants_cpu):
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:   # imported already: the variable is read at import, the setting still applies
            sys.modules["jax"].config.update("jax_platforms", "cpu")

"""Where a dry run compiles: N virtual CPU devices, or a GPU topology compiled deviceless.

  cpu               N virtual CPU devices (`jax_num_cpu_devices`, fixed before JAX starts).
  h100, h200, a100  a real XLA:GPU compile with no GPU: a topology described by jaxpar's own
                    GpuTargetConfigProto files (measure/gpu_targets/) and the CUDA PJRT plugin
                    wheels (which compile without a GPU). Topology PxHxG = partitions x hosts x
                    GPUs per host.
"""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from jaxpar.config import ConfigError

GPU_TARGETS = {   # target -> (GpuTargetConfigProto file, jaxpar.measure.hardware.ACCELERATORS key)
    "h100": ("h100.txtpb", "H100-SXM"),
    "h200": ("h200.txtpb", "H200-SXM"),
    "a100": ("a100.txtpb", "A100-SXM-80GB"),
}
TARGETS = ("cpu", *GPU_TARGETS)
TARGET_DIR = Path(__file__).parent / "gpu_targets"


def parse_topology(text: str) -> tuple[int, int, int]:
    """'1x8x8' -> (partitions, hosts, gpus_per_host)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", text or "")
    if not m or min(int(g) for g in m.groups()) < 1:
        raise ConfigError("--topology", f"'{text}' is not PxHxG (partitions x hosts x gpus_per_host), e.g. 1x8x8")
    partitions, hosts, gpus = (int(g) for g in m.groups())
    return partitions, hosts, gpus


def gpu_plugin_problem() -> str | None:
    """Why a deviceless GPU compile cannot run here (None: it can): the CUDA plugin wheels must match jaxlib."""
    jaxlib = metadata.version("jaxlib")
    for cuda in ("cuda12", "cuda13"):
        versions: list[str | None] = []
        for dist in (f"jax-{cuda}-plugin", f"jax-{cuda}-pjrt"):
            try:
                versions.append(metadata.version(dist))
            except metadata.PackageNotFoundError:
                versions.append(None)
        if versions == [jaxlib, jaxlib]:
            return None
        if any(versions):
            return (f"found jax-{cuda}-plugin {versions[0]} / jax-{cuda}-pjrt {versions[1]} but jaxlib is {jaxlib}; "
                    f"pip install --no-deps jax-{cuda}-plugin=={jaxlib} jax-{cuda}-pjrt=={jaxlib}")
    return (f"a deviceless GPU compile needs the jax-cuda12-plugin and jax-cuda12-pjrt wheels matching jaxlib "
            f"{jaxlib}: pip install --no-deps jax-cuda12-plugin=={jaxlib} jax-cuda12-pjrt=={jaxlib} "
            "(a separate venv is fine; no GPU needed)")


def prepare_process(target: str, devices: int | None) -> None:
    """Process-wide JAX settings a dry run needs; call before JAX starts a backend (the CLI does).

    cpu: the virtual device count. GPU targets: keep JAX on the CPU platform, so the
    installed CUDA plugin does not look for a GPU; the compile goes through the topology.
    """
    import jax
    if target == "cpu":
        if devices:
            try:
                jax.config.update("jax_num_cpu_devices", int(devices))
            except RuntimeError:   # JAX already started: `target_devices` reports a count mismatch
                pass
    elif target in GPU_TARGETS:
        jax.config.update("jax_platforms", "cpu")


def target_devices(target: str, devices=None, topology: str | None = None) -> tuple[list, dict]:
    """The devices to compile for and a description of the machine they form."""
    import jax
    if target not in TARGETS:
        raise ConfigError("--target", f"unknown target '{target}'; valid: {', '.join(TARGETS)}")
    if target == "cpu":
        if topology:
            raise ConfigError("--topology", "applies to GPU targets only; for cpu give --devices N")
        available = jax.devices("cpu")
        if devices is None:
            chosen = available
        elif isinstance(devices, int):
            if devices != len(available):
                raise ConfigError("--devices", f"{devices} CPU devices asked for but JAX started with "
                                  f"{len(available)}; the count is fixed before JAX starts: run "
                                  f"`jaxpar dryrun --target cpu --devices {devices}` in a fresh process")
            chosen = available
        else:
            chosen = list(devices)
        return chosen, {"target": "cpu", "platform": "cpu", "hosts": 1, "gpus_per_host": len(chosen),
                        "accelerator": None, "topology": None}

    file, accelerator = GPU_TARGETS[target]
    if topology is None:
        if not devices:
            raise ConfigError("--topology", f"target {target} needs --topology PxHxG (e.g. 1x8x8) or --devices N")
        n = int(devices)
        topology = f"1x1x{n}" if n <= 8 else (f"1x{n // 8}x8" if n % 8 == 0 else None)
        if topology is None:
            raise ConfigError("--devices", f"{n} GPUs do not fill 8-GPU hosts; give --topology PxHxG")
    partitions, hosts, per_host = parse_topology(topology)
    if devices is not None and not isinstance(devices, int):
        raise ConfigError("--devices", "GPU targets take a device count, not a device list")
    if devices and devices != partitions * hosts * per_host:
        raise ConfigError("--devices", f"{devices} does not match --topology {topology} "
                          f"= {partitions * hosts * per_host} GPUs")
    problem = gpu_plugin_problem()
    if problem:
        raise ConfigError("--target", problem)
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=(TARGET_DIR / file).read_text(),
                                            topology=topology)
    except Exception as err:   # noqa: BLE001 - XLA's error, reduced to one line
        raise ConfigError("--topology", f"XLA rejected {target} topology {topology}: "
                          f"{str(err).strip().splitlines()[0][:200]}") from None
    return list(topo.devices), {"target": target, "platform": "gpu", "hosts": partitions * hosts,
                                "gpus_per_host": per_host, "accelerator": accelerator, "topology": topology}

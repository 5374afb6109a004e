"""Peak figures the labs divide by: published accelerator specs, and a measured CPU host.

Every figure is per device and *dense* (NVIDIA datasheets print tensor-core
throughput "with sparsity", which is 2x the dense figure; we halve those).

Link bandwidth convention: `link_bw` is bytes per second **per GPU per direction**
(unidirectional). NVIDIA quotes NVLink as the bidirectional total ("900 GB/s" for
H100 = 450 GB/s each way); nccl-tests' bus bandwidth (busbw) is a per-direction
figure, so it is the per-direction number a busbw should be compared to.
`scaleout_bw` is the inter-node network per GPU per direction (one 400 Gb/s
InfiniBand NDR port per GPU = 50 GB/s).

On CPU there is no datasheet: `probe_host` measures a float32 matmul and a memory
copy, and the virtual CPU devices of one process share those cores and that memory.
A training run's MFU divides by the host's matmul peak probed once and kept (`host_matmul_peak`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import re
import time

import numpy as np

from jaxpar.units import GB

TERA = 1e12

# InfiniBand NDR, 400 Gb/s per port, one port per GPU on HGX H100/H200 nodes: 400/8 = 50 GB/s per direction.
INFINIBAND_NDR_PER_GPU = 50 * GB
# Assumptions (no GPU was measured for them): achieved busbw / per-direction datasheet bandwidth, and
# α. nccl-tests all-reduce on one 8-GPU NVLink node and across NDR InfiniBand nodes reaches roughly 80% of
# the link figure at large messages; small-message latencies of ~10 µs (NVLink) and ~25 µs (InfiniBand).
# The planner (plan/fleet.py) and the schedule replay (measure/overlap.py) both use them.
LINK_EFFICIENCY = 0.8
ALPHA_NVLINK_S = 10e-6
ALPHA_INFINIBAND_S = 25e-6


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Peak figures of one device. FLOP/s are dense; bandwidths are bytes/s; None = not applicable."""

    name: str
    bf16_flops: float | None      # dense tensor-core bf16
    fp8_flops: float | None       # dense tensor-core fp8 (None: no fp8 tensor cores)
    fp32_flops: float | None      # plain fp32 (CUDA cores); the CPU probe's measured matmul
    tf32_flops: float | None      # dense TF32 tensor core: what an XLA f32 dot uses on Ampere/Hopper by default
    hbm_bytes: float | None       # device memory
    hbm_bw: float | None          # device memory bandwidth
    link_bw: float | None         # scale-up link per device per direction (NVLink); CPU: measured memcpy
    scaleout_bw: float | None     # scale-out network per device per direction
    source: str                   # where the numbers come from
    kinds: tuple[str, ...] = ()   # regexes matched against jax's `device.device_kind` (lower-cased)


@dataclasses.dataclass(frozen=True)
class GPU(Accelerator):
    """A datasheet GPU: every figure but fp8 is published."""

    bf16_flops: float
    fp32_flops: float
    tf32_flops: float
    hbm_bytes: float
    hbm_bw: float
    link_bw: float
    scaleout_bw: float


ACCELERATORS: dict[str, GPU] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 column): FP32 67 TF, TF32 989 TF*, BF16 1,979 TF*,
    # FP8 3,958 TF* (* with sparsity, halved here), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (bidirectional).
    "H100-SXM": GPU(
        name="NVIDIA H100 SXM5 80GB", bf16_flops=989 * TERA, fp8_flops=1979 * TERA,
        fp32_flops=67 * TERA, tf32_flops=494.5 * TERA, hbm_bytes=80 * GB, hbm_bw=3.35 * TERA,
        link_bw=450 * GB, scaleout_bw=INFINIBAND_NDR_PER_GPU,
        source="NVIDIA H100 datasheet, SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s bidir",
        kinds=(r"h100.*(sxm|hbm3)",)),
    # Same datasheet, PCIe column: BF16 1,513 TF*, FP8 3,026 TF*, FP32 51 TF, TF32 756 TF*, 80 GB HBM2e at
    # 2 TB/s, NVLink bridge 600 GB/s (bidirectional).
    "H100-PCIe": GPU(
        name="NVIDIA H100 PCIe 80GB", bf16_flops=756 * TERA, fp8_flops=1513 * TERA,
        fp32_flops=51 * TERA, tf32_flops=378 * TERA, hbm_bytes=80 * GB, hbm_bw=2.0 * TERA,
        link_bw=300 * GB, scaleout_bw=INFINIBAND_NDR_PER_GPU,
        source="NVIDIA H100 datasheet, PCIe: 756 TFLOP/s bf16 dense, 2 TB/s HBM2e, NVLink bridge 600 GB/s bidir",
        kinds=(r"h100.*pcie",)),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s (bidirectional).
    "H200-SXM": GPU(
        name="NVIDIA H200 SXM 141GB", bf16_flops=989 * TERA, fp8_flops=1979 * TERA,
        fp32_flops=67 * TERA, tf32_flops=494.5 * TERA, hbm_bytes=141 * GB, hbm_bw=4.8 * TERA,
        link_bw=450 * GB, scaleout_bw=INFINIBAND_NDR_PER_GPU,
        source="NVIDIA H200 datasheet, SXM: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, NVLink 900 GB/s bidir",
        kinds=(r"h200(?!.*nvl)",)),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): FP32 19.5 TF, TF32 156 TF (312*), BF16 312 TF (624*),
    # no FP8, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (bidirectional). HDR InfiniBand 200 Gb/s = 25 GB/s.
    "A100-SXM-80GB": GPU(
        name="NVIDIA A100 SXM4 80GB", bf16_flops=312 * TERA, fp8_flops=None,
        fp32_flops=19.5 * TERA, tf32_flops=156 * TERA, hbm_bytes=80 * GB, hbm_bw=2.039 * TERA,
        link_bw=300 * GB, scaleout_bw=25 * GB,
        source="NVIDIA A100 datasheet, 80GB SXM: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, NVLink 600 GB/s bidir",
        kinds=(r"a100.*sxm.*80gb",)),
    # Same datasheet, 40GB SXM: 40 GB HBM2 at 1,555 GB/s, otherwise as the 80GB part.
    "A100-SXM-40GB": GPU(
        name="NVIDIA A100 SXM4 40GB", bf16_flops=312 * TERA, fp8_flops=None,
        fp32_flops=19.5 * TERA, tf32_flops=156 * TERA, hbm_bytes=40 * GB, hbm_bw=1.555 * TERA,
        link_bw=300 * GB, scaleout_bw=25 * GB,
        source="NVIDIA A100 datasheet, 40GB SXM: 312 TFLOP/s bf16 dense, 1.555 TB/s HBM2, NVLink 600 GB/s bidir",
        kinds=(r"a100.*sxm.*40gb",)),
}


def lookup(device_kind: str) -> GPU | None:
    """The table entry for a `jax.Device.device_kind` string ("NVIDIA H100 80GB HBM3", "NVIDIA H200", ...)."""
    kind = device_kind.lower()
    for acc in ACCELERATORS.values():
        if any(re.search(pattern, kind) for pattern in acc.kinds):
            return acc
    return None


def _best_time(fn, budget_s: float, min_reps: int = 5, max_reps: int = 200) -> tuple[float, int]:
    """The shortest of repeated runs of `fn` within `budget_s`, and how many ran.

    A peak is what the host can do, so the best run counts: on a shared host every other
    run is slowed by whatever else was running (the median under load is not a peak).
    """
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), len(times)


def _host_memory_bytes() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


@dataclasses.dataclass(frozen=True)
class HostProbe(Accelerator):
    """`probe_host`'s figures: the rates it measures are always there (the memory size may be unknown)."""

    fp32_flops: float
    hbm_bw: float
    link_bw: float


@functools.cache
def probe_host(seconds_budget: float = 1.0) -> HostProbe:
    """Measure this host: float32 matmul FLOP/s (jitted 1024^3 jnp.dot on one device) and memcpy bytes/s.

    Each is the best of several short runs (`_best_time`). memcpy bandwidth counts each byte
    once (bytes copied per second; STREAM's "Copy" would count read + write, 2x this).
    Cached per process: the first call costs ~`seconds_budget`. The device is one of this
    process's own: in a multi-process job `jax.devices()[0]` belongs to process 0, and a
    matmul placed there runs nothing here (it timed a peak 20,000x too high).
    """
    import jax
    import jax.numpy as jnp

    n = 1024
    device = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32), device)
    b = jax.device_put(np.random.default_rng(1).standard_normal((n, n), dtype=np.float32), device)
    matmul = jax.jit(jnp.dot)
    for _ in range(2):                                # compile and warm up
        matmul(a, b).block_until_ready()
    t_dot, dots = _best_time(lambda: matmul(a, b).block_until_ready(), seconds_budget / 2)

    src = np.ones(64 * 2**20 // 4, dtype=np.float32)  # 64 MiB: well beyond the last-level cache
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t_copy, copies = _best_time(lambda: np.copyto(dst, src), seconds_budget / 2)
    flops = 2 * n**3 / t_dot
    copy_bw = src.nbytes / t_copy
    return HostProbe(
        name="cpu-host (measured)", bf16_flops=None, fp8_flops=None, fp32_flops=flops, tf32_flops=None,
        hbm_bytes=_host_memory_bytes(), hbm_bw=copy_bw, link_bw=copy_bw, scaleout_bw=None,
        source=f"measured on this host: f32 {n}^3 jnp.dot {flops / 1e9:.1f} GFLOP/s (best of {dots}), "
               f"numpy 64 MiB copy {copy_bw / GB:.1f} GB/s (best of {copies}; the 'link' between virtual CPU "
               "devices is memory)")


REPROBE_ENV = "JAXPAR_REPROBE_PEAK"   # set to 1: probe this host again and keep the new figure


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def host_matmul_peak(devices: int) -> tuple[float, str]:
    """This host's float32 matmul FLOP/s, probed once and kept, and where it comes from (`kept_host_probe`)."""
    kept = kept_host_probe(devices)
    return kept["fp32_flops"], kept["where"]


def kept_host_probe(devices: int) -> dict:
    """This host's probe (fp32_flops, hbm_bw: its copy bandwidth, hbm_bytes), probed once and kept, and `where`.

    A probe moves with the host's load (63.8 then 35.8 GFLOP/s on two starts of a shared host), so two
    runs' MFUs, or two `jaxpar plan --cpu-devices` invocations, compare only against one figure: the first
    probe is written to the jaxpar cache (JAXPAR_CACHE, host_peak/), keyed by host name, CPU model and count,
    jaxlib and device count, and later runs reuse it. JAXPAR_REPROBE_PEAK=1 probes again and replaces it.
    """
    import jaxlib

    from jaxpar.data.tokenizer import cache_dir
    key = {"host": platform.node(), "cpu": _cpu_model(), "cpus": os.cpu_count(), "jaxlib": jaxlib.__version__,
           "devices": devices}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "host_peak" / f"{digest}.json"
    if os.environ.get(REPROBE_ENV, "0") in ("", "0") and path.is_file():
        try:
            kept = json.loads(path.read_text())
            return {"fp32_flops": float(kept["fp32_flops"]), "hbm_bw": kept["hbm_bw"],
                    "hbm_bytes": kept.get("hbm_bytes"),
                    "where": (f"kept from this host's probe of {kept['probed_at']} in {path} ({REPROBE_ENV}=1 "
                              f"probes again): {kept['source']}")}
        except (OSError, ValueError, KeyError, TypeError):
            pass   # unreadable, or written before the copy bandwidth was kept: probe again and rewrite it
    host = probe_host()
    record = {**key, "fp32_flops": host.fp32_flops, "hbm_bw": host.hbm_bw, "hbm_bytes": host.hbm_bytes,
              "source": host.source, "probed_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.tmp")   # processes of one job may write at once
        partial.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(partial, path)
        kept_at = f"probed now and kept in {path} for later runs ({REPROBE_ENV}=1 probes again)"
    except OSError as err:
        kept_at = f"probed now, not kept ({path.parent}: {err.strerror})"
    return {"fp32_flops": host.fp32_flops, "hbm_bw": host.hbm_bw, "hbm_bytes": host.hbm_bytes,
            "where": f"{kept_at}: {host.source}"}


_DTYPE_FIELD = {
    "bfloat16": "bf16_flops", "bf16": "bf16_flops", "float16": "bf16_flops", "fp16": "bf16_flops",
    "float8": "fp8_flops", "fp8": "fp8_flops", "float8_e4m3fn": "fp8_flops", "float8_e5m2": "fp8_flops",
    "float32": "tf32_flops", "fp32": "tf32_flops", "tf32": "tf32_flops",
}


def peak_flops_per_device(dtype: str) -> tuple[float | None, str]:
    """Peak dense FLOP/s of one device of the default backend for matmuls in `dtype`, and where it comes from.

    GPU: the table (float32 maps to TF32 tensor cores, XLA's default precision for
    f32 dots on Ampere/Hopper). CPU: the host's kept probe (`host_matmul_peak`) divided by
    the number of local devices, because virtual CPU devices share the host's cores. None when unknown.
    """
    import jax

    field = _DTYPE_FIELD.get(dtype.lower())
    if field is None:
        raise ValueError(f"unknown dtype '{dtype}'; expected one of {', '.join(sorted(_DTYPE_FIELD))}")
    backend = jax.default_backend()
    if backend == "cpu":
        n = jax.local_device_count()
        flops, source = host_matmul_peak(n)
        note = "" if dtype.lower() in ("float32", "fp32", "tf32") else f" (only float32 is measured; used for {dtype})"
        return flops / n, (f"this host's float32 matmul peak, {flops / 1e9:.1f} GFLOP/s, "
                           f"shared by {n} virtual CPU devices{note} ({source})")
    kind = jax.devices()[0].device_kind
    acc = lookup(kind)
    if acc is None:
        return None, f"no published peak for device kind '{kind}' in jaxpar.measure.hardware.ACCELERATORS"
    value = getattr(acc, field)
    if value is None:
        return None, f"{acc.name} has no {field.replace('_flops', '')} tensor cores ({acc.source})"
    return value, f"{acc.name} {field.replace('_flops', '')} dense peak ({acc.source})"


@dataclasses.dataclass(frozen=True)
class Peak:
    """The peak FLOP/s per device a run's MFU divides by, and where it comes from."""

    per_device: float | None
    source: str
    measured: bool        # a probe of this host (which the run itself can beat), not a datasheet figure


def run_peak(dtype: str) -> Peak:
    """The peak for a training run, the same on every process: process 0's.

    Called at the start of the run, before any compile competes with the CPU probe for the
    cores. Each process probes its own host, but they would report different MFUs for the
    same global step, so every process takes process 0's figure.
    """
    import jax
    from jax.experimental import multihost_utils

    value, source = peak_flops_per_device(dtype)
    if jax.process_count() > 1:
        agreed = float(multihost_utils.broadcast_one_to_all(np.float32(np.nan if value is None else value)))
        value = None if np.isnan(agreed) else agreed
        source += f" (process 0's figure, used by all {jax.process_count()} processes)"
    return Peak(value, source, measured=jax.default_backend() == "cpu")

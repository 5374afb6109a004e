"""Collectives microbenchmark: the JAX counterpart of nccl-tests.

Each collective runs in `jax.shard_map` over the single axis 'x' of a 1-D mesh of
every device (all processes; at least 2, since one device exchanges nothing), for
message sizes that double from `min_bytes` to `max_bytes`. Per size we report the median time, the algorithm bandwidth
algbw = size / time, and the bus bandwidth busbw = algbw x factor, with nccl-tests'
definitions of "size" and "factor" so the numbers compare with nccl-tests output:

  op              size (bytes per device, nccl-tests' "size")   busbw factor
  all-reduce      the buffer (input = output)                    2(N-1)/N
  all-gather      the full output (N x the input)                (N-1)/N
  reduce-scatter  the full input (N x the output)                (N-1)/N
  all-to-all      the send buffer (= the receive buffer)         (N-1)/N
  permute         the buffer sent to the ring neighbour          1   (nccl-tests sendrecv)
  broadcast       the buffer                                     1

busbw is divided by a theoretical per-direction link bandwidth: the NVLink figure
from `jaxpar.measure.hardware` on GPUs, the measured host memcpy bandwidth on CPU
(virtual CPU devices exchange data through host memory).

Broadcast: on GPU it is `jax.lax.pbroadcast` (HLO collective-broadcast, NCCL
broadcast); XLA:CPU has no lowering for it, so on CPU it is the equivalent that
`pbroadcast`'s docstring gives, a psum of the value masked to device 0. That moves
all-reduce traffic, so a CPU broadcast's busbw (factor 1) understates the link.

An alpha-beta model time = alpha + size/beta is fitted per collective by least
squares on relative error (so small sizes, where alpha shows, are not drowned by
the large ones). `beta` is in size bytes per second (an algbw); `beta_bus` = beta x
factor is the asymptotic busbw.

Multi-process: every process runs the same loop (the iteration count is decided by
process 0 and broadcast, since a collective needs every process to take part the
same number of times); the time of a size is the slowest process's median. Only
process 0 writes files and prints.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.bench.options import OPS, add_bench_arguments, parse_bytes, parse_ops, parse_sweep  # noqa: F401
from jaxpar.config import ConfigError
from jaxpar.figures import figure, save, styled
from jaxpar.measure import hardware

MEMORY_FRACTION = 0.25        # refuse a max size above this share of a device's free memory
AXIS = "x"
DTYPE = np.float32


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for `op` over `n` devices."""
    if op == "all-reduce":
        return 2.0 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    return 1.0


def available_bytes_per_device() -> tuple[float, str]:
    """Free memory one device can use: the allocator limit on accelerators, host memory / local devices on CPU."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), f"{device.device_kind} free memory"
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = float(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        free = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    n = jax.local_device_count()
    return free / n, f"available host memory shared by {n} CPU devices"


def sweep_sizes(min_bytes: int, max_bytes: int, n: int) -> list[int]:
    """Sizes doubling from min to max, each rounded down to whole float32 elements divisible by n (at least n)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        elements = max(n, (size // DTYPE().itemsize) // n * n)
        if elements * DTYPE().itemsize not in sizes:
            sizes.append(elements * DTYPE().itemsize)
        size *= 2
    return sizes


def make_bench_mesh():
    """A 1-D mesh over every device of every process, axis 'x' (Explicit: shardings are part of the types)."""
    devices = jax.devices()
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Explicit,), devices=devices)


def build(op: str, mesh, size_bytes: int):
    """A jitted collective and its input for one size; returns (fn, x, implementation note).

    The input is a global (N, cols) float32 array sharded by rows, so each device holds
    one (1, cols) block whose values are its row index + 1. It is built with
    `make_array_from_callback`, which works when devices belong to several processes.
    """
    n = mesh.shape[AXIS]
    elements = size_bytes // DTYPE().itemsize
    cols = elements // n if op == "all-gather" else elements     # all-gather's input is 1/N of its output
    sharding = NamedSharding(mesh, P(AXIS, None))
    x = jax.make_array_from_callback(
        (n, cols), sharding,
        lambda index: np.full((1, cols), (index[0].start or 0) + 1, DTYPE))  # type: ignore[index]  # a sharded array's index
    note = ""
    if op == "all-reduce":
        def body(a):
            return jax.lax.psum(a, AXIS)
    elif op == "all-gather":
        def body(a):
            return jax.lax.all_gather(a, AXIS, axis=1, tiled=True)
    elif op == "reduce-scatter":
        def body(a):
            return jax.lax.psum_scatter(a, AXIS, scatter_dimension=1, tiled=True)
    elif op == "all-to-all":
        def body(a):
            chunks = a.reshape(n, cols // n)               # chunk j goes to device j
            return jax.lax.all_to_all(chunks, AXIS, 0, 0, tiled=True).reshape(1, cols)
    elif op == "permute":
        ring = [(i, (i + 1) % n) for i in range(n)]

        def body(a):
            return jax.lax.ppermute(a, AXIS, perm=ring)
    elif op == "broadcast":
        if jax.default_backend() == "gpu":
            note = "pbroadcast (HLO collective-broadcast)"

            def body(a):
                return jax.lax.pbroadcast(a, AXIS, 0)
        else:
            note = "psum of the value masked to device 0 (no collective-broadcast on this backend)"

            def body(a):
                return jax.lax.psum(jnp.where(jax.lax.axis_index(AXIS) == 0, a, 0), AXIS)
    else:
        raise ConfigError("--ops", f"unknown collective '{op}'; valid: {', '.join(OPS)}")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS, None), out_specs=P(AXIS, None)))
    return fn, x, note


def _agree(value: float, how: str) -> float:
    """The same number on every process: process 0's (`how="first"`) or the largest (`"max"`)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    if how == "first":
        return float(multihost_utils.broadcast_one_to_all(np.float64(value)))
    return float(np.max(multihost_utils.process_allgather(np.float64(value))))


def time_collective(fn, x, budget_s: float, min_iters: int = 3, max_iters: int = 1000) -> tuple[float, int]:
    """Median seconds per call after warm-up, with as many iterations as fit in `budget_s`."""
    fn(x).block_until_ready()                      # compile
    start = time.perf_counter()
    fn(x).block_until_ready()
    first = time.perf_counter() - start
    iters = int(_agree(min(max_iters, max(min_iters, budget_s / max(first, 1e-9))), "first"))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return _agree(statistics.median(times), "max"), iters


def fit_alpha_beta(sizes, times) -> tuple[float, float | None]:
    """Least squares of time = alpha + size/beta, weighting each point by 1/time (relative error).

    Returns (alpha seconds, beta bytes/s); beta is None when the times do not grow with size.
    alpha is clamped at 0 (a negative start-up cost is noise).
    """
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    w = 1.0 / t
    if len(x) >= 2:
        (alpha, slope), *_ = np.linalg.lstsq(np.stack([w, x * w], axis=1), t * w, rcond=None)
    else:
        alpha, slope = 0.0, t[0] / x[0]
    if alpha < 0:
        alpha, slope = 0.0, float(np.sum(x * w * w * t) / np.sum((x * w) ** 2))
    return float(alpha), (float(1.0 / slope) if slope > 0 else None)


def theory_bandwidth() -> tuple[float | None, str]:
    """The per-direction link bandwidth a busbw is compared to, and where it comes from."""
    if jax.default_backend() == "cpu":
        host = hardware.probe_host()
        return host.link_bw, f"measured host memcpy {host.link_bw / 1e9:.1f} GB/s (cpu-host)"
    kind = jax.devices()[0].device_kind
    acc = hardware.lookup(kind)
    if acc is None or acc.link_bw is None:
        return None, f"no link bandwidth known for '{kind}'"
    note = f"{acc.name} NVLink {acc.link_bw / 1e9:.0f} GB/s per direction"
    if jax.process_count() > 1:
        note += f" (across nodes compare with {acc.scaleout_bw / 1e9:.0f} GB/s InfiniBand per GPU)"
    return acc.link_bw, note


def run_collectives_bench(ops, min_bytes, max_bytes, time_budget_s, out_dir) -> dict:
    """Sweep `ops` over sizes min..max bytes per device; write collectives.{csv,json,md,png} to out_dir (process 0).

    Returns {"meta": ..., "results": [row per op and size], "fits": {op: alpha/beta}}.
    """
    ops, min_bytes, max_bytes = parse_sweep(ops, min_bytes, max_bytes, time_budget_s)
    devices = jax.devices()
    if len(devices) < 2:
        raise ConfigError("--cpu-devices", f"found {len(devices)} {devices[0].platform} device; a collective needs "
                          ">= 2 devices, e.g. --cpu-devices 8")
    free, where = available_bytes_per_device()
    if max_bytes > MEMORY_FRACTION * free:
        raise ConfigError("--max-bytes", f"{max_bytes} bytes per device is more than {MEMORY_FRACTION:.0%} of the "
                          f"{free / 2**30:.2f} GiB free per device ({where}); use at most "
                          f"{int(MEMORY_FRACTION * free)}")

    mesh = make_bench_mesh()
    n = mesh.shape[AXIS]
    sizes = sweep_sizes(min_bytes, max_bytes, n)
    theory, theory_source = theory_bandwidth()
    rows, fits, notes = [], {}, {}
    for op in ops:
        factor = bus_factor(op, n)
        times = []
        for size in sizes:
            fn, x, note = build(op, mesh, size)
            if note:
                notes[op] = note
            seconds, iters = time_collective(fn, x, time_budget_s)
            times.append(seconds)
            algbw = size / seconds
            busbw = algbw * factor
            rows.append({
                "op": op, "bytes": size, "n_devices": n, "iterations": iters,
                "time_us": seconds * 1e6, "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9,
                "theory_GBps": theory / 1e9 if theory else None,
                "ratio": busbw / theory if theory else None,
            })
        alpha, beta = fit_alpha_beta(sizes, times)
        fits[op] = {"alpha_us": alpha * 1e6, "beta_GBps": beta / 1e9 if beta else None,
                    "beta_bus_GBps": beta * factor / 1e9 if beta else None}
    result = {
        "meta": {
            "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "n_devices": n, "process_count": jax.process_count(), "dtype": np.dtype(DTYPE).name,
            "time_budget_s_per_size": time_budget_s,
            "theory_GBps": theory / 1e9 if theory else None, "theory_source": theory_source,
            "size_convention": "nccl-tests: all-reduce buffer; all-gather full output; reduce-scatter full input; "
                               "all-to-all send buffer; permute/broadcast buffer (bytes per device)",
            "notes": notes,
        },
        "results": rows,
        "fits": fits,
    }
    if jax.process_index() == 0:
        write_outputs(result, Path(out_dir))
    return result


# ----------------------------------------------------------------------------- outputs

def _fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"Collectives on {meta['n_devices']} x {meta['device_kind']} ({meta['process_count']} process(es)); "
             f"theory: {meta['theory_source']}", "",
             "| op | bytes | time µs | algbw GB/s | busbw GB/s | theory GB/s | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["results"]:
        lines.append(f"| {r['op']} | {r['bytes']} | {r['time_us']:.1f} | {r['algbw_GBps']:.3f} | "
                     f"{r['busbw_GBps']:.3f} | {_fmt(r['theory_GBps'], '.1f')} | {_fmt(r['ratio'], '.3f')} |")
    lines += ["", "Alpha-beta fit, time = alpha + bytes/beta (beta_bus = beta x busbw factor):", "",
              "| op | alpha µs | beta GB/s | beta_bus GB/s |", "|---|---:|---:|---:|"]
    for op, fit in result["fits"].items():
        lines.append(f"| {op} | {fit['alpha_us']:.1f} | {_fmt(fit['beta_GBps'], '.3f')} | "
                     f"{_fmt(fit['beta_bus_GBps'], '.3f')} |")
    for op, note in meta["notes"].items():
        lines.append(f"\n{op}: {note}")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = ["op", "bytes", "n_devices", "iterations", "time_us", "algbw_GBps", "busbw_GBps", "theory_GBps", "ratio"]
    with open(out_dir / "collectives.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(result["results"])
    (out_dir / "collectives.json").write_text(json.dumps(result, indent=2))
    (out_dir / "collectives.md").write_text(markdown(result))
    plot(result, out_dir / "collectives.png")


def _size_label(x, _pos=None) -> str:
    """An axis tick in the --min-bytes/--max-bytes notation: 1K, 64K, 1M (binary)."""
    for suffix, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if x >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


@styled
def plot(result: dict, path: Path):
    """Log-log busbw against size, one line per collective, the theory figure dashed."""
    import textwrap

    from matplotlib.ticker import FuncFormatter
    fig = figure(9, 6)
    ax = fig.add_subplot()
    for op in dict.fromkeys(r["op"] for r in result["results"]):
        points = [(r["bytes"], r["busbw_GBps"]) for r in result["results"] if r["op"] == op and r["busbw_GBps"] > 0]
        if points:
            ax.plot(*zip(*points), marker="o", label=op)
    meta = result["meta"]
    if meta["theory_GBps"]:
        ax.axhline(meta["theory_GBps"], linestyle="--", color="gray",
                   label="\n".join(textwrap.wrap(f"theory: {meta['theory_source']}", 60)))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
    ax.set_xlabel("size per device (K = 2^10 bytes, M = 2^20; nccl-tests convention)")
    ax.set_ylabel("busbw (GB/s): algbw x the op's bus factor")
    ax.set_title(f"Collectives, {meta['n_devices']} x {meta['device_kind']}: bus bandwidth vs size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=3)
    return save(fig, path)


# ----------------------------------------------------------------------------- CLI

def run_bench(args) -> int:
    """`jaxpar bench collectives`: run the sweep, print the markdown table on process 0."""
    out = args.out or f"runs/bench-collectives-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_collectives_bench(args.ops, args.min_bytes, args.max_bytes, args.budget, out)
    if jax.process_index() == 0:
        print(markdown(result))
        print(f"wrote {out}/collectives.{{csv,json,md,png}}")
    return 0


def main(argv=None) -> int:
    """Standalone entry, also for several processes: `python -m jaxpar.bench.collectives --cpu-devices 4 ...`."""
    from jaxpar.mesh import init_distributed, set_cpu_devices

    parser = argparse.ArgumentParser(prog="python -m jaxpar.bench.collectives", description=__doc__.split("\n")[0])
    add_bench_arguments(parser)
    parser.add_argument("--cpu-devices", type=int, default=None, help="virtual CPU devices per process")
    args = parser.parse_args(argv)
    try:
        set_cpu_devices(args.cpu_devices)
        init_distributed()
        return run_bench(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if jax.process_count() > 1:
            jax.distributed.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())

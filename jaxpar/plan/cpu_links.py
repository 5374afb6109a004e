"""α-β of the collectives inside one compiled XLA:CPU program, in CPU seconds per core: the CPU check's links.

`jaxpar bench collectives` times one jitted collective per call in wall-clock time: each call also pays
the dispatch of an 8-device program, and on a shared host the wall clock measures the other jobs' load.
A training step pays neither: its collectives run back to back inside one program. Here each op runs
`REPEATS` times in a loop inside one program, at two sizes; the process CPU time of the loop minus that of
a one-collective program, over the repeats, is one collective's cost, divided by the host's cores (the
virtual devices run on all of them at once): the same load-free unit as the CPU check's step time
(reality.py). α and β come from the two sizes (β in nccl-tests' bus bytes, like the bench's). Each repeat
also makes one elementwise pass over the result (and the slice or tile that keeps the loop's shape), so
these are upper bounds; they do not include a step's waits for devices that arrive late.
"""
from __future__ import annotations

import os
import time

OPS = ("all-reduce", "all-gather", "reduce-scatter")
SIZES = (16 * 1024, 2 * 1024 * 1024)      # bytes per device: α shows at the first, β at the second
REPEATS = 16
CALLS = 5                                # timed calls per program (median)


def host_cores() -> int:
    """The cores this process may run on (the virtual devices share them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def bus_bytes(op: str, size: int, n: int) -> float:
    """Bytes each device sends for a buffer of `size` bytes (nccl-tests' busbw convention, as `Link.time` takes)."""
    return size * (2 if op == "all-reduce" else 1) * (n - 1) / n


def _program(op: str, mesh, repeats: int, cols: int):
    import jax
    from jax.sharding import PartitionSpec as P

    def once(_, a):
        if op == "all-gather":            # each device's row is 1/n of the gathered buffer
            out = jax.lax.all_gather(a[:, :cols // mesh.size], "x", axis=1, tiled=True)
        elif op == "reduce-scatter":
            out = jax.numpy.tile(jax.lax.psum_scatter(a, "x", scatter_dimension=1, tiled=True), (1, mesh.size))
        else:
            out = jax.lax.pcast(jax.lax.psum(a, "x"), "x", to="varying")
        return out * 0.5

    def body(a):
        return jax.lax.fori_loop(0, repeats, once, a)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x", None), out_specs=P("x", None)))


def _cpu_seconds(fn, x) -> float:
    fn(x).block_until_ready()
    times = []
    for _ in range(CALLS):
        start = time.process_time()
        fn(x).block_until_ready()
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2]


def measure_links(devices: list) -> dict:
    """{op: {"alpha_us", "beta_bus_GBps"}} of collectives over `devices` inside one program (module doc)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    cores, n, fits = host_cores(), len(devices), {}
    for op in OPS:
        per = []
        for size in SIZES:
            cols = size // 4
            x = jax.device_put(np.ones((n, cols), np.float32), NamedSharding(mesh, P("x", None)))
            many, one = (_cpu_seconds(_program(op, mesh, k, cols), x) for k in (REPEATS + 1, 1))
            per.append(max(many - one, 0.0) / REPEATS / cores)
        sent = [bus_bytes(op, size, n) for size in SIZES]
        slope = (per[1] - per[0]) / (sent[1] - sent[0])
        beta = 1 / slope if slope > 0 else None
        alpha = max(per[0] - (sent[0] / beta if beta else 0.0), 0.0)
        fits[op] = {"alpha_us": alpha * 1e6, "beta_bus_GBps": beta / 1e9 if beta else None}
    return fits

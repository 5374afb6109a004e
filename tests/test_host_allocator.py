"""glibc keeping freed memory (lab 10's CPU check, the sweep's tasks, kept_cost.py): with glibc's default, a buffer
larger than a thread's heap (64 MB) is mapped afresh for every call and page-faulted in, so a step's CPU time
depends on how its buffers happen to fall (fsdp=8 of the default config: ~90,000 faults per step)."""
import os
import platform
import subprocess
import sys

import pytest

from jaxpar.measure.host_allocator import call_with_kept_memory, jemalloc_library

CHILD = """
import sys
from jaxpar.measure.host_allocator import keep_freed_memory, minor_page_faults
if sys.argv[1] == "keep":
    print(keep_freed_memory())
import jax
import jax.numpy as jnp
x = jnp.ones((32 * 2**20,), jnp.float32)       # 128 MB: each call's result is allocated on an XLA worker thread
double = jax.jit(lambda x: x * 2)
faults = []
for _ in range(int(sys.argv[2])):
    before = minor_page_faults()
    jax.block_until_ready(double(x))
    faults.append(minor_page_faults() - before)
print(*faults)
"""
PAGES = 32 * 2**20 * 4 // 4096


def faults_per_call(allocator: str, calls: int) -> tuple[list[int], str]:
    """The child's page faults per call and its first line (what the allocator was told)."""
    out = subprocess.run([sys.executable, "-c", CHILD, allocator, str(calls)], capture_output=True, text=True,
                         timeout=180, check=True).stdout.splitlines()
    return [int(f) for f in out[-1].split()], out[0]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_memory_stops_the_page_faults_of_every_call():
    """glibc's default faults the whole 128 MB result in on every call. With freed memory kept, the heap grows while
    small blocks split its freed space (for 4 to 14 calls here, more under load) and then calls reuse it: in the last
    20 of 40 calls, at most a quarter take fresh pages."""
    default, _ = faults_per_call("default", 4)
    kept, said = faults_per_call("keep", 40)
    assert said.startswith("host allocator: glibc keeps freed memory")
    assert min(default) >= PAGES, default
    steady = kept[-20:]
    assert sum(f >= PAGES / 100 for f in steady) <= 5, kept


def faults_of_calls_here(calls: int) -> tuple[list[int], str]:
    """CHILD's loop in this process: page faults per call, and what `keep_freed_memory` says here."""
    import jax
    import jax.numpy as jnp

    from jaxpar.measure.host_allocator import keep_freed_memory, minor_page_faults
    said = keep_freed_memory()
    x = jnp.ones((32 * 2**20,), jnp.float32)
    double = jax.jit(lambda x: x * 2)
    faults = []
    for _ in range(calls):
        before = minor_page_faults()
        jax.block_until_ready(double(x))
        faults.append(minor_page_faults() - before)
    return faults, said


@pytest.mark.skipif(jemalloc_library() is None, reason="needs jemalloc (Debian: libjemalloc2)")
def test_a_measurement_runs_in_a_fresh_process_with_jemalloc_keeping_freed_memory():
    """`call_with_kept_memory` (lab 10's part d) runs its function in a fresh process with jemalloc preloaded and
    never purging, and leaves this process's environment as it was: the 128 MB result stops faulting within a few
    calls (measured: from the second or third call on) and the last 20 of 40 calls take no fresh pages."""
    environment = dict(os.environ)
    kept, said = call_with_kept_memory(faults_of_calls_here, 40)
    assert said.startswith("host allocator: jemalloc keeps freed memory"), said
    assert dict(os.environ) == environment
    assert sum(f >= PAGES / 100 for f in kept[-20:]) <= 2, kept

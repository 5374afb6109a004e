"""glibc keeping freed memory (lab 07's CPU check, the sweep's tasks, kept_cost.py): with glibc's default, a buffer
larger than a thread's heap (64 MB) is mapped afresh for every call and page-faulted in, so a step's CPU time
depends on how its buffers happen to fall (fsdp=8 of the default config: ~90,000 faults per step)."""
import platform
import subprocess
import sys

import pytest

CHILD = """
import sys
from jaxpar.measure.host_allocator import keep_freed_memory, minor_page_faults
if sys.argv[1] == "keep":
    print(keep_freed_memory())
import jax
import jax.numpy as jnp
x = jnp.ones((64 * 2**20,), jnp.float32)       # 256 MB: each call's result is allocated on an XLA worker thread
double = jax.jit(lambda x: x * 2)
faults = []
for _ in range(16):
    before = minor_page_faults()
    jax.block_until_ready(double(x))
    faults.append(minor_page_faults() - before)
print(*faults)
"""
PAGES = 64 * 2**20 * 4 // 4096


def faults_per_call(allocator: str) -> tuple[list[int], str]:
    """The child's page faults per call and its first line (what the allocator was told)."""
    out = subprocess.run([sys.executable, "-c", CHILD, allocator], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    return [int(f) for f in out[-1].split()], out[0]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_memory_stops_the_page_faults_of_every_call():
    """glibc's default faults the whole 256 MB result in on every call; with freed memory kept, the heap grows for
    the first few calls and then every call reuses it (the last four here: no fresh pages at all)."""
    default, _ = faults_per_call("default")
    kept, said = faults_per_call("keep")
    assert said.startswith("host allocator: glibc keeps freed memory")
    assert min(default) >= PAGES, default
    assert sum(kept[-4:]) < PAGES / 100, kept

"""Keep freed host memory in the process, so CPU step times measure the strategy and not glibc's page faults.

XLA:CPU allocates each execution's buffers on its worker threads and frees them at the end. glibc serves a block
larger than a thread's 64 MB heap with its own mmap and unmaps it when freed, and gives a heap's free top back to
the kernel, so the next step takes fresh, zeroed pages again: fsdp=8 of the default config paid about 90,000 page
faults per step, a tenth of its CPU time. GPU allocators (XLA's BFC) keep their memory, and so do tcmalloc and
jemalloc: `keep_freed_memory` makes glibc do the same for this process, via mallopt. The heap still grows for a
few steps (more under load), while small blocks split its freed space; callers report the faults that remain.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
import resource

M_TRIM_THRESHOLD = -1     # mallopt parameters (glibc's malloc.h)
M_TOP_PAD = -2
M_MMAP_MAX = -4
M_ARENA_MAX = -8
NEVER = -1                # M_TRIM_THRESHOLD -1: never give the heap's top back (mallopt(3))
TOP_PAD_BYTES = 1 << 30


def keep_freed_memory() -> str:
    """Tell glibc's malloc to serve every block from its heaps (a block of its own mmap is unmapped when freed), keep
    freed memory and grow heaps in large steps; say what was done.
    No-op (and says so) where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"host allocator unchanged ({platform.system()}, not glibc)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER), (M_TOP_PAD, TOP_PAD_BYTES))
    applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
    if not applied:
        return "host allocator unchanged (glibc refused mallopt)"
    return "host allocator: glibc keeps freed memory (mallopt: one arena, no mmap'd blocks, no trimming, 1 GiB top pad)"


def minor_page_faults() -> int:
    """This process's minor page faults so far (each a fresh page the kernel zeroed for it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

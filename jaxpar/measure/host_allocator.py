"""Keep freed host memory in the process, so CPU step times measure the strategy and not glibc's page faults.

XLA:CPU allocates each execution's buffers on its worker threads and frees them at the end. glibc serves a block
larger than a thread's 64 MB heap with its own mmap and unmaps it when freed, and gives a heap's free top back to
the kernel, so the next step takes fresh, zeroed pages again: fsdp=8 of the default config paid about 90,000 page
faults per step, a tenth of its CPU time. GPU allocators (XLA's BFC) keep their memory, and so do tcmalloc and
jemalloc: `keep_freed_memory` makes glibc do the same for this process, via mallopt. The heap still grows for a
few steps (more under load), while small blocks split its freed space, and a step whose large and small blocks
interleave (data=2 x tensor=4) keeps faulting. jemalloc keeps each size class apart and, told never to purge, keeps
freed pages: `call_with_kept_memory` runs a measurement in a fresh process with it preloaded where the machine has
it (Debian: libjemalloc2), and in this process with mallopt where not. Callers report the faults that remain.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import multiprocessing
import os
import platform
import resource
from pathlib import Path

M_TRIM_THRESHOLD = -1     # mallopt parameters (glibc's malloc.h)
M_TOP_PAD = -2
M_MMAP_MAX = -4
M_ARENA_MAX = -8
NEVER = -1                # M_TRIM_THRESHOLD -1: never give the heap's top back (mallopt(3))
TOP_PAD_BYTES = 1 << 30
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"   # jemalloc: never give freed pages back to the kernel


def keep_freed_memory() -> str:
    """Tell glibc's malloc to serve every block from its heaps (a block of its own mmap is unmapped when freed), keep
    freed memory and grow heaps in large steps; say what was done.
    Where jemalloc was preloaded with JEMALLOC_CONF, says so and changes nothing. No-op (and says so) where the C
    library is not glibc."""
    if jemalloc_loaded():
        return f"host allocator: jemalloc keeps freed memory (preloaded; MALLOC_CONF={os.environ.get('MALLOC_CONF')})"
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


def jemalloc_library() -> str | None:
    """jemalloc's shared library as the dynamic loader finds it (e.g. libjemalloc.so.2), or None."""
    return ctypes.util.find_library("jemalloc") if platform.system() == "Linux" else None


def jemalloc_loaded() -> bool:
    """Whether jemalloc serves this process's malloc (it was preloaded: LD_PRELOAD)."""
    maps = Path("/proc/self/maps")
    return maps.is_file() and "libjemalloc" in maps.read_text()


def call_with_kept_memory(fn, *args):
    """fn(*args) where freed host memory is kept: in a fresh process with jemalloc preloaded and never purging
    (its result comes back pickled; fn must be importable), or, without jemalloc, here after `keep_freed_memory`."""
    library = jemalloc_library()
    if library is None or jemalloc_loaded():
        keep_freed_memory()
        return fn(*args)
    saved = {name: os.environ.get(name) for name in ("LD_PRELOAD", "MALLOC_CONF")}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        os.environ.update(LD_PRELOAD=" ".join(filter(None, [library, saved["LD_PRELOAD"]])), MALLOC_CONF=JEMALLOC_CONF)
        try:
            future = pool.submit(fn, *args)     # starts the worker, which inherits this environment
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.update({name: value})
        return future.result()

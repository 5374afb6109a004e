"""`jaxpar bench collectives`: its arguments and their checks, importable without JAX (fast --help and errors)."""
from __future__ import annotations

import argparse
import math
import numbers

from jaxpar.config import ConfigError

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "permute", "broadcast")
ALIASES = {
    "allreduce": "all-reduce", "psum": "all-reduce",
    "allgather": "all-gather", "all_gather": "all-gather",
    "reducescatter": "reduce-scatter", "psum_scatter": "reduce-scatter",
    "alltoall": "all-to-all", "all_to_all": "all-to-all",
    "ppermute": "permute", "sendrecv": "permute", "collective-permute": "permute",
    "bcast": "broadcast", "pbroadcast": "broadcast",
}


def parse_ops(text: str | list[str]) -> list[str]:
    """`"all-reduce,psum_scatter"` or a list of names (aliases allowed; `all` = every op) -> canonical names."""
    items = text if isinstance(text, list) else [text]
    names = [name.strip().lower() for item in items for name in item.split(",") if name.strip()]
    if not names or names == ["all"]:
        return list(OPS)
    ops = []
    for name in names:
        op = ALIASES.get(name, name)
        if op not in OPS:
            raise ConfigError("--ops", f"unknown collective '{name}'; valid: all, {', '.join(OPS)}")
        if op not in ops:
            ops.append(op)
    return ops


def parse_bytes(text, field: str) -> int:
    """`4096`, `64K`, `1MiB`, `2G` (binary multiples) -> bytes."""
    if isinstance(text, numbers.Integral) and not isinstance(text, bool):
        value = int(text)
    else:
        s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
        digits = s[:-1] if scale > 1 else s
        try:
            value = int(float(digits) * scale)
        except ValueError:
            raise ConfigError(field, f"'{text}' is not a size; use bytes or K/M/G, e.g. 64K or 16M") from None
    if value <= 0:
        raise ConfigError(field, f"is {text}; must be positive")
    return value


def parse_sweep(ops, min_bytes, max_bytes, budget_s) -> tuple[list[str], int, int]:
    """The sweep a bench runs: canonical op names and the size range in bytes; refuses what cannot run."""
    ops = parse_ops(ops)
    min_bytes, max_bytes = parse_bytes(min_bytes, "--min-bytes"), parse_bytes(max_bytes, "--max-bytes")
    if min_bytes > max_bytes:
        raise ConfigError("--min-bytes", f"{min_bytes} is larger than --max-bytes {max_bytes}")
    if not (math.isfinite(budget_s) and budget_s > 0):
        raise ConfigError("--budget", f"is {budget_s}; must be a positive number of seconds per size")
    return ops, min_bytes, max_bytes


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", default="all",
                        help=f"comma-separated collectives, or 'all' (default): {', '.join(OPS)}")
    parser.add_argument("--min-bytes", default="1K", help="smallest size per device, e.g. 1K (default)")
    parser.add_argument("--max-bytes", default="16M", help="largest size per device, e.g. 16M (default)")
    parser.add_argument("--budget", type=float, default=0.2, help="seconds of timing per size (default 0.2)")
    parser.add_argument("--out", default=None, help="output folder (default runs/bench-collectives-<time>)")

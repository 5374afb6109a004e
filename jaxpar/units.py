"""Sizes and how reports print them: one definition of a GiB, a byte count, a ratio, a duration."""
from __future__ import annotations

KIB, MIB, GIB = 2**10, 2**20, 2**30
GB = 1e9                                     # decimal: vendors' device memory and bandwidth
UNITS = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))


def byte_unit(values) -> tuple[str, float]:
    """The unit fmt_bytes gives the largest of `values` (and its size in bytes): a plot's axis in the unit its
    table's largest entries use."""
    top = max((abs(v) for v in values if v is not None), default=0)
    return next(((unit, scale) for unit, scale in UNITS if top >= scale), ("B", 1))


def fmt_bytes(x) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 ('-' for None)."""
    if x is None:
        return "-"
    unit, scale = byte_unit([x])
    return f"{x:.0f} B" if unit == "B" else f"{x / scale:.3f} {unit}"


def ratio(measured, predicted) -> str:
    """measured / predicted to three decimals, '-' when either is missing."""
    return f"{measured / predicted:.3f}" if measured is not None and predicted else "-"


def fmt_seconds(x: float) -> str:
    """µs below a millisecond, ms below a second, s below an hour, then hours, then days."""
    if x < 1e-3:
        return f"{x * 1e6:.1f} µs"
    if x < 3600:
        return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x / 3600:.1f} h" if x < 86400 else f"{x / 86400:,.1f} days"

"""What every lab shares: markdown tables, byte units, ratios, figures, JSON, and the standalone entry
that `experiments/NN_*/run.py` calls (parse, set the CPU devices, run; bad input exits 2 with one line)."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from jaxpar.config import ConfigError

MIB = 2**20


def md_table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` has one letter per column, l or r (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    return "\n".join(["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |",
                      *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)])


def fmt_bytes(x) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 ('-' for None)."""
    if x is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.0f} B"


def ratio(measured, predicted) -> str:
    """measured / predicted to three decimals, '-' when either is missing."""
    return f"{measured / predicted:.3f}" if measured is not None and predicted else "-"


def max_rel_dev(got, want) -> float:
    """max |got - want| / |want| elementwise (losses against the oracle's)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want) / np.abs(want)))


def figure(width: float = 7.5, height: float = 4.5):
    """A matplotlib Figure drawn off-screen (no display, no global pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def json_default(x):
    """`json.dumps(..., default=json_default)`: numpy scalars as numbers, anything else as text."""
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.bool_):
        return bool(x)
    return str(x)


def write_report(out, sections: list[str], results: dict, start: float, part_seconds: dict[str, float],
                 compiles: tuple[int, float] | None = None) -> str:
    """Close a lab run: the total time into `results`, a footer (total, compiles, each part's seconds)
    after `sections`, then report.md and results.json in `out`. Returns the footer."""
    results["total_seconds"] = total = time.perf_counter() - start
    counted = f" ({compiles[0]} compiles, {compiles[1]:.1f} s of them)" if compiles else ""
    footer = (f"Total lab time {total:.1f} s{counted}, parts: "
              + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in part_seconds.items()) + ".")
    (out / "report.md").write_text("\n\n".join([*sections, footer]) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=json_default) + "\n")
    return footer


def standalone_main(description: str, add_arguments, run_from_args, argv=None) -> int:
    """`python experiments/NN_*/run.py ...`: the lab's arguments plus --cpu-devices; bad input exits 2."""
    from jaxpar.mesh import set_cpu_devices
    parser = argparse.ArgumentParser(prog="run.py", description=description)
    add_arguments(parser)
    if not any(action.dest == "cpu_devices" for action in parser._actions):
        parser.add_argument("--cpu-devices", type=int, metavar="N", help="run on N virtual CPU devices")
    args = parser.parse_args(argv)
    try:
        set_cpu_devices(args.cpu_devices)
        return run_from_args(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

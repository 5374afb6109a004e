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


def plot_equivalence(path, runs: list[tuple[str, list[float], list[float] | None]], tolerance: float) -> None:
    """Losses of every run (left) and each run's relative deviation from its oracle (right, log scale,
    with the tolerance); `runs` holds (label, losses, the oracle's losses or None for an oracle)."""
    fig = figure(11, 4.2)
    ax, dev = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for label, losses, oracle in runs:
        steps = np.arange(1, len(losses) + 1)
        ax.plot(steps, losses, marker="o", ms=3, lw=1, label=label, alpha=0.8, linestyle="-" if oracle is None else "--")
        if oracle is not None:
            d = np.abs(np.asarray(losses) - np.asarray(oracle)) / np.asarray(oracle)
            dev.plot(steps, np.maximum(d, 1e-10), marker="o", ms=3, lw=1, label=label)
    dev.axhline(tolerance, color="k", ls=":", label="tolerance")
    dev.set_yscale("log")
    ax.set(xlabel="step", ylabel="loss", title="loss: every run")
    dev.set(xlabel="step", ylabel="|loss - oracle| / oracle (0 drawn at 1e-10)", title="deviation from one device")
    size = 7 if len(runs) <= 6 else 6
    ax.legend(fontsize=size)
    dev.legend(fontsize=size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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

"""A lab run's files: results.json (every number), report.md (the sheet) and the figures drawn from results.json,
by the run and again by `python -m jaxpar.labs.replot` (so a figure that fails loses nothing)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def json_default(x):
    """`json.dumps(..., default=json_default)`: numpy scalars as numbers, anything else as text."""
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.bool_):
        return bool(x)
    return str(x)


def write_results(out, results: dict) -> None:
    """`results` as results.json in the run directory `out`."""
    (Path(out) / "results.json").write_text(json.dumps(results, indent=2, default=json_default) + "\n")


def read_results(out) -> dict:
    """The results.json a run wrote into `out`."""
    return json.loads((Path(out) / "results.json").read_text())


def write_report(out, sections: list[str], results: dict, part_seconds: dict[str, float], total: float,
                 compiles: tuple[int, float] | None = None) -> str:
    """A footer (total, compiles, each part's seconds) after `sections`, then report.md and results.json (with
    `total_seconds`) in `out`. Returns the footer."""
    results["total_seconds"] = total
    counted = f" ({compiles[0]} compiles, {compiles[1]:.1f} s of them)" if compiles else ""
    footer = (f"Total lab time {total:.1f} s{counted}, parts: "
              + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in part_seconds.items()) + ".")
    (Path(out) / "report.md").write_text("\n\n".join([*sections, footer]) + "\n")
    write_results(out, results)
    return footer


class PlotError(RuntimeError):
    """A figure failed after the lab wrote report.md and results.json: one line (the CLI prints it), exit 1."""
    exit_code = 1


def draw_plots(results: dict, out, plots: dict, lab: str) -> list[str]:
    """Write each figure of `plots` ({file name: (results key, plot(result, path))}) whose part is in
    `results` (key None: the whole results); the lab's run and `jaxpar.labs.replot` both call this, the run
    after writing results.json, so that a figure that fails loses nothing: the others are still drawn, then
    PlotError names the failures in one line and how to draw them again (`lab`: the name replot takes)."""
    written, failed = [], []
    for name, (key, plot) in plots.items():
        if key is None or key in results:
            try:
                plot(results if key is None else results[key], Path(out) / name)
            except Exception as err:   # any plotting bug: named below, the results are kept
                failed.append(f"{name} ({type(err).__name__}: {' '.join(str(err).split())})")
                continue
            written.append(name)
    if failed:
        raise PlotError(f"error: drawing {', '.join(failed)} failed; results.json and report.md are in {out} "
                        f"(`python -m jaxpar.labs.replot {lab} {out}` draws the figures again)")
    return written

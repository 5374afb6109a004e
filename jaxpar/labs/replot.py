"""Draw a lab's figures again from its run directory's results.json, without re-running the lab:
`python -m jaxpar.labs.replot zero runs/lab-zero-...` (after a change to a plot, or to look at old runs)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from jaxpar.labs.base.results import PlotError, draw_plots, read_results

LABS = ("zero", "tensor", "pipeline", "moe", "kernels", "pytorch")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpar.labs.replot", description=__doc__.splitlines()[0])
    parser.add_argument("lab", help=f"the lab that wrote the run directory: {', '.join(LABS)}")
    parser.add_argument("run_dir", help="a run directory holding results.json")
    args = parser.parse_args(argv)
    if args.lab not in LABS:
        print(f"error: lab: unknown {args.lab!r}; valid: {', '.join(LABS)}", file=sys.stderr)
        return 2
    if not (Path(args.run_dir) / "results.json").is_file():
        print(f"error: run_dir: no results.json in {args.run_dir}", file=sys.stderr)
        return 2
    lab = importlib.import_module(f"jaxpar.labs.{args.lab}.lab")
    try:
        written = draw_plots(read_results(args.run_dir), args.run_dir, lab.PLOTS, args.lab)
    except PlotError as err:
        print(err, file=sys.stderr)
        return err.exit_code
    print(f"wrote {', '.join(written)} in {args.run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

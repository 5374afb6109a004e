"""The parts runner every lab shares: the parts chosen by --parts, each run, timed, logged and kept in results.json
and the sheet (report.md), then the figures; and the standalone entry that `experiments/NN_*/run.py` calls.

A part that fails still leaves the parts before it, and its own name and error, in results.json and report.md;
a figure that fails leaves every result (PlotError names it and the replot command)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxpar.config import ConfigError
from jaxpar.labs.base.results import PlotError, draw_plots, write_report


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of a lab: `run()` returns its result, a dict with the sheet's "markdown"."""

    name: str                      # as logged and listed in the sheet's footer
    run: Callable[[], dict]
    key: str | None = None         # its key in results.json (default: `name`)
    title: str | None = None       # a heading the sheet puts before its markdown


def chosen_parts(parts: str | Sequence[str], valid: Sequence[str]) -> list[str]:
    """`parts` (names, or --parts' comma-separated text) in the lab's order; an unknown name or none at all is a
    ConfigError on --parts."""
    if isinstance(parts, str):
        parts = [word.strip() for word in parts.split(",") if word.strip()]
    unknown = [name for name in parts if name not in valid]
    if unknown or not parts:
        raise ConfigError("--parts", f"unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(valid)}")
    return [name for name in valid if name in parts]


def run_directory(out, lab: str, config=None, log=None) -> Path:
    """The run directory `out` (default runs/lab-LAB-<time>), made; with the lab's `config` in config.json;
    `log` names it and the devices the lab runs on."""
    from jaxpar.config import to_json
    path = Path(out or f"runs/lab-{lab}-{time.strftime('%Y%m%d-%H%M%S')}")
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(to_json(config))
    if log:
        import jax
        log(f"lab {lab}: {jax.device_count()} x {jax.devices()[0].platform} devices, run directory {path}")
    return path


def sheet_header(title: str, text: str) -> str:
    """The sheet's first lines: `# title`, then the JAX version and the time before `text` (what was run)."""
    import jax
    return "\n".join([f"# {title}", "", f"jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. {text}"])


def run_parts(lab: str, out: Path, parts: Sequence[Part], results: dict, sections: list[str], plots: dict, *,
              start: float, compiles: Callable[[], tuple[int, float] | None] | None = None, log=print) -> dict:
    """Log the sheet's header (`sections`), then run `parts` in order into `results` (each under its key, with
    its seconds) and `sections`; then report.md with a footer (total time, `compiles()`: count and seconds, each
    part's time), results.json and the figures of `plots` (see `draw_plots`). Returns `results`."""
    seconds: dict[str, float] = {}

    def close() -> str:
        return write_report(out, sections, results, seconds, time.perf_counter() - start,
                            compiles() if compiles else None)

    log("\n\n".join(sections) + "\n")
    for part in parts:
        t0 = time.perf_counter()
        log(f"[{part.name}]")
        try:
            result = part.run()
        except Exception as err:       # keep what the parts before it measured, then fail as before
            results["failed"] = {"part": part.name, "error": f"{type(err).__name__}: {err}"}
            close()
            log(f"part {part.name} failed; the parts before it are in {out / 'results.json'} and report.md")
            raise
        result["seconds"] = seconds[part.name] = time.perf_counter() - t0
        results[part.key or part.name] = result
        sections.extend([part.title, result["markdown"]] if part.title else [result["markdown"]])
        log(result["markdown"] + f"\n\n({part.name}: {result['seconds']:.1f} s)\n")
    log(close())
    written = draw_plots(results, out, plots, lab)     # after results.json: a failed figure can be redrawn
    log(f"wrote {out / 'report.md'}, results.json and the figures {', '.join(written) or '(none)'}")
    return results


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
    except PlotError as err:
        print(err, file=sys.stderr)
        return err.exit_code

"""Lab 09 (course module 6): failures, restarts, goodput and resharding, measured.

Three runs of one config, every number beside its prediction (experiments/09_operations/README.md):

a. baseline       2 processes x 4 devices (`jaxpar launch`), uninterrupted: losses, goodput.
b. failure drill  the same job with process 1 SIGKILLed after a random step and
                  `--max-restarts 1`: the launcher stops the survivor, restarts both, the run
                  resumes from its last checkpoint. Measured: re-done steps (goodput ledger), lost
                  wall time (the drill's wall time - the baseline's), final losses vs the baseline.
                  Predicted: re-done steps = fault step - last checkpoint step; lost time = re-done
                  steps x step time + one start-up and compile (both from the baseline).
c. reshard drill  1 process x 8 devices to the end, then the last checkpoint removed and the
                  run resumed on 4 devices: losses after the resume vs the 8-device run.

Files in --out: report.md, results.json, goodput_timeline.png.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.checks import add_config_arguments
from jaxpar.config import ConfigError
from jaxpar.figures import figure, save, styled
from jaxpar.labs.arguments import TEST_CONFIG, add_quick
from jaxpar.labs.base.results import write_results
from jaxpar.labs.base.runner import standalone_main

LAB_DEFAULTS = ["train.steps=40", "train.checkpoint_every=10", "train.eval_every=20", "train.log_every=1",
                "train.sample_tokens=0"]
TOLERANCE = 1e-4


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _max_rel(a: dict, b: dict, steps) -> float:
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)


def _train_args(config: str | None, overrides: list[str]) -> list[str]:
    args = ["--config", config] if config else []
    for item in [*LAB_DEFAULTS, *overrides]:
        args += ["--set", item]
    return args


def _launch(log: Path, nproc: int, devices: int, command: list[str], max_restarts: int = 0) -> tuple[int, float]:
    """Run `jaxpar launch` in a child (its own JAX processes); returns (exit status, seconds)."""
    argv = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", str(nproc), "--cpu-devices", str(devices),
            "--max-restarts", str(max_restarts), "--", *command]
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT)
    return code, time.perf_counter() - start


def _train(log: Path, devices: int, command: list[str]) -> tuple[int, float]:
    argv = [sys.executable, "-m", "jaxpar.cli", *command, "--cpu-devices", str(devices)]
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT)
    return code, time.perf_counter() - start


def _check(code: int, log: Path, what: str) -> None:
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{what} exited with status {code}; the end of {log}:\n{tail}")


def predicted_loss(fault_step: int, checkpoint_every: int, step_time_s: float, restart_s: float,
                   stop_s: float = 0.0) -> dict:
    """What a failure after `fault_step` costs: the steps since the last checkpoint again, the time to stop
    the survivor, and one more start-up and compile. The survivor is blocked in a collective whose peer
    is gone: gloo fails it as soon as the peer's sockets close, so `stop_s` is ~0 (the launcher's SIGKILL,
    KILL_GRACE_S after SIGTERM, which jaxpar takes as a preemption notice, is only the upper bound)."""
    redone = fault_step - (fault_step // checkpoint_every) * checkpoint_every
    return {"redone_steps": redone, "redone_and_stop_s": redone * step_time_s + stop_s,
            "lost_s": redone * step_time_s + stop_s + restart_s}


@styled
def plot_timeline(ledger: dict, path: Path, fault_step: int | None = None):
    """The failure drill's goodput ledger: productive seconds and the step reached against wall time, the
    stretch from the failure to the restarted attempt's first flush shaded."""
    from matplotlib.ticker import MaxNLocator
    points = np.array([[0.0, 0, 0.0, 0], *ledger["timeline"]], dtype=float)   # [wall s, step, productive s, restarts]
    fig = figure(9, 5.6)
    ax = fig.add_subplot()
    ax.plot(points[:, 0], points[:, 0], color="0.6", linestyle="--", label="wall time (= 100% goodput)")
    ax.plot(points[:, 0], points[:, 2], color="tab:green", label="productive time (steps kept, not re-done)")
    ax.set(xlabel="wall time since the job started (s)", ylabel="seconds")
    steps = ax.twinx()
    steps.grid(False)
    steps.plot(points[:, 0], points[:, 1], "o", color="tab:blue", markersize=4, label="step reached (right axis)")
    steps.set_ylabel("step")
    steps.yaxis.set_major_locator(MaxNLocator(integer=True))
    for i in np.flatnonzero(np.diff(points[:, 3]) > 0):
        ax.axvspan(points[i, 0], points[i + 1, 0], color="tab:red", alpha=0.15,
                   label=f"killed after step {fault_step}, then restarted" if fault_step else "restart")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = steps.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2)
    ax.set_title("Goodput timeline of the failure drill (goodput = productive / wall)")
    return save(fig, path)


def _fault_step(overrides: list[str], seed: int | None) -> tuple[int, int, int]:
    """Steps, checkpoint interval and a random fault step between checkpoints (never on one)."""
    def setting(name):
        return int(next(o.split("=")[1] for o in reversed([*LAB_DEFAULTS, *overrides]) if o.startswith(f"{name}=")))

    steps, every = setting("train.steps"), setting("train.checkpoint_every")
    if steps <= every + 1:
        raise ConfigError("train.steps", f"is {steps}; the drills need more than checkpoint_every + 1 = {every + 1}")
    rng = random.Random(seed)
    fault_step = rng.randrange(every + 1, steps)
    while fault_step % every == 0:
        fault_step = rng.randrange(every + 1, steps)
    return steps, every, fault_step


def _baseline(out: Path, args: list[str]) -> dict:
    """a. 2 processes x 4 devices, uninterrupted: the goodput ledger and the median step time."""
    print("a. baseline: 2 processes x 4 devices, uninterrupted", flush=True)
    base_dir = out / "baseline"
    shutil.rmtree(base_dir, ignore_errors=True)
    code, base_s = _launch(out / "baseline.log", 2, 4, ["train", *args, "--run-dir", str(base_dir)])
    _check(code, out / "baseline.log", "the baseline")
    base = json.loads((base_dir / "summary.json").read_text())["goodput"]
    base_metrics = [json.loads(line) for line in (base_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in base_metrics if r.get("step_time_s")]
    return {"wall_s": base_s, "goodput": base, "step_time_s": float(np.median(step_times))}


def _failure_drill(out: Path, args: list[str], results: dict) -> dict:
    """b. process 1 killed after the fault step, one restart: lost time vs its prediction, same losses."""
    fault_step, every, steps = results["fault_step"], results["checkpoint_every"], results["steps"]
    base = results["baseline"]["goodput"]
    print(f"b. failure drill: process 1 killed after step {fault_step}, --max-restarts 1", flush=True)
    drill_dir = out / "failure"
    shutil.rmtree(drill_dir, ignore_errors=True)
    code, drill_s = _launch(out / "failure.log", 2, 4, ["train", *args, "--run-dir", str(drill_dir), "--set",
                                                        f"train.fault_at_step={fault_step}", "--set",
                                                        "train.fault_process=1"], max_restarts=1)
    _check(code, out / "failure.log", "the failure drill")
    drill = json.loads((drill_dir / "summary.json").read_text())["goodput"]
    predicted = predicted_loss(fault_step, every, results["baseline"]["step_time_s"],
                               base["badput_s"]["startup_compile"])
    plot_timeline(json.loads((drill_dir / "goodput.json").read_text()), out / "goodput_timeline.png", fault_step)
    return {"wall_s": drill_s, "goodput": drill, "predicted": predicted,
            "max_rel_loss_vs_baseline": _max_rel(_losses(drill_dir), _losses(out / "baseline"),
                                                 range(1, steps + 1))}


def _reshard_drill(out: Path, args: list[str], steps: int) -> dict:
    """c. train on 8 devices, drop the last checkpoint, resume on 4: the losses after the resume agree."""
    print("c. reshard drill: 8 devices, then resumed on 4", flush=True)
    eight, four = out / "reshard-8", out / "reshard-4"
    for d in (eight, four):
        shutil.rmtree(d, ignore_errors=True)
    code, _ = _train(out / "reshard-8.log", 8, ["train", *args, "--run-dir", str(eight)])
    _check(code, out / "reshard-8.log", "the 8-device run")
    shutil.copytree(eight, four)
    last = max(int(p.name) for p in (four / "checkpoints").iterdir() if p.name.isdigit())
    shutil.rmtree(four / "checkpoints" / str(last))
    resumed_at = max(int(p.name) for p in (four / "checkpoints").iterdir() if p.name.isdigit())
    code, _ = _train(out / "reshard-4.log", 4, ["train", "--run-dir", str(four), "--resume"])
    _check(code, out / "reshard-4.log", "the 4-device resume")
    after = range(resumed_at + 1, steps + 1)
    return {"resumed_at": resumed_at, "max_rel_loss_vs_8_devices": _max_rel(_losses(four), _losses(eight), after)}


def _report(results: dict, config: str | None, overrides: list[str]) -> str:
    """report.md: the failure drill's prediction vs measurement, both goodput ledgers, both loss checks."""
    base, drill = results["baseline"]["goodput"], results["failure"]["goodput"]
    predicted, resumed_at = results["failure"]["predicted"], results["reshard"]["resumed_at"]
    rows = [
        ("re-done steps", predicted["redone_steps"], drill["redone_steps"]),
        ("lost wall time (s): re-done steps + a second start-up", predicted["lost_s"],
         drill["wall_s"] - base["wall_s"]),
        ("re-done steps + stopping the survivor (s, ledger `restart`)", predicted["redone_and_stop_s"],
         drill["badput_s"]["restart"]),
    ]
    lines = ["# Lab 09: operations", "",
             f"config: {config or 'embedded default'} {' '.join(overrides)}; fault after step "
             f"{results['fault_step']}, checkpoints every {results['checkpoint_every']} steps; median step time "
             f"{results['baseline']['step_time_s'] * 1e3:.0f} ms (baseline)", "",
             "| failure drill | predicted | measured | ratio |", "|---|---|---|---|"]
    for name, p, m in rows:
        lines.append(f"| {name} | {p:.2f} | {m:.2f} | {m / p if p else float('nan'):.2f} |")
    lines += ["", "| run | wall (s) | goodput | startup+compile (s) | checkpoint (s) | restart (s) | data wait (s) |"
              " other (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, g in (("baseline", base), ("failure drill", drill)):
        b = g["badput_s"]
        lines.append(f"| {name} | {g['wall_s']:.1f} | {g['goodput']:.1%} | {b['startup_compile']:.1f} | "
                     f"{b['checkpoint']:.1f} | {b['restart']:.1f} | {b['data_wait']:.2f} | {b['other']:.1f} |")
    lines += ["", f"failure drill losses vs baseline: max relative deviation "
              f"{results['failure']['max_rel_loss_vs_baseline']:.2e} (tolerance {TOLERANCE:g})",
              f"reshard drill (8 -> 4 devices, resumed at step {resumed_at}): max relative deviation "
              f"{results['reshard']['max_rel_loss_vs_8_devices']:.2e} (tolerance {TOLERANCE:g})",
              "", "![goodput timeline](goodput_timeline.png)"]
    return "\n".join(lines) + "\n"


def run_lab(out: Path, config: str | None, overrides: list[str], seed: int | None) -> dict:
    """The three drills (baseline, failure, reshard) in `out`, then report.md and results.json."""
    out.mkdir(parents=True, exist_ok=True)
    args = _train_args(config, overrides)
    steps, every, fault_step = _fault_step(overrides, seed)
    results: dict[str, Any] = {"fault_step": fault_step, "checkpoint_every": every, "steps": steps}
    results["baseline"] = _baseline(out, args)
    results["failure"] = _failure_drill(out, args, results)
    results["reshard"] = _reshard_drill(out, args, steps)
    report = _report(results, config, overrides)
    (out / "report.md").write_text(report)
    write_results(out, results)
    print(report)
    ok = max(results["failure"]["max_rel_loss_vs_baseline"], results["reshard"]["max_rel_loss_vs_8_devices"])
    if ok > TOLERANCE:
        print(f"FAILED: losses differ by {ok:.2e} > {TOLERANCE:g}")
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, config_help="config file (default: the embedded default; configs/test.py: the tiny test "
                                        "model, faster)",
                         set_help=f"override a config field (on top of {' '.join(LAB_DEFAULTS)})")
    p.add_argument("--out", metavar="DIR", help="output directory (default: runs/lab-operations-<time>)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random fault step (default: random)")
    p.add_argument("--cpu-devices", type=int, metavar="N", help=argparse.SUPPRESS)
    add_quick(p, config=TEST_CONFIG, seed=3,
              overrides=["train.steps=8", "train.checkpoint_every=2", "train.eval_every=4"])


def run_from_args(args) -> int:
    out = Path(args.out) if args.out else Path("runs") / f"lab-operations-{time.strftime('%Y%m%d-%H%M%S')}"
    results = run_lab(out, args.config, args.overrides, args.seed)
    worst = max(results["failure"]["max_rel_loss_vs_baseline"], results["reshard"]["max_rel_loss_vs_8_devices"])
    return 0 if worst <= TOLERANCE else 1


def main(argv=None) -> int:
    """Standalone entry (experiments/09_operations/run.py): parse, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

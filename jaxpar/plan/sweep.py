"""Defend a plan with measurements: a Slurm job array over the top candidates, then the merged defence.

`jaxpar plan ... --sweep N --out DIR` writes DIR/candidates.json (the N best candidates this
checkout builds, with the planner's predictions and the config each runs) and DIR/sweep.sbatch,
a job array with one task per candidate, run one at a time (`%1`: tasks sharing a node would time
each other's load). Each task (`python -m jaxpar.plan.sweep DIR INDEX`) compiles its candidate's
training step and, after one warm-up step, trains R repeats of K steps on one batch, writing
DIR/results/INDEX.json: each step's wall-clock time, each repeat's median, and the compiled step's
per-device memory peak (and the device's own peak where the backend reports one). `jaxpar plan
collect DIR` merges them into DIR/defence.md: predicted vs measured, the ranking by measurement, the
noise (each candidate's spread over its repeats), and the Spearman rank correlation; a difference
inside the noise (the repeats' ranges overlap) is reported as not resolved, never as a choice.

One process per task: a candidate must fit one node's devices (the CPU candidates of the test,
or a single-node GPU plan); multi-node candidates need `jaxpar slurm`'s multi-process launch.
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
from pathlib import Path

from jaxpar.config import ConfigError
from jaxpar.measure.host_allocator import JEMALLOC_CONF, jemalloc_library

RESULTS = "results"
MIN_REPEATS = 3       # fewer repeats give no noise estimate


def write_sweep(p, config_path: str, overrides: list[str], count: int, steps: int, out: Path,
                platform: str, cpu_devices: int | None, layout: str = "jaxpar", repeats: int = MIN_REPEATS) -> Path:
    """candidates.json and sweep.sbatch for the `count` best candidates the checkout builds."""
    from jaxpar.config import apply_overrides, config_reference, load_config
    from jaxpar.plan.verify import candidate_config, candidate_overrides
    if layout != "jaxpar":
        raise ConfigError("--layout", f"'{layout}' is formula only: a sweep trains jaxpar's own layout (jaxpar)")
    base = load_config(config_path)
    apply_overrides(base, overrides)
    chosen: list = []
    for r in p.ranked:
        if len(chosen) == count:
            break
        if r.cand.devices > p.cluster.per_node:
            continue
        if candidate_config(base, r.cand, p.global_batch, p.seq_len, platform)[0] is not None:
            chosen.append(r)
    if len(chosen) < count:
        raise ConfigError("--sweep", f"is {count}; only {len(chosen)} ranked candidates fit one node and build here")
    entries = [{"index": i, "strategy": r.label, "candidate": r.cand.to_dict(),
                "overrides": candidate_overrides(r.cand, p.global_batch, p.seq_len, platform),
                "predicted_step_s": r.time.total_s, "predicted_memory": r.memory.total,
                "predicted_tokens_per_s_per_device": r.tokens_per_s / r.cand.devices}
               for i, r in enumerate(chosen)]
    # the array tasks run elsewhere: a preset by name, the user's own file by its absolute path
    spec = {"config": config_reference(config_path), "overrides": overrides, "platform": platform,
            "cpu_devices": cpu_devices, "global_batch": p.global_batch, "seq_len": p.seq_len, "steps": steps,
            "repeats": repeats,
            "cluster": p.cluster.describe(), "candidates": entries}
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS).mkdir(exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)      # Slurm does not create the --output folder
    (out / "candidates.json").write_text(json.dumps(spec, indent=2) + "\n")
    script = out / "sweep.sbatch"
    script.write_text(sbatch_text(out, len(entries), platform, p.cluster.per_node))
    return script


def sbatch_text(out: Path, tasks: int, platform: str, per_node: int) -> str:
    out = out.resolve()
    gpus = [f"#SBATCH --gpus-per-node={per_node}"] if platform == "gpu" else []
    jemalloc = jemalloc_library() if platform == "cpu" else None
    keep = [f'export LD_PRELOAD="{jemalloc}${{LD_PRELOAD:+ $LD_PRELOAD}}" MALLOC_CONF={JEMALLOC_CONF}'
            "   # keep freed host memory (jemalloc)"] if jemalloc else []
    run = f"{shlex.quote(sys.executable)} -m jaxpar.plan.sweep {shlex.quote(str(out))} \"$SLURM_ARRAY_TASK_ID\""
    return "\n".join(["#!/bin/bash", "#SBATCH --job-name=jaxpar-sweep", f"#SBATCH --array=0-{tasks - 1}%1",
                      "#SBATCH --nodes=1", "#SBATCH --ntasks=1", *gpus,
                      f"#SBATCH --output={out}/logs/task-%a.out", f"#SBATCH --chdir={Path.cwd()}",
                      "# one array task per candidate, one at a time (%1: no task times another's load): R repeats "
                      "of K steps, step times and memory", *keep,
                      f"srun --kill-on-bad-exit=1 {run}", ""])


def run_task(out: Path, index: int) -> dict:
    """One array task: measure candidate `index` of `out`/candidates.json, write results/INDEX.json."""
    spec = json.loads((out / "candidates.json").read_text())
    entry = spec["candidates"][index]
    allocator = "host allocator unchanged (not a CPU candidate)"
    if spec["platform"] == "cpu":
        from jaxpar.measure.host_allocator import keep_freed_memory
        from jaxpar.mesh import set_cpu_devices
        set_cpu_devices(spec["cpu_devices"])
        allocator = keep_freed_memory()     # as lab 10's CPU check (jemalloc if the script preloaded it): no
        # per-step page faults a GPU would not pay
    else:                                   # jaxpar's GPU XLA_FLAGS, as `jaxpar train` gets them (before JAX starts)
        from jaxpar.env import with_gpu_defaults
        os.environ["XLA_FLAGS"] = with_gpu_defaults(os.environ.get("XLA_FLAGS", ""))
    import jax

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.plan.reality import measure_steps
    from jaxpar.plan.space import Candidate
    base = load_config(spec["config"])
    apply_overrides(base, spec["overrides"])
    cand = Candidate(**entry["candidate"])
    steps, repeats = spec["steps"], spec.get("repeats", MIN_REPEATS)
    measured = measure_steps(base, [cand], spec["global_batch"], spec["seq_len"], steps * repeats, warmup=1,
                             log=lambda line: print(line, flush=True))[0]
    stats = jax.devices()[0].memory_stats() or {}
    medians = [statistics.median(measured.times[r * steps:(r + 1) * steps]) for r in range(repeats)]
    result = {"index": index, "strategy": entry["strategy"], "times_s": measured.times, "repeats_s": medians,
              "step_s": statistics.median(medians), "compile_s": measured.compile_s, "allocator": allocator,
              "page_faults": measured.faults,
              "memory_compiled": measured.memory_bytes, "memory_device_peak": stats.get("peak_bytes_in_use")}
    (out / RESULTS / f"{index}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    import numpy as np

    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = x.argsort()
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):
            r[x == value] = r[x == value].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def collect(out: Path) -> tuple[str, dict]:
    """The defence from a finished sweep: predicted vs measured, ranked by measurement (markdown, data)."""
    if not (out / "candidates.json").is_file():
        raise ConfigError("collect", f"'{out}' holds no candidates.json; give the --out DIR of `jaxpar plan --sweep`")
    spec = _sweep_spec(out / "candidates.json")
    rows, missing = [], []
    for entry in spec["candidates"]:
        path = out / RESULTS / f"{entry['index']}.json"
        if not path.is_file():
            missing.append(entry["strategy"])
            continue
        measured = _json(path)   # a task killed mid-write leaves half a file, or `{}`: reported, not fatal
        if not _a_result(measured):
            missing.append(f"{entry['strategy']} ({RESULTS}/{path.name} is damaged)")
            continue
        rows.append({**entry, **measured, "ratio": measured["step_s"] / entry["predicted_step_s"]})
    if len(rows) < 2:
        raise ConfigError("collect", f"{len(rows)} of {len(spec['candidates'])} array tasks left results in "
                          f"{out / RESULTS}; the defence needs at least 2 (see {out / 'logs'})")
    rho = spearman([r["predicted_step_s"] for r in rows], [r["step_s"] for r in rows])
    verdict = decide(rows)
    return markdown(spec, rows, rho, missing, verdict), {"rows": rows, "spearman": rho, "missing": missing,
                                                         "verdict": verdict}


def noise(row: dict) -> tuple[float, float] | None:
    """The (lowest, highest) of a candidate's repeat medians: its measured step within the noise; None with fewer
    than MIN_REPEATS repeats (no noise estimate)."""
    repeats = row.get("repeats_s") or []
    return (min(repeats), max(repeats)) if len(repeats) >= MIN_REPEATS else None


def resolved(a: dict, b: dict) -> bool:
    """Whether two candidates' measured steps differ beyond the noise: their repeats' ranges do not overlap."""
    na, nb = noise(a), noise(b)
    return na is not None and nb is not None and (na[1] < nb[0] or nb[1] < na[0])


def decide(rows: list[dict]) -> dict:
    """The verdict on the planner's choice: 'confirmed', 'choose' (another candidate is faster beyond the noise)
    or 'not resolved' (the fastest measured and the planner's choice differ by less than the noise)."""
    fastest = min(rows, key=lambda r: r["step_s"])
    chosen = next((r for r in rows if r["index"] == 0), None)
    ties = [r["strategy"] for r in rows if r is not fastest and not resolved(r, fastest)]
    if chosen is None:
        return {"verdict": "not resolved", "text": "not resolved: the planner's choice left no result"}
    if fastest is chosen:
        if ties:
            return {"verdict": "not resolved", "text": "not resolved: the planner's choice measured fastest, but "
                    f"inside the noise of {', '.join(ties)}"}
        return {"verdict": "confirmed", "text": "the planner's choice is also the fastest measured, beyond the noise"}
    if not resolved(fastest, chosen):
        return {"verdict": "not resolved", "text": f"not resolved: the fastest measured, {fastest['strategy']} (the "
                f"planner's #{fastest['index'] + 1}), is inside the noise of the planner's choice"}
    return {"verdict": "choose", "text": f"the fastest measured is the planner's #{fastest['index'] + 1}, "
            f"{fastest['strategy']}, beyond the noise: choose it"}


def _json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except ValueError:   # not JSON, or not UTF-8
        return None


def _positive(value, zero_too: bool = False) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and (value > 0 or zero_too and value == 0)


def _a_result(measured) -> bool:
    """What `run_task` writes: step times and the compiled memory (a half-written file or `{}` is not)."""
    return (isinstance(measured, dict) and _positive(measured.get("step_s"))
            and _positive(measured.get("memory_compiled"), zero_too=True)
            and isinstance(measured.get("times_s"), list) and bool(measured["times_s"])
            and all(map(_positive, measured["times_s"]))
            and isinstance(measured.get("repeats_s", []), list) and all(map(_positive, measured.get("repeats_s", []))))


def _sweep_spec(path: Path) -> dict:
    """candidates.json as `jaxpar plan --sweep` writes it, or one line saying it is not."""
    spec = _json(path)
    good = (isinstance(spec, dict) and all(k in spec for k in ("cluster", "global_batch", "seq_len", "steps"))
            and isinstance(spec.get("candidates"), list)
            and all(isinstance(e, dict) and isinstance(e.get("index"), int) and isinstance(e.get("strategy"), str)
                    and _positive(e.get("predicted_step_s")) and _positive(e.get("predicted_memory"))
                    for e in spec["candidates"]))
    if not good:
        raise ConfigError("collect", f"'{path}' is not the candidate list `jaxpar plan --sweep` writes (damaged or "
                          "edited); run the sweep again into an empty --out DIR")
    return spec


def _noise_text(r: dict) -> str:
    band = noise(r)
    if band is None:
        return "no estimate (fewer than 3 repeats)"
    return f"{band[0]:.4f}-{band[1]:.4f} (±{(band[1] - band[0]) / 2 / r['step_s']:.1%})"


def markdown(spec: dict, rows: list[dict], rho: float, missing: list[str], verdict: dict) -> str:
    by_measured = sorted(rows, key=lambda r: r["step_s"])
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]]
    lines = ["# The plan's defence, measured", "",
             f"{spec['cluster']}; global batch {spec['global_batch']} x {spec['seq_len']} tokens; the array tasks ran "
             f"one at a time, each {spec.get('repeats', 1)} repeats of {spec['steps']} steps after one warm-up "
             "(measured: the median of the repeats' median steps, wall clock; noise: the lowest-highest repeat).", "",
             "| measured rank | planner's rank | strategy | predicted s | measured s | noise: repeats s | "
             "measured / predicted | memory MB predicted / compiled |", "|---:|---:|---|---:|---:|---|---:|---|"]
    for rank, r in enumerate(by_measured, 1):
        lines.append(f"| {rank} | {r['index'] + 1} | {r['strategy']} | {r['predicted_step_s']:.4f} | "
                     f"{r['step_s']:.4f} | {_noise_text(r)} | {r['ratio']:.2f} | "
                     f"{r['predicted_memory'] / 1e6:,.1f} / {r['memory_compiled'] / 1e6:,.1f} |")
    spread = statistics.median(r["ratio"] for r in rows)
    lines += ["", f"**Verdict: {verdict['text']}.** Spearman rank correlation of predicted and measured step times: "
              f"{rho:.2f} over {len(rows)} candidates, {sum(resolved(a, b) for a, b in pairs)} of {len(pairs)} pairs "
              f"resolved beyond the noise (the rest rank noise). Median measured / predicted: {spread:.2f}."]
    if missing:
        lines.append(f"No result (task failed or still running): {', '.join(missing)}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m jaxpar.plan.sweep DIR INDEX (one array task of `jaxpar plan --sweep`)",
              file=sys.stderr)
        return 2
    run_task(Path(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

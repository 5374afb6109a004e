"""Lab 04 (pipeline parallelism): schedules as tables, their bubble, measured; memory vs m; p2p bytes; a 7B dry run.

Seven parts, every number beside its prediction (experiments/04_pipeline/README.md is the lab sheet):

a. tables       the bubble of every schedule's table (parallel/schedules.py) against (p-1)/(m+p-1),
                (p-1)/(v*m+p-1) and (p-1)/(3m+p-1) (parallel/schedules.py), exact fractions, and the tables drawn.
b. equivalence  every schedule, the circular pipeline and 3D layouts against the single-device run
                (fp32, same batches): max relative deviation of losses and gradient norms.
c. timeline     one profiled step per hand-written schedule on the CPU mesh: each stage's busy time per tick
                (the tick's switch in the trace), drawn as the schedule picture with F/B/W coloured; the
                measured idle fraction beside the table's bubble, and beside the lock-step model of the
                table with each action's measured duration.
d. memory       compiled temp (activations, stash, gradient buffers) per stage at m = p, 2p, 4p with a fixed
                microbatch: GPipe and the circular pipeline keep every microbatch, 1F1B and ZB-H1 p.
e. p2p bytes    collective-permute bytes per step over `pipe` (compiled HLO) against 2(K-1)·m·b·s·h·e
                (K = p·v model stages) and the table's own sends.
f. dry run      configs/arabic_7b.py with pipe=4 x tensor=8 x fsdp=2 on 64 devices (a subprocess: the CPU device
                count is fixed when JAX starts): memory per stage, bytes per axis, predicted bubble.
g. dualpipev    DeepSeek's V-shaped schedule (torchtitan's ScheduleDualPipeV): each table's idle ticks per stage
                against the published (PP/2-1)(F&B+B-3W) and its activations against PP+1; DualPipeV and manual
                TP x FSDP inside pipelines against the single device.
h. pipedream    PipeDream-2BW (asynchronous, one step of weight staleness) against synchronous 1F1B from the same
                initial state: the loss curves and their gap (not an equivalence: staleness is the design).
i. moe          MoE in every schedule, expert parallelism inside the stages, accumulation and rules, SP's
                collective matmuls in every hand-written schedule, each against one device accumulating the
                same microbatches (labs/pipeline/moe.py).

Files in the run directory: report.md, results.json, tables.png, timeline.png, memory.png, bytes.png,
dryrun_7b/ (dryrun.md, dryrun.json), pipedream.png. `--parts` runs a subset.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, load_config, preset
from jaxpar.labs.arguments import PIPELINE_PARTS as PARTS
from jaxpar.labs.arguments import pipeline as add_arguments
from jaxpar.labs.base.report import md_table
from jaxpar.labs.base.runner import Part, chosen_parts, run_directory, run_parts, sheet_header, standalone_main
from jaxpar.labs.pipeline.build import LAB_MODEL, MICRO, REPO, TABLE_CASES, VOCAB, Lab, _pipe
from jaxpar.labs.pipeline.moe import moe_pipelines
from jaxpar.labs.pipeline.plots import PLOTS
from jaxpar.labs.pipeline.timeline import timeline
from jaxpar.measure import hlo
from jaxpar.measure.executed import executed_collectives, tick_parts
from jaxpar.parallel.pipeline import B_MID, F_FIRST, F_MID
from jaxpar.parallel.schedules import bubble_fraction, build, dualpipe_idle, p2p_bytes, validate
from jaxpar.parallel.schedules import dualpipev as dualpipev_table
from jaxpar.units import fmt_bytes

TOLERANCE = 1e-4


# ============================================================================ a. tables

def tables(lab: Lab) -> dict:
    rows, sweep = [], []
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            for name, v in TABLE_CASES:
                s = build(name, p, m, v)
                validate(s)
                formula = bubble_fraction(name, p, m, v)
                sweep.append({"schedule": name, "p": p, "m": m, "v": v, "ticks": s.ticks,
                              "table": float(s.bubble()), "formula": float(formula),
                              "exact": s.bubble() == formula, "in_flight": max(s.in_flight())})
                if p == 4 and m == 8:
                    rows.append([name, p, m, v, s.ticks, str(s.bubble()), str(formula), f"{float(s.bubble()):.4f}",
                                 "yes" if s.bubble() == formula else "NO", max(s.in_flight()), s.in_flight_bound])
    pictures = {name: build(name, 4, 8, v).picture() for name, v in TABLE_CASES}
    exact = all(r["exact"] for r in sweep)
    md = "\n".join([
        "## a. Schedules as tables: bubble = idle cells / all cells (every action one tick)", "",
        md_table(["schedule", "p", "m", "v", "ticks", "bubble (table)", "formula", "decimal", "equal",
                "max in flight", "claimed bound"], rows), "",
        f"Over p in (2, 4, 8) x m in (p, 2p, 4p) ({len(sweep)} tables) every table's bubble equals its formula "
        f"exactly: {'yes' if exact else 'NO'}. Formulas: GPipe and 1F1B (p-1)/(m+p-1); interleaved "
        "(p-1)/(v·m+p-1) in chunk ticks; ZB-H1 (p-1)/(3m+p-1) with t_F = t_B = t_W. In flight: chunk-microbatches "
        "whose activations a stage holds at once (1F1B: p on stage 0; GPipe: m).", "",
        "The p=4, m=8 tables (`F3` = forward of microbatch 3, `B2.1` = backward of microbatch 2 on chunk 1):", "",
        *[f"```\n{name}\n{picture}\n```" for name, picture in pictures.items()]])
    return {"p4_m8": rows, "sweep": sweep, "all_exact": exact, "pictures": pictures, "markdown": md}


# ============================================================================ b. equivalence

EQUIVALENCE = [
    ("GPipe p=4 m=8", _pipe("gpipe", 4, 8), 4),
    ("1F1B p=4 m=8", _pipe("1f1b", 4, 8), 4),
    ("interleaved p=2 v=2 m=4", _pipe("interleaved", 2, 4, 2), 2),
    ("interleaved p=4 v=2 m=8", _pipe("interleaved", 4, 8, 2), 4),
    ("ZB-H1 p=4 m=8", _pipe("zb-h1", 4, 8), 4),
    ("circular p=4 m=8", _pipe("circular", 4, 8), 4),
    ("circular p=2 v=2 m=4", _pipe("circular", 2, 4, 2), 2),
    ("data=2 x pipe=2 x tensor=2, 1F1B m=4", _pipe("1f1b", 2, 4, data=2, tensor=2), 8),
    ("fsdp=2 x pipe=2 x tensor=2, ZB-H1 m=4", _pipe("zb-h1", 2, 4, fsdp=2, tensor=2), 8),
]


def equivalence(lab: Lab, steps: int) -> dict:
    result = equivalence_of(lab, lab.few(EQUIVALENCE, 1, 8), steps)   # quick: 1F1B and a 3D layout
    md = "\n".join([f"## b. Equivalence with one device ({steps} steps, fp32, batches of {MICRO} rows per microbatch)",
                    "", result["table"]])
    return {"cases": result["cases"], "markdown": md}


def equivalence_of(lab: Lab, cases, steps: int) -> dict:
    """Each (label, overrides, devices) against one device over the same batches: {"cases", "table"}."""
    rows, out = [], {}
    for label, overrides, devices in cases:
        strategy, step = lab.compiled(overrides, devices)
        oracle_t, oracle_s = lab.compiled(["mesh.data=1", f"train.batch_size={strategy.config.train.batch_size}"], 1)
        want_losses, want_norms = lab.run(oracle_t, oracle_s, steps)
        losses, norms = lab.run(strategy, step, steps)
        dev = max(abs(g / w - 1) for g, w in zip(losses, want_losses))
        dev_norm = max(abs(g / w - 1) for g, w in zip(norms, want_norms))
        out[label] = {"losses": losses, "oracle": want_losses, "max_rel_loss": dev, "max_rel_grad_norm": dev_norm}
        rows.append([label, f"{losses[0]:.4f} -> {losses[-1]:.4f}", f"{dev:.1e}", f"{dev_norm:.1e}",
                     "yes" if max(dev, dev_norm) <= TOLERANCE else "NO"])
    table = md_table(["layout", "loss", "max rel. dev. loss", "max rel. dev. grad norm", f"within {TOLERANCE:g}"],
                     rows)
    return {"cases": out, "table": table}


# ============================================================================ d. memory

MEMORY = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("circular", 1)]


def memory(lab: Lab, p: int) -> dict:
    from jaxpar.measure.memory import compiled_memory
    out: dict[str, dict[str, Any]] = {}
    rows = []
    for name, v in MEMORY:
        series: list[dict[str, Any]] = []
        for m in (p, 2 * p, 4 * p):
            strategy, step = lab.compiled(_pipe(name, p, m, v), p)
            cm = compiled_memory(step, "cpu")
            stash = None
            if hasattr(strategy, "program"):
                kept = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in strategy.stage_functions.kept)
                taps = sum(int(np.prod((strategy.chunk_layers, *s.shape))) * np.dtype(s.dtype).itemsize
                           for site in strategy.stage_functions.sites.values() for s in (site.x, site.y))
                stash = strategy.program.slots["stash"] * kept + strategy.program.slots["wstash"] * taps
            series.append({"m": m, "temp": cm.temp, "peak": cm.peak, "argument": cm.argument, "stash": stash,
                           "slots": dict(strategy.program.slots) if hasattr(strategy, "program") else None})
        base = series[0]["temp"]
        out[name] = {"v": v, "series": series, "growth_4p": series[-1]["temp"] / base}
        for r in series:
            rows.append([name + (f" v={v}" if v > 1 else ""), r["m"], fmt_bytes(r["temp"]), f"{r['temp'] / base:.2f}",
                         "-" if r["stash"] is None else fmt_bytes(r["stash"]),
                         "-" if r["stash"] is None else fmt_bytes(r["temp"] - r["stash"]),
                         "-" if r["slots"] is None else r["slots"]["stash"], fmt_bytes(r["peak"])])
    flat = out["1f1b"]["growth_4p"]
    grows = out["gpipe"]["growth_4p"]
    md = "\n".join([
        f"## d. Compiled activation memory per stage as m grows (p={p}, {MICRO} rows per microbatch)", "",
        md_table(["schedule", "m", "compiled temp", "temp / temp at m=p", "stash (predicted: slots x residuals)",
                "temp - stash", "stash slots", "peak"], rows), "",
        f"1F1B's temp at m=4p is {flat:.3f}x its m=p value (flat: within +-15%: "
        f"{'yes' if abs(flat - 1) <= 0.15 else 'NO'}); GPipe's grows {grows:.2f}x (at least 2.5x: "
        f"{'yes' if grows >= 2.5 else 'NO'}); ZB-H1 {out['zb-h1']['growth_4p']:.3f}x, circular "
        f"{out['circular']['growth_4p']:.2f}x. Compiled temp = XLA:CPU's temp buffers: the stash, the receive "
        "buffers, the gradient accumulators and one tick's working set (arguments and outputs apart). Predicted "
        "stash = the table's slots x one microbatch's residuals (jax.vjp's, weights left out) + ZB's taps. Every "
        "stage runs the same SPMD program: the buffers are sized for the busiest stage (stage 0)."])
    return {"schedules": out, "onefoneb_growth": flat, "gpipe_growth": grows, "markdown": md}


# ============================================================================ e. p2p bytes

def _permute_pairs(hlo_text: str) -> dict[str, int]:
    pairs = {}
    for m in re.finditer(r"%(\S+) = [^\n]*?collective-permute(?:-start)?\([^\n]*?source_target_pairs=\{(.*?)\}\}",
                         hlo_text):
        pairs[m.group(1)] = m.group(2).count("{")
    return pairs


def permute_bytes(strategy, text: str) -> float:
    """All devices' collective-permute bytes per step together: each permute's buffer x its runs x its
    source-target pairs; a hand-written pipeline's tick sends (`pipeline_send_*`) as each stage executes them,
    x the devices of a stage."""
    pairs, mesh = _permute_pairs(text), strategy.mesh
    permutes = lambda found: [c for c in found if c.op == "collective-permute"]
    program = getattr(strategy, "program", None)
    sends = {n for n, part in tick_parts(text).items() if part.startswith("send_")} if program else set()
    total = sum(c.result_bytes * c.runs_per_step * pairs.get(c.name, 1)
                for c in permutes(hlo.collectives(text, mesh)) if c.name not in sends)
    if program is None:
        return total
    p = program.schedule.stages
    for stage in range(p):
        total += sum(c.result_bytes * c.runs_per_step * mesh.size // p
                     for c in permutes(executed_collectives(text, mesh, program, stage)) if c.name in sends)
    return total


def p2p(lab: Lab, p: int, m: int) -> dict:
    rows, out = [], {}
    for name, v in MEMORY:
        strategy, step = lab.compiled(_pipe(name, p, m, v), p)
        compiled = permute_bytes(strategy, step.as_text())
        cfg = strategy.config
        e = 4
        K = p * v
        formula = p2p_bytes(K, m, MICRO, cfg.data.seq_len, cfg.model.d_model, e)
        a = MICRO * cfg.data.seq_len * cfg.model.d_model * e
        useful = None
        if hasattr(strategy, "program"):
            table = strategy.program.table["branch"]
            chunk = strategy.program.table["chunk"]
            stage = np.arange(p)[None, :]
            k = chunk * p + stage
            sends = ((np.isin(table, (F_FIRST, F_MID)) & (k < K - 1)).sum()
                     + (np.isin(table, (B_MID,)) & (k > 0)).sum())
            useful = int(sends) * a
        out[name] = {"compiled": compiled, "formula": formula, "table_sends": useful, "v": v}
        rows.append([name + (f" v={v}" if v > 1 else ""), fmt_bytes(formula),
                     "-" if useful is None else fmt_bytes(useful), fmt_bytes(compiled), f"{compiled / formula:.2f}"])
    md = "\n".join([
        f"## e. Point-to-point bytes per step over `pipe` (p={p}, m={m}, b={MICRO}, fp32)", "",
        md_table(["schedule", "formula 2(K-1)·m·b·s·h·e", "the table's sends", "compiled (HLO permutes)",
                "compiled / formula"], rows), "",
        "Summed over all stages: each collective-permute's buffer x its runs per step x its source-target pairs "
        "(a tick's sends: per stage, the ticks on which it sends). The table's sends (every F but the last model "
        "stage's, every B but the first's) equal the formula. The executor sends, on each tick, over just the "
        "pairs the table sends on (a switch over the tick's set of pairs, the same index on every device; a "
        "bubble tick sends nothing), so it sends the useful buffers only, as an MPMD runtime "
        "(torch.distributed.pipelining) does. The circular pipeline rolls every stage's buffer each iteration, "
        "forward and backward (XLA splits the backward roll in two)."])
    return {"schedules": out, "markdown": md}


# ============================================================================ f. dry run of the 7B

def dryrun_7b(lab: Lab, out: Path) -> dict:
    from jaxpar.measure.targets import gpu_plugin_problem
    config = preset("arabic_7b")
    target = out / "dryrun_7b"
    sets = ["mesh.data=1", "mesh.pipe=4", "mesh.tensor=8", "mesh.fsdp=2", "parallel.pipe=1f1b",
            "parallel.pipe_microbatches=16"]
    argv = [sys.executable, "-m", "jaxpar.cli", "dryrun", "--config", str(config), "--devices", "64",
            "--out", str(target), *[x for s in sets for x in ("--set", s)]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=REPO, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the 7B dry run failed: {result.stderr.strip()[-2000:]}")
    report = json.loads((target / "dryrun.json").read_text())
    pipe = report["pipeline"]
    p, m = pipe["stages"], pipe["microbatches"]
    rows = [[axis, fmt_bytes(row["bytes"]), fmt_bytes(row["predicted_bytes"]) if row["predicted_bytes"] else "-",
             f"{row['bytes'] / row['predicted_bytes']:.3f}" if row["predicted_bytes"] else "-"]
            for axis, row in sorted(report["collectives"]["by_axis"].items())]
    cm = report["memory"]["compiled"]
    gpu = gpu_plugin_problem()
    bubbles = {name: float(bubble_fraction(name, p, m, v)) for name, v in (("1f1b", 1), ("interleaved", 2),
                                                                            ("zb-h1", 1))}
    md = "\n".join([
        "## f. Dry run: configs/arabic_7b.py, pipe=4 x tensor=8 x fsdp=2 on 64 CPU devices, 1F1B m=16", "",
        f"Compiled for the CPU target in {report['timing']['compile_s']:.1f} s. Memory per stage (each stage's "
        f"program): arguments {fmt_bytes(cm['argument'])} (params and Adam state: fp32, 1/64 of the blocks and 1/16 of "
        f"the embedding and head each), temp {fmt_bytes(cm['temp'])}, peak {fmt_bytes(cm['peak'])} "
        f"({cm['peak_method']}); "
        f"stash of {pipe['stash_slots']} microbatches (b = {256 // 2 // m} rows x 4096 tokens, remat full).", "",
        md_table(["mesh axis", "compiled bytes / device / step", "predicted", "ratio"], rows), "",
        f"Predicted bubble (formula = table): 1F1B {pipe['bubble_formula']:.4f} ({pipe['ticks']} ticks); with the "
        f"same p and m, interleaved v=2 would be {bubbles['interleaved']:.4f} and ZB-H1 {bubbles['zb-h1']:.4f}. "
        f"The tensor bytes are the busiest stage's Megatron all-reduces: 2 per layer per forward, 2 (+1 recomputed "
        f"under remat full) per backward, of b·s·h each. Deviceless H100: "
        + ("not run: " + gpu if gpu else "see dryrun_7b_h100/") + ".",
        "", f"Full report: {target.name}/dryrun.md."])
    return {"report": {k: report[k] for k in ("memory", "collectives", "pipeline", "timing")},
            "bubbles": bubbles, "gpu": gpu, "markdown": md}


# ============================================================================ g. DualPipeV

DUALPIPEV_EQUIVALENCE = [
    ("DualPipeV p=4 m=8", _pipe("dualpipev", 4, 8, 2), 4),
    ("DualPipeV p=2 m=4, manual TP x FSDP: fsdp=2 x tensor=2", _pipe("dualpipev", 2, 4, 2, fsdp=2, tensor=2)
     + ["parallel.tensor=manual"], 8),
    ("1F1B p=2 m=4, manual TP: data=2 x tensor=2", _pipe("1f1b", 2, 4, data=2, tensor=2)
     + ["parallel.tensor=manual"], 8),
]


def dualpipev(lab: Lab, steps: int) -> dict:
    rows, sweep = [], []
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            s = build("dualpipev", p, m)
            validate(s)
            published = dualpipe_idle(2 * p, f_and_b=3, b=2, w=1)
            idle, peak = s.idle_ticks(), max(s.in_flight())
            unblocked = dualpipev_table(p, m, blocks=False)
            validate(unblocked)
            sweep.append({"p": p, "m": m, "ticks": s.ticks, "idle": idle, "published_idle": published,
                          "in_flight": peak, "published_in_flight": 2 * p + 1, "bubble": float(s.bubble()),
                          "zb_h1_bubble": float(build("zb-h1", p, m).bubble()),
                          "idle_without_blocks": unblocked.idle_ticks(),
                          "exact": idle == [published] * p and peak == 2 * p + 1})
            rows.append([p, 2 * p, m, s.ticks, ", ".join(map(str, sorted(set(idle)))), f"{published:g}", peak,
                         2 * p + 1, f"{float(s.bubble()):.4f}", f"{float(build('zb-h1', p, m).bubble()):.4f}",
                         ", ".join(map(str, sorted(set(unblocked.idle_ticks())))),
                         "yes" if sweep[-1]["exact"] else "NO"])
    cases = equivalence_of(lab, lab.few(DUALPIPEV_EQUIVALENCE, 1), steps)
    md = "\n".join([
        "## g. DualPipeV: DeepSeek's V as a table (torchtitan: `ScheduleDualPipeV`)", "",
        "2p model stages on p stages in a V (stage s holds model stages s and 2p-1-s); every F, B (input gradient) "
        "and W one tick; an overlapped F&B pair is one block (it starts when both inputs are there; what it sends "
        "leaves when it is done), so F&B = F+B = 3, B (full) = 2, W = 1 ticks. Published (DeepSeek-V3 report, "
        "deepseek-ai/DualPipe): bubble (PP/2-1)(F&B+B-3W) per device, activations PP+1, PP = 2p.", "",
        md_table(["p", "PP", "m", "ticks", "idle ticks per stage (table)", "published", "max in flight (table)",
                  "PP+1", "bubble fraction", "ZB-H1's", "idle without blocks", "equal"], rows), "",
        "Without blocks (the same per-stage orders, each action sending as soon as it is done) a stage idles only "
        "the V's fill; the blocks cost the rest. In ticks DualPipeV's bubble fraction is ZB-H1's "
        "(p-1)/(3m+p-1); what DualPipe adds on a GPU, the F&B overlap of compute with the EP all_to_alls, "
        "a tick table does not model.", "",
        f"```\ndualpipev p=4 m=8\n{build('dualpipev', 4, 8).picture()}\n```", "",
        f"Against one device, {steps} steps, fp32:", "", cases["table"]])
    return {"sweep": sweep, "all_exact": all(r["exact"] for r in sweep), "cases": cases["cases"], "markdown": md}


# ============================================================================ h. PipeDream-2BW

def pipedream(lab: Lab, steps: int) -> dict:
    curves = {}
    for name in ("1f1b", "pipedream-2bw"):
        strategy, step = lab.compiled(_pipe(name, 4, 8), 4)
        curves[name] = lab.run(strategy, step, steps)[0]
    sync, stale = np.array(curves["1f1b"]), np.array(curves["pipedream-2bw"])
    gap = stale - sync
    marks = sorted({0, 1, 4, 9, steps // 2, steps - 1} & set(range(steps)))
    rows = [[i + 1, f"{sync[i]:.4f}", f"{stale[i]:.4f}", f"{gap[i]:+.4f}", f"{gap[i] / sync[i]:+.2%}"] for i in marks]
    below = lambda curve, level: next((i + 1 for i, x in enumerate(curve) if x <= level), None)
    level = float(sync[0] - 0.5 * (sync[0] - sync[-1]))
    md = "\n".join([
        f"## h. PipeDream-2BW against synchronous 1F1B: p=4, m=8, {steps} steps from the same initial state", "",
        "PipeDream-2BW keeps two weight versions so that no stage waits for a flush: W(t+1) = W(t) - lr·g(W(t-1)), "
        "one step of staleness (parallel/pipedream.py; the first step applies nothing). It does not reproduce one "
        "device, by design. PyTorch counterparts: DeepSpeed's pipeline engine runs the synchronous PipeDream-Flush "
        "(1F1B, `TrainSchedule`); the asynchronous 2BW is the PipeDream authors' own code.", "",
        md_table(["step", "1F1B loss", "2BW loss", "2BW - 1F1B", "relative"], rows), "",
        f"Steps to halve the 1F1B run's loss drop (to {level:.4f}): 1F1B {below(sync, level)}, "
        f"2BW {below(stale, level)}. Mean gap over the last half: {float(gap[steps // 2:].mean()):+.4f}."])
    return {"steps": steps, "losses": curves, "gap": gap.tolist(), "markdown": md}


# ============================================================================ the whole lab


def run_lab(overrides: list[str], out: str | Path | None = None, *, steps: int = 5, warmup: int = 2,
            parts: tuple[str, ...] = PARTS, pipedream_steps: int = 60, quick: bool = False, log=print) -> dict:
    """Parts `parts` into `out`; `quick`: the equivalence parts (b, c, g, i) on a few of their layouts."""
    start = time.perf_counter()
    if steps < 1 or warmup < 1 or pipedream_steps < 2:
        raise ConfigError("--steps" if steps < 1 else "--warmup" if warmup < 1 else "--pipedream-steps",
                          "must be at least 1 (--pipedream-steps: 2)")
    parts = tuple(chosen_parts(parts, PARTS))
    if len(jax.devices()) < 8:
        raise ConfigError("--cpu-devices", f"the lab needs 8 devices (3D layouts) but JAX has {len(jax.devices())}; "
                          "on CPU pass --cpu-devices 8")
    config = load_config("configs/test.py")
    apply_overrides(config, LAB_MODEL + list(overrides))
    out = run_directory(out, "pipeline", config)
    lab = Lab(config, out, log, quick)
    p, m = 4, 8
    c = config.model
    header = sheet_header(
        f"Lab 04: pipeline parallelism on {len(jax.devices())} x {jax.devices()[0].platform}",
        f"Model: d_model {c.d_model}, {c.layers} layers, {c.heads} heads, vocab {VOCAB}, seq {config.data.seq_len}; "
        f"synthetic batches of {MICRO} rows per pipeline microbatch. Measured values come from the compiled "
        "program, the profiler or the clock; predicted ones from the formulas named beside them.")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "devices": len(jax.devices())}
    plan = {"tables": lambda: tables(lab), "equivalence": lambda: equivalence(lab, steps),
            "timeline": lambda: timeline(lab, p, m, warmup), "memory": lambda: memory(lab, p),
            "p2p": lambda: p2p(lab, p, m), "dryrun": lambda: dryrun_7b(lab, out),
            "dualpipev": lambda: dualpipev(lab, steps), "pipedream": lambda: pipedream(lab, pipedream_steps),
            "moe": lambda: moe_pipelines(lab, steps)}
    return run_parts("pipeline", out, [Part(name, plan[name]) for name in parts], results, [header], PLOTS,
                     start=start, log=log)


# ============================================================================ command line

def run_from_args(args) -> int:
    run_lab(args.overrides, args.out, steps=args.steps, warmup=args.warmup, parts=args.parts,
            pipedream_steps=args.pipedream_steps, quick=args.quick)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/*/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

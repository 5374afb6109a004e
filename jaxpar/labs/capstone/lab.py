"""Lab 10 (course module 7, the capstone): choose and defend a strategy for a 7B Arabic LM on H100s.

One run, six parts, every prediction beside what checks it (experiments/10_capstone/README.md
is the assignment sheet). Files in --out: report.md, results.json, plan.png, memory.png,
steptime.png, cpu_check.png, fertility.png, and the collectives sweep (bench/).

a. plan          `jaxpar plan` for the config on the cluster: ranked table and defence.
b. calibration   every efficiency the step-time model divides by, and whether it is an
                 assumption, a fit, or measured; the published MFU anchors vs the planner.
c. compiler      the best buildable candidates compiled deviceless for the GPU (needs the CUDA
                 plugin wheels; skipped with the install line otherwise): memory and bytes per axis.
d. reality       the same planner on N virtual CPU devices vs measured step times (interleaved
                 rounds, medians; CPU seconds per core, the check, and wall clock), with η and a
                 fixed overhead calibrated on one strategy per basis; ratios and rankings.
e. fertility     BPE 8k/32k/64k, with and without diacritics: tokens per Arabic word, FLOPs per
                 word, GPU-hours and cost per billion words at the chosen strategy.
f. risks         failures per day, the Young/Daly checkpoint interval, expected goodput.

`--parts` runs and reports a subset (`--parts d`: the CPU check alone); the plan is always computed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from jaxpar.config import ConfigError
from jaxpar.labs.arguments import add_quick
from jaxpar.labs.capstone.plots import plots
from jaxpar.labs.capstone.sheet import ASSUMED_PRICE, GB, WITHIN, markdown

PARTS = "abcdef"
VOCABS = (8000, 32000, 64000)
ASSUMED_REQUEUE_S = 300.0         # scheduler requeue + process start-up after a failure (assumption)
ASSUMED_STORAGE_GBPS_PER_NODE = 2.0   # checkpoint read/write bandwidth per node to shared storage (assumption)
ASSUMED_HOST_COPY_GBPS = 10.0     # device -> host copy per GPU before an async checkpoint write (assumption)
ASSUMED_COMPILE_S = 30.0          # the 7B step's compile time if the deviceless compile was not run (assumption)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxpar.plan.command import add_plan_options as add_plan_arguments
    add_plan_arguments(p)
    p.set_defaults(tokens="1e12", verify=3, price=None)
    p.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds of the CPU check (default 15)")
    p.add_argument("--cpu-devices", type=int, default=8, help="virtual CPU devices of the CPU check (default 8)")
    p.add_argument("--ops-results", metavar="FILE",
                   help="results.json of `jaxpar lab operations` (module 6): its measured start-up and checkpoint "
                        "times feed the risks section")
    p.add_argument("--keep-host-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="the CPU check keeps freed host memory, so steps do not pay page faults that a GPU's "
                        "allocator never would: it runs in a fresh process with jemalloc preloaded (never purging) "
                        "where the machine has it (Debian: libjemalloc2), else tells glibc to keep it (default on; "
                        "--no-keep-host-memory measures glibc's default)")
    p.add_argument("--skip-cpu", action="store_true", help="leave out the CPU reality check (part d)")
    p.add_argument("--parts", metavar="LIST", default=PARTS,
                   help="the parts to run and report, e.g. d for the CPU reality check alone (default abcdef; the "
                        "plan is always computed: it checks the inputs and c, e and f use it)")
    add_quick(p, verify=0, rounds=3)


def run_from_args(args) -> int:
    from jaxpar.measure.targets import prepare_process
    prepare_process("h100", None)      # JAX stays on CPU (the CPU check runs there); GPU compiles use a topology
    if not args.out:
        args.out = f"runs/capstone-{time.strftime('%Y%m%d-%H%M%S')}"
    run_lab(args)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/10_capstone/run.py): parse, set the CPU devices, run; bad input exits 2."""
    from jaxpar.labs.base.runner import standalone_main
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)


# ============================================================================ the parts

def part_plan(args, log):
    from jaxpar.model.counting import ModelShape
    from jaxpar.plan.command import check_inputs
    from jaxpar.plan.planner import plan
    parts = chosen_parts(args)
    if args.rounds < 3:
        raise ConfigError("--rounds", f"is {args.rounds}; a median needs at least 3 rounds")
    if "d" in parts and args.cpu_devices != 8:
        raise ConfigError("--cpu-devices", f"is {args.cpu_devices}; the CPU check's strategies are written for 8 "
                          "devices (or give --skip-cpu)")
    if args.ops_results and not Path(args.ops_results).is_file():
        raise ConfigError("--ops-results", f"no such file '{args.ops_results}'")
    config, cluster, tokens, note = check_inputs(args)
    if cluster.price_per_gpu_hour is None:
        cluster = dataclasses.replace(cluster, price_per_gpu_hour=ASSUMED_PRICE)
    global_batch = args.global_batch if args.global_batch is not None else config.train.batch_size
    seq_len = args.seq_len if args.seq_len is not None else config.data.seq_len
    log("a. plan")
    p = plan(ModelShape.from_config(config), cluster, global_batch=global_batch, seq_len=seq_len, tokens=tokens,
             headroom=args.headroom)
    p.budget_note = note
    return config, p


def chosen_parts(args) -> str:
    """The letters of `--parts` in the lab's order, less d with --skip-cpu; unknown letters are bad input."""
    given = set(args.parts.replace(",", "").replace(" ", "").lower())
    if not given or given - set(PARTS):
        raise ConfigError("--parts", f"'{args.parts}': give letters of {PARTS}, e.g. --parts d")
    return "".join(c for c in PARTS if c in given and not (c == "d" and args.skip_cpu))


def part_compiler(args, p, config, log) -> dict:
    from jaxpar.measure.targets import GPU_TARGETS, gpu_plugin_problem
    target = args.gpu.lower().removesuffix("-sxm").removesuffix("-80gb")
    if not args.verify:
        return {"skipped": "not asked for (--verify 0)"}
    if target not in GPU_TARGETS:
        return {"skipped": f"no deviceless compile target for '{args.gpu}' (targets: {', '.join(GPU_TARGETS)})"}
    problem = gpu_plugin_problem()
    if problem:
        return {"skipped": problem}
    from jaxpar.plan.verify import verify
    log(f"c. compiler: the {args.verify} best buildable candidates, deviceless {target}")
    verified, skipped = verify(p, config, args.verify, target, log=log)
    return {"verified": verified, "not_built": skipped}


def part_reality(args, out: Path, log) -> dict:
    """The planner on the CPU devices vs measured steps of the default config, on two timing bases: CPU seconds per
    core (the check: other jobs' load does not enter it) and wall clock (plan/reality.py)."""
    import jax

    from jaxpar.measure.host_allocator import call_with_kept_memory
    from jaxpar.model.counting import ModelShape
    from jaxpar.plan.reality import resolved_pairs
    from jaxpar.plan.sweep import spearman
    n = len(jax.devices("cpu"))
    log(f"d. reality: {n} virtual CPU devices; collectives sweep and host probe")
    if args.keep_host_memory:
        allocator, clusters, info, measured = call_with_kept_memory(measure_reality, n, out / "bench", args.rounds)
    else:
        allocator, clusters, info, measured = measure_reality(n, out / "bench", args.rounds, keep=False)
    base = reality_config()
    shape = ModelShape.from_config(base)
    batch, seq = base.train.batch_size, base.data.seq_len
    half = measured.pop() if len(measured) > 1 and measured[-1].global_batch != batch else None
    bases = {basis: predictions(measured, half, shape, clusters[basis], batch, seq, basis) for basis in ("cpu", "wall")}
    rows = []
    for i, m in enumerate(measured):
        cpu, wall = bases["cpu"]["rows"][i], bases["wall"]["rows"][i]
        rows.append({"strategy": m.cand.label(), "measured_s": m.median_s, "times_s": m.times,
                     "cpu_times_s": m.cpu_times, "cpu_s": m.cpu_step_s, "faults_per_step": statistics.median(m.faults),
                     "predicted_s": cpu["predicted_s"],
                     "ratio": m.cpu_step_s / cpu["predicted_s"], "predicted_wall_s": wall["predicted_s"],
                     "ratio_wall": m.median_s / wall["predicted_s"], "terms": cpu["terms"],
                     "compile_s": m.compile_s, "bytes_predicted": cpu["bytes"], "bytes_compiled": m.compiled_bytes,
                     "calibration": m is measured[0]})
    for key in ("predicted_s", "cpu_s", "predicted_wall_s", "measured_s"):
        for i, r in enumerate(sorted(rows, key=lambda r: r[key]), 1):
            r[key.removesuffix("_s") + "_rank"] = i
    checked = [r for r in rows if not r["calibration"]]
    fastest = min(rows, key=lambda r: r["cpu_s"])
    return {"cluster": clusters["cpu"].describe(), "host": info["host"]["source"], "allocator": allocator,
            "fits": info["fits"],
            "cpu_fits": info["cpu_fits"], "cores": info["cores"], "rounds": args.rounds,
            "calibration": bases["cpu"]["calibration"].source, "eta": bases["cpu"]["calibration"].compute,
            "step_overhead_s": bases["cpu"]["calibration"].step_overhead_s,
            "calibration_wall": bases["wall"]["calibration"].source,
            "half_batch_s": half.median_s if half else None, "half_batch_cpu_s": half.cpu_step_s if half else None,
            "rows": rows, "within": sum(abs(r["ratio"] - 1) <= WITHIN for r in checked), "checked": len(checked),
            "fastest": fastest["strategy"], "fastest_predicted_rank": fastest["predicted_rank"],
            "spearman": spearman([r["predicted_s"] for r in rows], [r["cpu_s"] for r in rows]),
            "resolved_pairs": resolved_pairs([r["predicted_s"] for r in rows], [r["cpu_times_s"] for r in rows]),
            "spearman_wall": spearman([r["predicted_wall_s"] for r in rows], [r["measured_s"] for r in rows])}


def reality_config():
    """The default config with the default BPE's vocabulary (so no tokenizer is needed): part d's model."""
    from jaxpar.config import apply_overrides, load_config
    base = load_config(None)
    apply_overrides(base, ["model.vocab_size=1024"])
    return base


def measure_reality(devices: int, bench_dir: Path, rounds: int, keep: bool = True) -> tuple:
    """Part d's measurements (allocator, clusters, host info, steps), in the process that will time them: one that
    keeps freed host memory (`call_with_kept_memory` may start a fresh one, which needs its CPU devices set)."""
    import jax

    from jaxpar.measure.host_allocator import keep_freed_memory
    from jaxpar.measure.targets import prepare_process
    from jaxpar.plan.reality import default_strategies, measure_cluster, measure_steps
    jax.config.update("jax_platforms", "cpu")      # as the lab's process has it (a fresh one starts without)
    prepare_process("cpu", devices)
    allocator = keep_freed_memory() if keep else "host allocator: glibc's default (not changed)"
    log(f"  {allocator}")
    clusters, info = measure_cluster(devices, bench_dir, log=log)
    base = reality_config()
    batch, seq = base.train.batch_size, base.data.seq_len
    strategies = default_strategies()
    log(f"  measuring {len(strategies)} strategies of the default config (and the first at half the batch, for the "
        f"fixed per-step overhead), {rounds} interleaved rounds")
    measured = measure_steps(base, [*strategies, (strategies[0], batch // 2)], batch, seq, rounds, log=log)
    return allocator, clusters, info, measured


def predictions(measured, half, shape, cluster, batch: int, seq: int, basis: str) -> dict:
    """η and O calibrated on the first strategy on one timing basis, then every strategy's prediction."""
    from jaxpar.plan.planner import evaluate
    from jaxpar.plan.reality import calibrate
    calibration = calibrate(cluster, shape, measured[0], half, seq, basis)
    rows = []
    for m in measured:
        r = evaluate(shape, m.cand, cluster, batch, seq, 1e9, headroom=0.0, calibration=calibration)
        rows.append({"predicted_s": r.time.total_s, "terms": r.time.terms(), "bytes": r.comm_bytes})
    return {"calibration": calibration, "rows": rows}


def part_fertility(config, p, log) -> dict:
    """Tokens per word for each vocabulary and normalisation, and what that costs at the chosen strategy."""
    from jaxpar.plan.fertility import fertility
    from jaxpar.plan.planner import evaluate
    log("e. fertility: BPE 8k/32k/64k, with and without diacritics")
    best = p.best.cand
    rows = []
    for vocab in VOCABS:
        shape = type(p.shape)(dataclasses.replace(p.shape.model, vocab_size=vocab))
        r = evaluate(shape, best, p.cluster, p.global_batch, p.seq_len, p.tokens, p.headroom)
        flops_per_token = shape.flops_per_token(p.seq_len)
        for normalize in (False, True):
            f = fertility(config.data.corpus, vocab, normalize)
            tokens_per_billion = 1e9 * f["tokens_per_word"]
            gpu_hours = tokens_per_billion / r.tokens_per_s * best.devices / 3600
            rows.append({**f, "flops_per_word": flops_per_token * f["tokens_per_word"],
                         "tokens_per_s": r.tokens_per_s, "gpu_hours_per_billion_words": gpu_hours,
                         "cost_per_billion_words": gpu_hours * p.cluster.price_per_gpu_hour,
                         "model_params": shape.params, "fits": r.memory.fits})
    return {"corpus": config.data.corpus, "strategy": p.best.label, "rows": rows}


def part_risks(args, p, compiler: dict) -> dict:
    from jaxpar.plan.risks import FAILURES_PER_GPU_DAY, assess
    state_bytes = 12 * p.shape.params                           # fp32 params + AdamW μ, ν
    per_gpu = p.best.memory.state
    sources = {}
    checkpoint_s = per_gpu / (ASSUMED_HOST_COPY_GBPS * GB)      # async save: training blocks for the host copy
    sources["checkpoint"] = (f"{per_gpu / GB:.2f} GB of state per GPU copied to host at an assumed "
                             f"{ASSUMED_HOST_COPY_GBPS:.0f} GB/s (Orbax writes the rest in the background)")
    restore_s = state_bytes / (p.cluster.nodes * ASSUMED_STORAGE_GBPS_PER_NODE * GB)
    compiled = [v.compile_s for v in compiler.get("verified", [])]
    compile_s = max(compiled) if compiled else ASSUMED_COMPILE_S
    compile_source = (f"measured: the slowest deviceless compile of part c, {compile_s:.0f} s" if compiled
                      else f"assumed {ASSUMED_COMPILE_S:.0f} s (part c did not compile)")
    restart_s = ASSUMED_REQUEUE_S + compile_s + restore_s
    sources["restart"] = (f"requeue + start-up {ASSUMED_REQUEUE_S:.0f} s (assumed) + compile ({compile_source}) + "
                          f"restore {state_bytes / GB:.0f} GB at {ASSUMED_STORAGE_GBPS_PER_NODE:.0f} GB/s per node "
                          f"(assumed) = {restore_s:.0f} s")
    if args.ops_results:
        ops = json.loads(Path(args.ops_results).read_text())
        base = ops["baseline"]["goodput"]
        saves = max(1, ops["steps"] // ops["checkpoint_every"])
        sources["module 6"] = (f"module 6 measured (its small CPU run): start-up + compile "
                               f"{base['badput_s']['startup_compile']:.1f} s, "
                               f"{base['badput_s']['checkpoint'] / saves:.2f} "
                               f"s blocking per save, goodput {base['goodput']:.1%}; used for the structure of the "
                               "badput, not its size (a 7B on 64 GPUs saves and compiles far more)")
    risk = assess(p.best.cand.devices, p.best.days, checkpoint_s, restart_s)
    gpus = p.best.cand.devices
    scaled = [dataclasses.asdict(assess(n, p.best.days * gpus / n, checkpoint_s, restart_s))
              for n in (gpus * 16, gpus * 64, gpus * 256)]     # the same work on more GPUs (perfect scaling)
    return {"risk": dataclasses.asdict(risk), "sources": sources, "failures_per_gpu_day": FAILURES_PER_GPU_DAY,
            "step_s": p.best.time.total_s, "scaled": scaled}


# ============================================================================ the run

def log(line: str) -> None:
    print(line, flush=True)


def run_lab(args) -> dict:
    from jaxpar.labs.base.results import write_results
    out = Path(args.out)
    started = time.perf_counter()
    config, p = part_plan(args, log)              # every input checked before anything is written
    parts = chosen_parts(args)
    out.mkdir(parents=True, exist_ok=True)
    anchors = compiler = reality = fert = risks = None
    if "b" in parts:
        log("b. calibration and anchors")
        anchors = anchor_rows()
    if "c" in parts:
        compiler = part_compiler(args, p, config, log)
    reality = part_reality(args, out, log) if "d" in parts else None
    fert = part_fertility(config, p, log) if "e" in parts else None
    if "f" in parts:
        risks = part_risks(args, p, compiler or {"skipped": "not asked for (--parts)"})
    results = {"parts": parts, "plan": plan_summary(p) if "a" in parts else None, "anchors": anchors,
               "compiler": compiler_json(compiler) if compiler else None, "reality": reality, "fertility": fert,
               "risks": risks, "elapsed_s": time.perf_counter() - started}
    report = markdown(p, config, anchors, compiler, reality, fert, risks, results["elapsed_s"], parts)
    (out / "report.md").write_text(report)
    write_results(out, results)
    plots(p, reality, fert, out, parts)
    log(report)
    log(f"wrote {out}/report.md, results.json and plots ({results['elapsed_s']:.0f} s)")
    return results


def anchor_rows() -> list[dict]:
    """Each published run, predicted with its own strategy and its framework's η (plan/anchors.py)."""
    from jaxpar.plan.anchors import anchor_table
    return anchor_table()


def plan_summary(p) -> dict:
    from jaxpar.plan.command import plan_json
    return plan_json(p)


def compiler_json(compiler: dict) -> dict:
    if "verified" not in compiler:
        return compiler
    return {"verified": [dataclasses.asdict(v) for v in compiler["verified"]], "not_built": compiler["not_built"]}


# ============================================================================ the report

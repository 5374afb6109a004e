"""Lab 07 (course module 7, the capstone): choose and defend a strategy for a 7B Arabic LM on H100s.

One run, six parts, every prediction beside what checks it (experiments/07_capstone/README.md
is the assignment sheet). Files in --out: report.md, results.json, plan.png, memory.png,
steptime.png, cpu_check.png, fertility.png, and the collectives sweep (bench/).

a. plan          `jaxpar plan` for the config on the cluster: ranked table and defence.
b. calibration   every efficiency the step-time model divides by, and whether it is an
                 assumption, a fit, or measured; the published MFU anchors vs the planner.
c. compiler      the best buildable candidates compiled deviceless for the GPU (needs the CUDA
                 plugin wheels; skipped with the install line otherwise): memory and bytes per axis.
d. reality       the same planner on N virtual CPU devices vs measured step times (interleaved
                 rounds, medians), with η calibrated on one strategy; ratios and rankings.
e. fertility     BPE 8k/32k/64k, with and without diacritics: tokens per Arabic word, FLOPs per
                 word, GPU-hours and cost per billion words at the chosen strategy.
f. risks         failures per day, the Young/Daly checkpoint interval, expected goodput.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from jaxpar.config import ConfigError
from jaxpar.figures import figure, legend_below, save, styled

GB, GIB = 1e9, 2**30
WITHIN = 0.30                     # the reality check's tolerance: |measured / predicted - 1| <= 30%
VOCABS = (8000, 32000, 64000)
ASSUMED_PRICE = 2.5               # $ per H100-hour when --price is not given (an assumption, stated in the report)
ASSUMED_REQUEUE_S = 300.0         # scheduler requeue + process start-up after a failure (assumption)
ASSUMED_STORAGE_GBPS_PER_NODE = 2.0   # checkpoint read/write bandwidth per node to shared storage (assumption)
ASSUMED_HOST_COPY_GBPS = 10.0     # device -> host copy per GPU before an async checkpoint write (assumption)
ASSUMED_COMPILE_S = 30.0          # the 7B step's compile time if the deviceless compile was not run (assumption)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxpar.plan.command import add_plan_options as add_plan_arguments
    add_plan_arguments(p)
    p.set_defaults(tokens="1e12", verify=3, price=None)
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds of the CPU check (default 7)")
    p.add_argument("--cpu-devices", type=int, default=8, help="virtual CPU devices of the CPU check (default 8)")
    p.add_argument("--ops-results", metavar="FILE",
                   help="results.json of `jaxpar lab operations` (module 6): its measured start-up and checkpoint "
                        "times feed the risks section")
    p.add_argument("--skip-cpu", action="store_true", help="leave out the CPU reality check (part d)")


def run_from_args(args) -> int:
    from jaxpar.measure.targets import prepare_process
    prepare_process("h100", None)      # JAX stays on CPU (the CPU check runs there); GPU compiles use a topology
    if not args.out:
        args.out = f"runs/capstone-{time.strftime('%Y%m%d-%H%M%S')}"
    run_lab(args)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/07_capstone/run.py): parse, set the CPU devices, run; bad input exits 2."""
    from jaxpar.mesh import set_cpu_devices
    parser = argparse.ArgumentParser(prog="run.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        set_cpu_devices(args.cpu_devices)
        return run_from_args(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def recorded_compiles() -> int:
    """How many deviceless H100 compiles the memory model was fitted and checked against (0 outside a checkout)."""
    path = Path(__file__).resolve().parents[2] / "tests" / "data" / "h100_7b_compiles.json"
    return len(json.loads(path.read_text())["compiles"]) if path.is_file() else 0


# ============================================================================ the parts

def part_plan(args, log):
    from jaxpar.model.counting import ModelShape
    from jaxpar.plan.command import check_inputs
    from jaxpar.plan.planner import plan
    if args.rounds < 3:
        raise ConfigError("--rounds", f"is {args.rounds}; a median needs at least 3 rounds")
    if not args.skip_cpu and args.cpu_devices != 8:
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
    """The planner on the CPU devices vs measured steps of the default config."""
    import jax

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.model.counting import ModelShape
    from jaxpar.plan.planner import evaluate
    from jaxpar.plan.reality import calibrate, default_strategies, measure_cluster, measure_steps
    n = len(jax.devices("cpu"))
    log(f"d. reality: {n} virtual CPU devices; collectives sweep and host probe")
    cluster, info = measure_cluster(n, out / "bench", log=log)
    base = load_config(None)
    apply_overrides(base, ["model.vocab_size=1024"])     # the default BPE's vocabulary, so no tokenizer is needed
    shape = ModelShape.from_config(base)
    batch, seq = base.train.batch_size, base.data.seq_len
    strategies = default_strategies()
    log(f"  measuring {len(strategies)} strategies of the default config (and the first at half the batch, for the "
        f"fixed per-step overhead), {args.rounds} interleaved rounds")
    measured = measure_steps(base, [*strategies, (strategies[0], batch // 2)], batch, seq, args.rounds, log=log)
    half = measured.pop() if len(measured) > 1 and measured[-1].global_batch != batch else None
    calibration = calibrate(cluster, shape, measured[0], half, seq)
    rows = []
    for m in measured:
        r = evaluate(shape, m.cand, cluster, batch, seq, 1e9, headroom=0.0, calibration=calibration)
        rows.append({"strategy": m.cand.label(), "measured_s": m.median_s, "times_s": m.times,
                     "cpu_times_s": m.cpu_times, "predicted_s": r.time.total_s,
                     "ratio": m.median_s / r.time.total_s, "terms": r.time.terms(), "compile_s": m.compile_s,
                     "bytes_predicted": r.comm_bytes, "bytes_compiled": m.compiled_bytes,
                     "calibration": m is measured[0]})
    for key in ("predicted", "measured"):
        for i, r in enumerate(sorted(rows, key=lambda r: r[f"{key}_s"]), 1):
            r[f"{key}_rank"] = i
    checked = [r for r in rows if not r["calibration"]]
    fastest = min(rows, key=lambda r: r["measured_s"])
    from jaxpar.plan.sweep import spearman
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    return {"cluster": cluster.describe(), "host": info["host"]["source"], "fits": info["fits"],
            "rounds": args.rounds, "calibration": calibration.source, "eta": calibration.compute,
            "step_overhead_s": calibration.step_overhead_s, "half_batch_s": half.median_s if half else None,
            "rows": rows,
            "within": sum(abs(r["ratio"] - 1) <= WITHIN for r in checked), "checked": len(checked),
            "fastest": fastest["strategy"], "fastest_predicted_rank": fastest["predicted_rank"], "spearman": rho}


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
    out = Path(args.out)
    started = time.perf_counter()
    config, p = part_plan(args, log)              # every input checked before anything is written
    out.mkdir(parents=True, exist_ok=True)
    log("b. calibration and anchors")
    anchors = anchor_rows()
    compiler = part_compiler(args, p, config, log)
    reality = None if args.skip_cpu else part_reality(args, out, log)
    fert = part_fertility(config, p, log)
    risks = part_risks(args, p, compiler)
    results = {"plan": plan_summary(p), "anchors": anchors, "compiler": compiler_json(compiler),
               "reality": reality, "fertility": fert, "risks": risks,
               "elapsed_s": time.perf_counter() - started}
    report = markdown(p, config, anchors, compiler, reality, fert, risks, results["elapsed_s"])
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plots(p, reality, fert, out)
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

def _pct(x: float) -> str:
    return f"{x:.1%}"


def markdown(p, config, anchors, compiler, reality, fert, risks, elapsed) -> str:
    from jaxpar.plan import fleet as cl
    from jaxpar.plan import memory as mem
    from jaxpar.plan import steptime as st
    from jaxpar.plan.planner import defence, summary_line, table
    from jaxpar.plan.verify import annotate, buildable_sentence, verification_table
    best = p.best
    annotate(p, config, 10)
    lines = ["# Lab 07: the capstone plan", "",
             f"Every figure is a **prediction** unless it says *measured* or *compiled*. jaxpar's planner "
             f"(`jaxpar plan`, `jaxpar/plan/`); {time.strftime('%Y-%m-%d')}; this run took {elapsed:.0f} s.", "",
             "## a. The plan", "", summary_line(p), "", table(p, 10), "", "![plan](plan.png)", "",
             "### Defence", "", defence(p) + " " + buildable_sentence(p, config), "",
             f"## The chosen strategy: {best.label}", "",
             "| memory per device | GB |", "|---|---:|"]
    lines += [f"| {k} | {v / GB:.2f} |" for k, v in best.memory.parts().items()]
    lines += [f"| **total** (usable: {best.memory.limit / GB:.0f} GB) | **{best.memory.total / GB:.2f}** |", "",
              "| step time | seconds | share |", "|---|---:|---:|"]
    t = best.time
    lines += [f"| {k} | {v:.3f} | {v / t.total_s:.1%} |" for k, v in t.terms().items()]
    lines += [f"| **step** | **{t.total_s:.3f}** | |",
              f"| (nothing overlapped: the pessimistic bound) | {t.serial_s:.3f} | |", "",
              "Communication per axis (bytes per device per step, time if nothing were hidden, exposed):", "",
              "| axis | GB | link | seconds | exposed |", "|---|---:|---|---:|---:|"]
    for axis, seconds in t.comm_s.items():
        link = p.cluster.axis_link(best.cand, axis).name
        lines.append(f"| {axis} | {best.comm_bytes.get(axis, 0) / GB:.2f} | {link} | {seconds:.3f} | "
                     f"{t.exposed_s.get(axis, 0):.3f} |")
    lines += ["", "![memory](memory.png) ![step time](steptime.png)", "",
              "## b. Calibration: what is assumed, fitted, measured", "",
              "| quantity | value | kind | source |", "|---|---:|---|---|",
              f"| compute efficiency η (GPU, jaxpar/XLA) | {st.COMPUTE_EFFICIENCY} | fitted on a published run's own "
              "strategy | MaxText's Llama-2-70B (the anchor table below; other frameworks have their own η) |",
              "| GEMM size factor g | per candidate | model | additive roofline 1/(1 + ridge/intensity) per weight "
              "matmul, time-weighted (`jaxpar/plan/gemm.py`); η is that of an ideal large GEMM |",
              f"| fp8 matmul efficiency | {st.FP8_EFFICIENCY} x η of the fp8 peak | fitted | NeMo's Llama-3.1-8B "
              "fp8 run; MFU is always against the bf16 peak |",
              f"| fixed overheads | {st.STEP_OVERHEAD_S * 1e3:.0f} ms per step + {st.LAYER_OVERHEAD_S * 1e6:.0f} µs "
              "per layer per microbatch | assumption | launch and tail gaps; CPU: measured (part d) |",
              f"| overlap of hideable collectives | {st.OVERLAP:.0%} | assumption | lab 02: XLA overlaps 5 of 8 "
              "forward and 4 of 8 backward gathers per layer in the compiled H100 step |",
              f"| memory-bound passes | {st.MEMORY_EFFICIENCY:.0%} of HBM bandwidth | assumption | |",
              f"| link efficiency | {cl.LINK_EFFICIENCY:.0%} of the datasheet | assumption | nccl-tests-like busbw; "
              "a group across nodes gets its GPUs per node x the per-GPU NIC, capped by NVLink (NCCL issue 812) |",
              f"| α NVLink / InfiniBand | {cl.ALPHA_NVLINK_S * 1e6:.0f} / {cl.ALPHA_INFINIBAND_S * 1e6:.0f} µs | "
              "assumption | |",
              f"| memory constants (score bytes {mem.SCORE_BYTES}, ...) | see jaxpar/plan/memory.py | fitted | "
              f"the {recorded_compiles()} deviceless H100 compiles of the 7B recorded in "
              "tests/data/h100_7b_compiles.json "
              "(none of them a candidate ranked here unless part c says so) |",
              f"| einsum-attention traffic | {st.SCORE_BYTES} bytes per S x S element | assumption | |",
              "| CPU η and overheads | part d | measured | the calibration strategies' measured steps |", "",
              *anchor_section(anchors)]
    lines += ["## c. Checked against the compiler", ""]
    if "verified" in compiler:
        lines += [f"Compiled deviceless for {p.cluster.name} ({p.cluster.nodes}x{p.cluster.per_node}); memory is "
                  "XLA:GPU's buffer-assignment peak, bytes are the compiled collectives per mesh axis "
                  "(`jaxpar.measure.hlo`).", "", verification_table(compiler["verified"]), ""]
        ratios = [v.memory_ratio for v in compiler["verified"]]
        if ratios:
            lines.append(f"Memory: compiled / predicted {min(ratios):.3f}-{max(ratios):.3f} "
                         f"({'all' if all(abs(r - 1) <= 0.1 for r in ratios) else 'NOT all'} within 10%).")
        lines += [f"- formula only (ranked above or among them): {s}" for s in compiler["not_built"]]
    else:
        lines.append(f"Skipped: {compiler['skipped']}.")
    lines.append("")
    lines += reality_section(reality)
    lines += fertility_section(fert, p)
    lines += risk_section(risks, p)
    return "\n".join(lines) + "\n"


def _spread(values: list[float]) -> float:
    return max(values) / min(values) - 1


def anchor_section(anchors) -> list[str]:
    """The anchor table: published tokens/s per GPU vs the planner's prediction of the run's own strategy."""
    lines = ["Published H100 runs, each predicted with its OWN strategy and memory layout and its framework's η "
             "(role η / fp8: that anchor fits it; check: predicted with the fitted values). Tokens/s per GPU:", "",
             "| anchor | framework (η) | role | cluster | batch | strategy | layout | published | predicted | "
             "predicted / published | MFU (bf16 peak) | fits |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---:|---|"]
    for a in anchors:
        lines.append(f"| {a['anchor']} | {a['framework']} ({a['eta']:.3f}) | {a['role']} | {a['cluster']} | "
                     f"{a['batch']} | {a['strategy']} | {a['layout']} | {a['published']:,.0f} | "
                     f"{a['predicted']:,.0f} | {a['ratio']:.2f} | {a['mfu']:.1%} | "
                     f"{'yes' if a['fits'] else 'no'} ({a['memory_gb']:.0f} GB) |")
    notes = sorted({a["note"] for a in anchors if a["note"]})
    lines += ["", *[f"- {n}" for n in notes],
              "- \"fits\" is jaxpar's memory model, whose activation constants are fitted on XLA compiles of jaxpar's "
              "own model: the published runs ran, so a \"no\" marks this model's limit for another framework's "
              "kernels (and any context parallelism, which halves the activations), not the runs'.", ""]
    return lines


def reality_section(reality) -> list[str]:
    if reality is None:
        return ["## d. Checked against reality", "", "Skipped (--skip-cpu).", ""]
    lines = ["## d. Checked against reality: the planner on this machine's CPU devices", "",
             f"{reality['cluster']}. {reality['host']}. Collectives (measured, `jaxpar bench collectives`):", "",
             "| op | α µs | β_bus GB/s |", "|---|---:|---:|"]
    lines += [f"| {op} | {f['alpha_us']:.0f} | {f['beta_bus_GBps'] or float('nan'):.2f} |"
              for op, f in reality["fits"].items()]
    wall = reality
    lines += ["", f"Default config (fp32, vocab 1024), {reality['rounds']} interleaved rounds, wall-clock median "
              f"step; calibration: {wall['calibration']}.", "",
              "| strategy | measured s: median (quartiles) | predicted s | measured / predicted | predicted rank | "
              "measured rank | bytes/step compiled / predicted (MB) |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in wall["rows"]:
        axes = "; ".join(f"{a} {r['bytes_compiled'].get(a, 0) / 1e6:.1f} / {r['bytes_predicted'].get(a, 0) / 1e6:.1f}"
                         for a in sorted(set(r["bytes_compiled"]) | set(r["bytes_predicted"]))
                         if r["bytes_compiled"].get(a) or r["bytes_predicted"].get(a))
        flag = " (calibration)" if r["calibration"] else ("" if abs(r["ratio"] - 1) <= WITHIN else " (off by > 30%)")
        q1, _, q3 = statistics.quantiles(r["times_s"], n=4)
        lines.append(f"| {r['strategy']} | {r['measured_s']:.3f} ({q1:.2f}-{q3:.2f}) | {r['predicted_s']:.3f} | "
                     f"{r['ratio']:.2f}{flag} | "
                     f"{r['predicted_rank']} | {r['measured_rank']} | {axes} |")
    lines += ["", f"**{wall['within']} of {wall['checked']}** predicted strategies within "
              f"{WITHIN:.0%} of measured; Spearman rank correlation of predicted and measured step times "
              f"**{wall['spearman']:.2f}** over {len(wall['rows'])} strategies; "
              f"the fastest measured ({wall['fastest']}) is ranked "
              f"**#{wall['fastest_predicted_rank']}** by the planner. Predictions span "
              f"{_spread([r['predicted_s'] for r in wall['rows']]):.0%} from fastest to slowest, measured medians "
              f"{_spread([r['measured_s'] for r in wall['rows']]):.0%}; a rank is only as good as the gaps between "
              "predictions. (results.json also keeps each step's CPU seconds, "
              "all of this process's threads.)", "",
              "![cpu check](cpu_check.png)", ""]
    return lines


def fertility_section(fert, p) -> list[str]:
    lines = ["## e. Arabic tokenizer fertility", "",
             f"Byte-level BPE (jaxpar's tokenizer) trained on nine tenths of the '{fert['corpus']}' documents, tokens "
             f"per word measured on the held-out tenth; cost at the chosen strategy ({fert['strategy']}) with the "
             "model's "
             f"vocabulary set to each size (the embedding and head change with it), at "
             f"{p.cluster.price_per_gpu_hour:.2f} per GPU-hour"
             f"{' (assumed price)' if p.cluster.price_per_gpu_hour == ASSUMED_PRICE else ''}.", "",
             "| vocab asked / reached | diacritics | tokens/word held out (train) | chars/word | model B params | "
             "TFLOPs per word | GPU-hours per billion words | cost per billion words |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in fert["rows"]:
        lines.append(f"| {r['vocab_requested']} / {r['vocab_reached']} | {'stripped' if r['normalize'] else 'kept'} | "
                     f"{r['tokens_per_word']:.3f} ({r['train_tokens_per_word']:.3f}) | "
                     f"{r['characters_per_word']:.2f} | "
                     f"{r['model_params'] / 1e9:.2f} | {r['flops_per_word'] / 1e12:.3f} | "
                     f"{r['gpu_hours_per_billion_words']:,.0f} | {r['cost_per_billion_words']:,.0f} |")
    lines += ["", "![fertility](fertility.png)", "",
              "The Quran is a small (about 78,000 words) and special corpus: one text, one register, fully vowelled "
              "Uthmani script with Quranic annotation marks, and heavy repetition of formulae. A BPE trained on it "
              "runs out of merges far below 64k (the 'reached' column) and learns whole words of this text, so its "
              "fertility on held-out suras is optimistic for Arabic at large and its train-set figure even more so. A "
              "real pre-training mix (news, web, books, Wikipedia, dialects in Arabic script and Arabizi, code, some "
              "English) has a far larger vocabulary of word forms (Arabic's clitics and morphology), mostly no "
              "diacritics (so normalisation matters less there), and needs the larger vocabularies to keep tokens "
              "per word low: measure fertility on a held-out sample of the real mix before fixing the budget.", ""]
    return lines


def risk_section(risks, p) -> list[str]:
    r = risks["risk"]
    lines = ["## f. Risks of a months-long run", "",
             f"Failure rate: {risks['failures_per_gpu_day']:.2e} per GPU-day (anchor: Llama 3's 419 unexpected "
             "interruptions in 54 days on 16,384 H100s; not measured here).", "",
             "| quantity | value |", "|---|---:|",
             f"| GPUs | {r['gpus']} |",
             f"| failures per day | {r['failures_per_day']:.3f} |",
             f"| mean time between failures | {r['mtbf_s'] / 86400:.1f} days |",
             f"| checkpoint blocking time δ | {r['checkpoint_s']:.2f} s |",
             f"| restart cost R | {r['restart_s'] / 60:.1f} min |",
             f"| Young interval sqrt(2δM) | {r['young_s'] / 60:.1f} min |",
             f"| Daly interval | {r['daly_s'] / 60:.1f} min (= {r['daly_s'] / risks['step_s']:.0f} steps) |",
             f"| expected goodput | {r['goodput']:.2%} |",
             f"| training days at 100% goodput / expected wall days | {r['run_days']:.1f} / {r['wall_days']:.1f} |",
             f"| expected failures over the run | {r['expected_failures']:.1f} |", "", "Where δ and R come from:", ""]
    lines += [f"- {k}: {v}" for k, v in risks["sources"].items()]
    lines += ["", "The same δ and R at larger scale (the same work spread perfectly over more GPUs):", "",
              "| GPUs | failures per day | MTBF (hours) | Daly interval (min) | goodput | expected failures |",
              "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {s['gpus']} | {s['failures_per_day']:.2f} | {s['mtbf_s'] / 3600:.1f} | {s['daly_s'] / 60:.1f} | "
              f"{s['goodput']:.2%} | {s['expected_failures']:.1f} |" for s in risks["scaled"]]
    lines += ["", "Other risks the numbers above do not price: loss spikes and divergence (keep several checkpoints, "
              "restart from an earlier one with a lower learning rate), silent data corruption (checksummed "
              "checkpoints, module 6), stragglers (one slow GPU slows every collective), and the data pipeline.", ""]
    return lines


# ============================================================================ plots

def plots(p, reality, fert, out: Path) -> None:
    """The report's figures (they need the plan object, so they are drawn here, not from results.json)."""
    plot_plan(p, out / "plan.png")
    plot_breakdown(p.best.label, p.best.memory.parts(), "GB per device (prediction)", GB, out / "memory.png",
                   limit=p.best.memory.limit)
    plot_breakdown(p.best.label, p.best.time.terms(), "seconds per step (prediction)", 1.0, out / "steptime.png")
    if reality:
        plot_cpu_check(reality, out / "cpu_check.png")
    plot_fertility(fert, out / "fertility.png")


@styled
def plot_plan(p, path: Path):
    top = p.ranked[:10]
    names = sorted({k for r in top for k in r.time.terms()}, key=lambda k: (k != "compute", k))
    fig = figure(10, 6.5)
    ax = fig.add_subplot()
    bottom = [0.0] * len(top)
    for name in names:
        values = [r.time.terms().get(name, 0.0) for r in top]
        ax.barh(range(len(top)), values, left=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_yticks(range(len(top)), [f"#{i} {r.label}" for i, r in enumerate(top, 1)], fontsize=10)
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds per step")
    ax.set_title("The ten best candidates: step time by term (prediction)")
    legend_below(ax, ncols=3, gap=0.12)
    return save(fig, path)


@styled
def plot_breakdown(label: str, parts: dict, unit: str, scale: float, path: Path, limit: float | None = None):
    """One stacked bar of the best plan: its memory parts or its step-time terms."""
    fig = figure(8, 3.4 + 0.3 * ((len(parts) + 2) // 2))
    ax = fig.add_subplot()
    left = 0.0
    for k, v in parts.items():
        ax.barh([0], [v / scale], height=0.6, left=left, label=k)
        left += v / scale
    if limit is not None:
        ax.axvline(limit / scale, color="k", linestyle="--", lw=2.5, label="usable memory per device")
    ax.set_yticks([])
    ax.set_xlabel(unit)
    ax.set_title(f"The chosen plan: {label}")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2)
    return save(fig, path)


@styled
def plot_cpu_check(reality: dict, path: Path):
    rows = reality["rows"]
    fig = figure(10, 5.8)
    ax = fig.add_subplot()
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["predicted_s"] for r in rows], 0.4, color="0.6", hatch="..", edgecolor="0.3",
           label="predicted")
    ax.bar([i + 0.2 for i in x], [r["measured_s"] for r in rows], 0.4, label="measured (median of the rounds)")
    ax.set_xticks(list(x), [r["strategy"].replace(" ", "\n") + ("\n(calibration)" if r["calibration"] else "")
                            for r in rows], fontsize=10)
    ax.set_ylabel("seconds per step")
    ax.set_title("CPU check: predicted vs measured step time; η is fitted on the calibration strategy")
    ax.title.set_wrap(True)
    legend_below(ax, ncols=2, gap=0.3)
    return save(fig, path)


@styled
def plot_fertility(fert: dict, path: Path):
    from matplotlib.ticker import ScalarFormatter
    fig = figure(7, 4.8)
    ax = fig.add_subplot()
    for normalize, label in ((False, "diacritics kept"), (True, "diacritics stripped")):
        rows = [r for r in fert["rows"] if r["normalize"] == normalize]
        ax.plot([r["vocab_requested"] for r in rows], [r["tokens_per_word"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set(xlabel="BPE vocabulary asked for", ylabel="tokens per word (held-out text)",
           title=f"Tokenizer fertility on '{fert['corpus']}' (measured)")
    legend_below(ax, ncols=2, gap=0.18)
    return save(fig, path)

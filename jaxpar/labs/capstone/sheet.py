"""Lab 10's report: the markdown sections of report.md (the plan, calibration, compiler, reality, fertility, risks).

capstone.py runs the parts and calls `markdown`; the constants here are the ones the report states.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

GB = 1e9
WITHIN = 0.30                     # the reality check's tolerance: |measured / predicted - 1| <= 30%
ASSUMED_PRICE = 2.5               # $ per H100-hour when --price is not given (an assumption, stated in the report)


def recorded_compiles() -> int:
    """How many deviceless H100 compiles the memory model was fitted and checked against (0 outside a checkout);
    those noted "not calibrated" are left out."""
    path = Path(__file__).resolve().parents[3] / "tests" / "data" / "h100_7b_compiles.json"
    if not path.is_file():
        return 0
    return sum(not rec.get("note", "").startswith("not calibrated") for rec in json.loads(path.read_text())["compiles"])


def _pct(x: float) -> str:
    return f"{x:.1%}"


def markdown(p, config, anchors, compiler, reality, fert, risks, elapsed, parts: str = "abcdef") -> str:
    """report.md: the sections of the parts that ran (`--parts`), in order."""
    lines = ["# Lab 10: the capstone plan", "",
             f"Every figure is a **prediction** unless it says *measured* or *compiled*. jaxpar's planner "
             f"(`jaxpar plan`, `jaxpar/plan/`); {time.strftime('%Y-%m-%d')}; this run took {elapsed:.0f} s"
             + ("." if parts == "abcdef" else f"; parts {', '.join(parts)} only (`--parts`)."), ""]
    sections = {"a": lambda: plan_section(p, config), "b": lambda: calibration_section(anchors),
                "c": lambda: compiler_section(p, compiler), "d": lambda: reality_section(reality),
                "e": lambda: fertility_section(fert, p), "f": lambda: risk_section(risks, p)}
    for part in parts:
        lines += sections[part]()
    return "\n".join(lines) + "\n"


def plan_section(p, config) -> list[str]:
    from jaxpar.plan.command import efficiency_lines
    from jaxpar.plan.planner import defence, summary_line, table
    from jaxpar.plan.verify import annotate, buildable_sentence
    best = p.best
    annotate(p, config, 10)
    efficiency, spread = efficiency_lines(p)        # jaxpar's η, its anchor and its leave-one-out range
    lines = ["## a. The plan", "", summary_line(p), "", *efficiency, table(p, 10, spread), "", "![plan](plan.png)", "",
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
    return [*lines, "", "![memory](memory.png) ![step time](steptime.png)", ""]


def calibration_section(anchors) -> list[str]:
    from jaxpar.parallel import memory as mem
    from jaxpar.plan import fleet as cl
    from jaxpar.plan import steptime as st
    return ["## b. Calibration: what is assumed, fitted, measured", "",
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
            f"| memory constants (score bytes {mem.SCORE_BYTES}, ...) | see jaxpar/parallel/memory.py | fitted | "
            f"the {recorded_compiles()} deviceless H100 compiles of the 7B recorded in "
            "tests/data/h100_7b_compiles.json "
            "(none of them a candidate ranked here unless part c says so) |",
            f"| einsum-attention traffic | {st.SCORE_BYTES} bytes per S x S element | assumption | |",
            "| CPU η and overheads | part d | measured | the calibration strategies' measured steps |", "",
            *anchor_section(anchors)]


def compiler_section(p, compiler) -> list[str]:
    from jaxpar.plan.verify import verification_table
    lines = ["## c. Checked against the compiler", ""]
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
    return [*lines, ""]


def _spread(values: list[float]) -> float:
    return max(values) / min(values) - 1


def anchor_section(anchors) -> list[str]:
    """The anchor table: published tokens/s per GPU vs the planner's prediction of the run's own strategy."""
    lines = ["Published H100 runs, each predicted with its OWN strategy and memory layout and its framework's η "
             "(role η / fp8: that anchor fits it, so its 1.00 is labelled fitted: the fit, not a check; check: "
             "predicted with the fitted values; `jaxpar plan` prints each η's leave-one-out range). Tokens/s per "
             "GPU:", "",
             "| anchor | framework (η) | role | cluster | batch | strategy | layout | published | predicted | "
             "predicted / published | MFU (bf16 peak) | fits |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---:|---|"]
    for a in anchors:
        lines.append(f"| {a['anchor']} | {a['framework']} ({a['eta']:.3f}) | {a['role']} | {a['cluster']} | "
                     f"{a['batch']} | {a['strategy']} | {a['layout']} | {a['published']:,.0f} | "
                     f"{a['predicted']:,.0f} | {a['ratio']:.2f}{' (fitted)' if a.get('fitted') else ''} | "
                     f"{a['mfu']:.1%} | "
                     f"{'yes' if a['fits'] else 'no'} ({a['memory_gb']:.0f} GB) |")
    notes = sorted({a["note"] for a in anchors if a["note"]})
    lines += ["", *[f"- {n}" for n in notes],
              "- \"fits\" is jaxpar's memory model, whose activation constants are fitted on XLA compiles of jaxpar's "
              "own model: the published runs ran, so a \"no\" marks this model's limit for another framework's "
              "kernels (and any context parallelism, which halves the activations), not the runs'.", ""]
    return lines


def _quartiles(values: list[float], scale: float = 1.0) -> str:
    q1, _, q3 = statistics.quantiles([v / scale for v in values], n=4)
    return f"{q1:.2f}-{q3:.2f}"


def reality_section(reality) -> list[str]:
    if reality is None:
        return ["## d. Checked against reality", "", "Skipped (--skip-cpu).", ""]
    r0 = reality
    allocator = r0.get("allocator", "")
    lines = ["## d. Checked against reality: the planner on this machine's CPU devices", "",
             f"{r0['cluster']}. {r0['host']}. Collectives (measured): one jitted call each in wall-clock time "
             "(`jaxpar bench collectives`, the wall basis's links) and inside one compiled program in CPU seconds per "
             "core (`jaxpar/plan/cpu_links.py`, the CPU basis's):", "",
             "| op | α µs (one call, wall) | β_bus GB/s | α µs (in a program, CPU/core) | β_bus GB/s |",
             "|---|---:|---:|---:|---:|"]
    for op in sorted(set(r0["fits"]) | set(r0["cpu_fits"])):
        a, b = r0["fits"].get(op, {}), r0["cpu_fits"].get(op, {})
        lines.append(f"| {op} | {a.get('alpha_us', float('nan')):.0f} | {a.get('beta_bus_GBps') or float('nan'):.2f} | "
                     f"{b.get('alpha_us', float('nan')):.0f} | {b.get('beta_bus_GBps') or float('nan'):.2f} |")
    lines += ["", f"Default config (fp32, vocab 1024), {r0['rounds']} interleaved rounds. **The check's basis: the "
              f"median step's process CPU seconds over the host's {r0['cores']} cores** (other jobs' load does not "
              f"enter it); calibration: {r0['calibration']}. Wall clock beside it, calibrated on its own: "
              f"{r0['calibration_wall']}. {allocator[:1].upper()}{allocator[1:]}: each step's minor page faults "
              "(fresh pages the kernel zeroes) are counted beside its time.", "",
              "| strategy | CPU s per core: median (quartiles) | predicted s | measured / predicted | rank predicted / "
              "measured | wall s: median (quartiles) | predicted s (wall) | rank predicted / measured (wall) | "
              "page faults per step | bytes/step compiled / predicted (MB) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in r0["rows"]:
        axes = "; ".join(f"{a} {r['bytes_compiled'].get(a, 0) / 1e6:.1f} / {r['bytes_predicted'].get(a, 0) / 1e6:.1f}"
                         for a in sorted(set(r["bytes_compiled"]) | set(r["bytes_predicted"]))
                         if r["bytes_compiled"].get(a) or r["bytes_predicted"].get(a))
        flag = " (calibration)" if r["calibration"] else ("" if abs(r["ratio"] - 1) <= WITHIN else " (off by > 30%)")
        lines.append(f"| {r['strategy']} | {r['cpu_s']:.3f} ({_quartiles(r['cpu_times_s'], r0['cores'])}) | "
                     f"{r['predicted_s']:.3f} | {r['ratio']:.2f}{flag} | {r['predicted_rank']} / {r['cpu_rank']} | "
                     f"{r['measured_s']:.3f} ({_quartiles(r['times_s'])}) | {r['predicted_wall_s']:.3f} | "
                     f"{r['predicted_wall_rank']} / {r['measured_rank']} | "
                     f"{r.get('faults_per_step', float('nan')):,.0f} | {axes} |")
    resolved, agreeing, pairs = r0["resolved_pairs"]
    lines += ["", f"**{r0['within']} of {r0['checked']}** predicted strategies within {WITHIN:.0%} of measured (CPU "
              f"basis); Spearman rank correlation of predicted and measured step times **{r0['spearman']:.2f}** on "
              f"the CPU basis (the check), {r0['spearman_wall']:.2f} on wall clock, over {len(r0['rows'])} "
              f"strategies; the fastest measured ({r0['fastest']}) is ranked **#{r0['fastest_predicted_rank']}** by "
              f"the planner. Predictions span {_spread([r['predicted_s'] for r in r0['rows']]):.0%} from fastest to "
              f"slowest, measured CPU seconds {_spread([r['cpu_s'] for r in r0['rows']]):.0%}, wall medians "
              f"{_spread([r['measured_s'] for r in r0['rows']]):.0%}; a rank is only as good as the gaps between "
              f"predictions. The CPU steps resolve **{resolved} of {pairs}** pairs of strategies (their quartiles do "
              f"not overlap; the others differ by less than their steps vary) and the planner orders **{agreeing}** of "
              "those as measured.", "", "![cpu check](cpu_check.png)", ""]
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

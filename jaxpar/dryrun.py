"""`jaxpar dryrun`: the compiled step's bill (measure/dryrun.py) with the planner's predicted step time, as a report.

The report's headline is memory and communication per device; a GPU target adds the predicted step
time (the planner's calibrated model, jaxpar.plan.steptime), with the optimistic bound beside it,
labelled. Virtual CPU devices share one host's cores, so their time is no prediction for any
accelerator: it is reported below, labelled as theirs, and never as the headline.
"""
from __future__ import annotations

import json
from pathlib import Path

from jaxpar.figures import figure, save, styled
from jaxpar.measure.dryrun import dryrun as compile_and_measure
from jaxpar.units import GIB, byte_unit, fmt_bytes, fmt_seconds, ratio


def dryrun(config, target: str = "cpu", devices=None, topology: str | None = None) -> dict:
    """`measure.dryrun.dryrun`'s numbers with the planner's calibrated step time (`time.calibrated`)."""
    result = compile_and_measure(config, target, devices, topology)
    result["time"]["calibrated"] = calibrated_step(config, result["mesh"], result["model"]["vocab_size"],
                                                   result["machine"], result["devices"])
    return result


def calibrated_step(config, sizes: dict[str, int], vocab: int, machine: dict, n: int) -> dict:
    """The step time jaxpar's planner predicts for this config and machine (jaxpar.plan): compute at a calibrated
    efficiency of the peak, the exposed part of each axis' collectives, the pipeline bubble. On CPU nothing is
    calibrated here (η = 1): `jaxpar lab capstone` measures this host's η."""
    from jaxpar.measure import hardware
    from jaxpar.plan.fleet import cpu_cluster, gpu_cluster
    from jaxpar.plan.planner import predict_config
    from jaxpar.plan.steptime import GPU_CALIBRATION, Calibration
    if machine["platform"] == "cpu":
        host, (flops, _) = hardware.probe_host(), hardware.host_matmul_peak(n)   # the peak: the kept probe
        cluster = cpu_cluster(n, {}, flops, host.hbm_bw, host.hbm_bytes or 16e9)
        calibration = Calibration(compute=1.0, overlap=0.0, memory=1.0, step_overhead_s=0.0, layer_overhead_s=0.0,
                                  source="η not calibrated on CPU here: `jaxpar lab capstone` measures it")
    else:
        cluster = gpu_cluster(machine["target"], machine["hosts"], machine["gpus_per_host"])
        calibration = GPU_CALIBRATION
    t = predict_config(config, sizes, vocab, cluster, calibration)
    return {"step_s": t.total_s, "mfu": t.model_flops / (t.total_s * cluster.peak("bfloat16")),
            "terms": t.terms(), "source": calibration.source, "efficiency": calibration.compute,
            "overlap": calibration.overlap}


# ----------------------------------------------------------------------------- report

def headline(r: dict) -> str:
    """The report's first claim: memory and communication per device; a GPU target's predicted step time."""
    mem, col, cal = r["memory"], r["collectives"], r["time"]["calibrated"]
    text = (f"**Per device: {fmt_bytes(mem['compiled']['peak'])} peak memory (compiled)"
            + (f", {'fits' if mem['compiled']['peak'] <= mem['device_hbm_bytes'] else 'does NOT fit'} in "
               f"{mem['device_hbm_bytes'] / 1e9:.0f} GB" if mem["device_hbm_bytes"] else "")
            + f"; {fmt_bytes(col['total_bytes'])} sent in collectives per step")
    if r["machine"]["platform"] == "cpu":
        return (text + ".** No step time is predicted for virtual CPU devices: they share one host's cores, so "
                "their time says nothing about an accelerator (`--target h100`, `h200` or `a100` predicts a GPU "
                "step time).")
    return text + f"; predicted step time {fmt_seconds(cal['step_s'])}, MFU {cal['mfu']:.1%} (the planner's model).**"


def markdown_report(r: dict) -> str:
    """The dry run as markdown: the headline, memory, pipeline, collectives, FLOPs, predicted step time."""
    m = r["model"]
    where = r["machine"]["topology"] and f", topology {r['machine']['topology']}" or ""
    lines = [
        f"# Dry run: {r['config']} on {r['devices']} x {r['target']}{where} ({r['mesh_text']})",
        "",
        f"{m['params']:,} params ({m['params'] / 1e9:.2f} B), batch {m['batch_size']} x {m['seq_len']} tokens, "
        f"{m['microbatches']} microbatch(es), compute {m['compute_dtype']}, remat {m['remat']}, "
        f"attention {m['kernels']['attention']}, norm {m['kernels']['norm']}, loss {m['kernels']['loss']}. "
        f"jax {r['jax']}, {r['date']}. Lowered in {r['timing']['lower_s']:.1f} s, compiled in "
        f"{r['timing']['compile_s']:.1f} s; host peak RSS {r['timing']['host_peak_rss_bytes'] / GIB:.2f} GiB.",
        "",
        headline(r),
        "",
    ]
    return "\n".join(lines + _memory_lines(r) + _pipeline_lines(r) + _collective_lines(r) + _flops_and_time_lines(r)
                     + _overlap_lines(r))


def _memory_lines(r: dict) -> list[str]:
    mem = r["memory"]
    cm, st, fz, pr = mem["compiled"], mem["state_from_shardings"], mem["zero_formula"], mem["predicted"]
    extra = [(label, pr[key]) for label, key in (("stage weights, gathered and cast", "stage_weights"),
                                                  ("ZB-H1 taps (x, dy)", "taps")) if pr[key]]
    lines = [
        "## Memory per device",
        "",
        "| part | analytic: shardings | analytic: ZeRO formula | predicted: strategy | compiled | "
        "compiled / predicted |",
        "|---|---:|---:|---:|---:|---:|",
        f"| params (fp32) | {fmt_bytes(st['params'])} | {fmt_bytes(fz['params'])} | {fmt_bytes(pr['params'])} | | |",
        f"| Adam mu + nu | {fmt_bytes(st['optimizer'])} | {fmt_bytes(fz['optimizer'])} | "
        f"{fmt_bytes(pr['optimizer'])} | | |",
        f"| counters | {st['counters']} B | | | | |",
        f"| batch (tokens) | {mem['batch_bytes']} B | | | | |",
        f"| **arguments** | {fmt_bytes(st['state_total'] + mem['batch_bytes'])} | {fmt_bytes(fz['state'])} | "
        f"{fmt_bytes(pr['state'])} | {fmt_bytes(cm['argument'])} | {ratio(cm['argument'], pr['state'])} |",
        f"| outputs (aliased) | | | | {fmt_bytes(cm['output'])} ({fmt_bytes(cm['alias'])}) | |",
        f"| grads (in temp) | {fmt_bytes(st['grads'])} | {fmt_bytes(fz['grads'])} | {fmt_bytes(pr['gradients'])} | | |",
        f"| activations kept (in temp) | | | {fmt_bytes(pr['activations'])} | | |",
        f"| working set (in temp) | | | {fmt_bytes(pr['working'])} | | |",
        *(f"| {label} (in temp) | | | {fmt_bytes(value)} | | |" for label, value in extra),
        f"| **temp** | | | {fmt_bytes(pr['temp'])} | {fmt_bytes(cm['temp'])} | {ratio(cm['temp'], pr['temp'])} |",
        f"| **peak** | | | {fmt_bytes(pr['total'])} | {fmt_bytes(cm['peak'])} | {ratio(cm['peak'], pr['total'])} |",
        "",
        f"Shards per part {mem['shard_counts']}; formula: 4Ψ/N params, 4Ψ/N grads, 8Ψ/N Adam. "
        "Predicted: the strategy's memory model (jaxpar.parallel.memory, the one the planner ranks with), "
        + ("fitted on XLA:GPU bf16/fp8 compiles." if pr["calibrated"] else
           f"fitted on XLA:GPU bf16/fp8 compiles and **not calibrated for {' and '.join(pr['uncalibrated'])}**: "
           f"the compiled peak is {pr['peak_ratio']:.3g}x the prediction here, reported as is.")
        + f" Compiled peak: {cm['peak_method']}.",
    ]
    if mem["device_hbm_bytes"]:
        fits = "fits" if cm["peak"] <= mem["device_hbm_bytes"] else "does NOT fit"
        hbm_gb = mem["device_hbm_bytes"] / 1e9
        lines.append(f"Peak {fmt_bytes(cm['peak'])} vs {hbm_gb:.0f} GB of device memory: {fits}.")
    return lines


def _pipeline_lines(r: dict) -> list[str]:
    lines = []
    pipe = r.get("pipeline")
    if pipe:
        table = f"{pipe['bubble_table']:.4f} (table, {pipe['ticks']} ticks)" if "bubble_table" in pipe else "-"
        lines += ["", "## Pipeline", "",
                  f"{pipe['schedule']}: p={pipe['stages']} stages, m={pipe['microbatches']} microbatches, "
                  f"v={pipe['virtual']} chunks per stage. Predicted bubble {pipe['bubble_formula']:.4f} (formula, "
                  f"parallel/schedules.py), {table}. Every stage runs the same SPMD program: the compiled memory "
                  f"above is each stage's ({fmt_bytes(pipe['peak_per_stage'])} peak)"
                  + (f", with a stash of {pipe['stash_slots']} microbatches' activations "
                     f"(at most {pipe['in_flight']} alive on the busiest stage)." if "stash_slots" in pipe else ".")
                  + (" FLOPs below count every branch of a tick on every tick (an upper bound); the collectives "
                     "count, per mesh axis, what the stage that sends the most over it runs."
                     if "stash_slots" in pipe else "")]
    return lines


def _collective_lines(r: dict) -> list[str]:
    col, t = r["collectives"], r["time"]
    lines = []
    lines += [
        "",
        "## Collectives per step (bytes each device sends, ring model)",
        "",
        "| mesh axis | link | instructions | runs/step | compiled | predicted | compiled / predicted | time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in sorted(col["by_axis"].items()):
        lines.append(f"| {label} | {row['link']} ({row['link_bw'] / 1e9:.0f} GB/s) | {row['instructions']} | "
                     f"{row['runs']} | {fmt_bytes(row['bytes'])} | {fmt_bytes(row['predicted_bytes'])} | "
                     f"{ratio(row['bytes'], row['predicted_bytes'])} | {fmt_seconds(row['time_s'])} |")
    lines += [
        f"| **total** | | | | {fmt_bytes(col['total_bytes'])} | {fmt_bytes(col['predicted_total_bytes'])} | "
        f"{ratio(col['total_bytes'], col['predicted_total_bytes'])} | {fmt_seconds(t['communication_s'])} |",
        "",
        "Predicted: the strategy's own `predict` (jaxpar/parallel/<strategy>.py; ZeRO-3 ≈ 3Ψ·e on GPU, 4Ψ·4 on "
        "CPU; DDP 2Ψ·e; Megatron 4-5 all-reduces of b·s·h per layer).",
        "",
    ]
    return lines


def _overlap_lines(r: dict) -> list[str]:
    from jaxpar.measure import overlap
    return ["", *overlap.markdown(r["overlap"])] if r.get("overlap") else []


def _flops_and_time_lines(r: dict) -> list[str]:
    fl, t = r["flops"], r["time"]
    cal, cpu = t["calibrated"], r["machine"]["platform"] == "cpu"
    return [
        "## FLOPs per device per step",
        "",
        "| | FLOPs | / model |",
        "|---|---:|---:|",
        f"| model (6Ψ + attention, per token x tokens / devices) | {fl['model_per_device']:.4g} | 1.000 |",
        f"| cost_analysis (loop bodies once) | "
        f"{'-' if fl['cost_analysis'] is None else format(fl['cost_analysis'], '.4g')} | "
        f"{ratio(fl['cost_analysis'], fl['model_per_device'])} |",
        f"| fused kernels (their cost estimates; "
        f"{'added: custom calls' if fl['kernels_added'] else 'in the HLO count: interpreted'}) | "
        f"{fl['kernels']:.4g} | {ratio(fl['kernels'], fl['model_per_device'])} |",
        f"| compiled, loop-corrected ({fl['method']}) | {fl['corrected']:.4g} | "
        f"{ratio(fl['corrected'], fl['model_per_device'])} |",
        "",
        "Compiled > model: remat recomputation, the one-hot embedding matmul, softmax and norms.",
        "",
        *(["## Time on these virtual CPU devices (an estimate for this host, not for any accelerator)", "",
            f"{r['devices']} virtual devices share this host's cores and memory: compute divides this host's "
            f"measured matmul peak among them, collectives run at its memory-copy rate. The figures below are "
            "this host's, with no MFU: at η = 1 of a peak measured here it would only restate the ratio of model "
            "to compiled FLOPs."]
          if cpu else ["## Predicted step time (prediction, not a measurement)"]),
        "",
        (f"The planner's step model (jaxpar.plan) for these {r['devices']} virtual CPU devices: "
         f"{fmt_seconds(cal['step_s'])} per step on this host (a CPU estimate): " if cpu else
         f"**The planner's step model (jaxpar.plan): {fmt_seconds(cal['step_s'])} per step, MFU {cal['mfu']:.1%}**: ")
        + "compute at "
        f"η = {cal['efficiency']:.2f} of peak, {cal['overlap']:.0%} of the hideable collectives overlapped "
        f"({cal['source']}); "
        + ", ".join(f"{name} {fmt_seconds(value)}" for name, value in cal["terms"].items()) + ".",
        "",
        f"Optimistic bound (100% of peak: {fl['peak_source']} = {fl['peak_per_device'] / 1e12:.3g} TFLOP/s per "
        "device, collectives at the full link bandwidth), for comparison only:",
        "",
        *(["| | time |", "|---|---:|"] if cpu else ["| | time | MFU |", "|---|---:|---:|"]),
        f"| compute (compiled FLOPs / peak) | {fmt_seconds(t['compute_s'])} |" + ("" if cpu else " |"),
        f"| communication (bytes / link bandwidth, summed over axes) | {fmt_seconds(t['communication_s'])} |"
        + ("" if cpu else " |"),
        f"| optimistic bound: perfect overlap, max | {fmt_seconds(t['overlapped_s'])} |"
        + ("" if cpu else f" {t['mfu_overlapped']:.1%} |"),
        f"| step, no overlap: sum | {fmt_seconds(t['serial_s'])} |" + ("" if cpu else f" {t['mfu_serial']:.1%} |"),
    ]


@styled
def plot_memory(r: dict, path: str | Path):
    """The memory table as two bars per device: the strategy's prediction by part beside the compiled step's
    arguments and temp (the peak the report compares them by), with the device's memory where the target has one."""
    pr, cm = r["memory"]["predicted"], r["memory"]["compiled"]
    parts = [("params", pr["params"]), ("Adam mu + nu", pr["optimizer"]), ("gradients", pr["gradients"]),
             ("activations kept", pr["activations"]), ("working set", pr["working"]),
             ("stage weights", pr["stage_weights"]), ("ZB-H1 taps", pr["taps"])]
    compiled = [("arguments", cm["argument"]), ("temp", cm["temp"])]
    unit, scale = byte_unit([pr["total"], cm["peak"], r["memory"]["device_hbm_bytes"] or 0])
    fig = figure(8, 4.5)
    ax = fig.add_subplot()
    for x, bars in ((0, parts), (1, compiled)):
        bottom = 0.0
        for label, value in (b for b in bars if b[1]):
            ax.bar(x, value / scale, 0.6, bottom=bottom, label=label, hatch="//" if x else None, edgecolor="k")
            bottom += value / scale
    if r["memory"]["device_hbm_bytes"]:
        ax.axhline(r["memory"]["device_hbm_bytes"] / scale, color="r", linestyle="--", label="device memory")
    ax.set_xticks([0, 1], [f"predicted\n(peak {fmt_bytes(pr['total'])})", f"compiled\n(peak {fmt_bytes(cm['peak'])})"])
    ax.set(ylabel=f"{unit} per device", title=f"Memory per device: {r['config']}, {r['devices']} x {r['target']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    return save(fig, path)


def write_json(result: dict, out_dir: str | Path) -> Path:
    """Write the report's numbers (dryrun.json), its markdown (dryrun.md) and memory bars (memory.png) into
    `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dryrun.md").write_text(markdown_report(result) + "\n")
    plot_memory(result, out / "memory.png")
    path = out / "dryrun.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path

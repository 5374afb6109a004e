"""Lab 05 (experiments/05_overlap): communication hidden behind computation, compiled and measured.

GPU part (deviceless XLA:GPU compiles of the 7B on 64 H100s, `jaxpar dryrun --target h100`): each
layout under XLA's latency-hiding scheduler on and off, with and without the pipelined collectives
jaxpar sets by default on GPU (jaxpar/env.py: "pipelined off" is without), XLA's windowed-einsum
collective matmul on the automatic tensor layout, and the hand-written versions (ZeRO-2 gradient
buckets, ZeRO-3 prefetch, collective matmul).
From each compiled schedule (measure/overlap.py): per mesh axis the α-β communication time, the
part hidden behind compute scheduled between a collective's start and done, the exposed part;
and the planner's predicted step time. Each compile runs in its own process: XLA_FLAGS are read
once, when XLA starts.

CPU part (the default model on 8 virtual CPU devices): the hand-written versions against one
device (same losses), each one's step time (wall clock, median of its steps) beside its collective
time, and one profiled step of each: how much of each device's collective time a compute op of the
same device ran beside (does XLA:CPU overlap at all?), and the timeline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxpar.config import preset
from jaxpar.env import PIPELINED_COLLECTIVES
from jaxpar.labs.arguments import OVERLAP_PARTS
from jaxpar.labs.arguments import overlap as add_arguments
from jaxpar.units import fmt_bytes

ROOT = Path(__file__).resolve().parents[3]
SEVEN_B = str(preset("arabic_7b"))
TOPOLOGY = "1x8x8"                      # 8 hosts x 8 H100s
HAND_TP = ["mesh.fsdp=1", "mesh.data=8", "mesh.tensor=8", "parallel.tensor=manual", "parallel.sequence=true"]
FSDP_HAND_TP = ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=8", "parallel.tensor=manual", "parallel.sequence=true"]
# name -> overrides of the 7B config; the planner's key for each is its whole layout (plan/overlap.layout_key)
LAYOUTS = {
    "fsdp (XLA)": ["mesh.data=1", "mesh.fsdp=64"],
    "fsdp x tensor (XLA)": ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=8"],
    "zero3 (by hand)": ["mesh.fsdp=1", "mesh.data=64", "parallel.data=zero3"],
    "zero3 + prefetch": ["mesh.fsdp=1", "mesh.data=64", "parallel.data=zero3", "parallel.prefetch=true"],
    # DDP keeps 16 bytes per parameter on every GPU: 8 of the 7B's 32 layers fit in 80 GB (all 32 do not, and
    # over the memory limit XLA's scheduler overlaps nothing)
    "ddp, 8 layers (by hand)": ["mesh.fsdp=1", "mesh.data=64", "parallel.data=ddp", "model.layers=8"],
    "ddp + buckets, 8 layers": ["mesh.fsdp=1", "mesh.data=64", "parallel.data=ddp", "model.layers=8",
                                "parallel.grad_buckets=4"],
    "zero2 (by hand)": ["mesh.fsdp=1", "mesh.data=64", "parallel.data=zero2"],
    "zero2 + buckets": ["mesh.fsdp=1", "mesh.data=64", "parallel.data=zero2", "parallel.grad_buckets=8"],
    "tp+sp (by hand)": HAND_TP,
    "tp+sp + collective matmul": [*HAND_TP, "parallel.tensor_overlap=collective_matmul"],
    "tp+sp + bidirectional": [*HAND_TP, "parallel.tensor_overlap=bidirectional"],
    # torchtitan's async TP layout: FSDP over the data axis, Megatron's hand-written TP+SP within a node
    "fsdp x tp+sp (by hand)": FSDP_HAND_TP,
    "fsdp x tp+sp + collective matmul": [*FSDP_HAND_TP, "parallel.tensor_overlap=collective_matmul"],
}
PIPELINED_ON = " ".join(f"{flag}=true" for flag in PIPELINED_COLLECTIVES)     # jaxpar's GPU default (jaxpar/env.py)
PIPELINED_OFF = " ".join(f"{flag}=false" for flag in PIPELINED_COLLECTIVES)
FLAGS = {                               # XLA_FLAGS of each variant (names as XLA 0.10.2 spells them)
    "scheduler on": f"--xla_gpu_enable_latency_hiding_scheduler=true {PIPELINED_ON}",
    "pipelined off": f"--xla_gpu_enable_latency_hiding_scheduler=true {PIPELINED_OFF}",
    "scheduler off": f"--xla_gpu_enable_latency_hiding_scheduler=false {PIPELINED_OFF}",
    "async off": ("--xla_gpu_disable_async_collectives=allreduce,allgather,reducescatter,alltoall,collectivepermute "
                  f"{PIPELINED_OFF}"),
    "windowed einsum": ("--xla_gpu_enable_latency_hiding_scheduler=true "
                        "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true "
                        f"{PIPELINED_ON}"),
}
WINDOWED = ("fsdp x tensor (XLA)",)     # windowed einsum rewrites XLA's own sharded matmuls only


def gpu_runs(layouts) -> list[tuple[str, str]]:
    """(layout, flags) pairs: every layout with the scheduler on (with jaxpar's default pipelined collectives, and
    without them: "pipelined off") and off and with synchronous collectives (the no-overlap baseline), windowed
    einsum where it applies."""
    runs = [(name, flags) for name in layouts for flags in ("scheduler on", "pipelined off", "scheduler off",
                                                            "async off")]
    return runs + [(name, "windowed einsum") for name in layouts if name in WINDOWED]


def compile_7b(name: str, flags: str, out: Path, log=print) -> dict:
    """One deviceless dry run in a fresh process; its overlap section, step time and compile time."""
    overrides = LAYOUTS[name]
    where = out / "dryruns" / f"{name}-{flags}".replace(" ", "_").replace("(", "").replace(")", "").replace("+", "p")
    args = [sys.executable, "-m", "jaxpar.cli", "dryrun", "--config", SEVEN_B, "--target", "h100",
            "--topology", TOPOLOGY, "--out", str(where)]
    for o in overrides:
        args += ["--set", o]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAGS[flags]}"}
    start = time.perf_counter()
    run = subprocess.run(args, check=False, capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode:
        log(f"  {name}, {flags}: failed: {run.stderr.strip().splitlines()[-1][:200]}")
        return {"layout": name, "flags": flags, "error": run.stderr.strip().splitlines()[-1][:400]}
    r = json.loads((where / "dryrun.json").read_text())
    ov = r["overlap"]
    log(f"  {name}, {flags}: {ov['hidden_fraction']:.1%} of {ov['comm_s'] * 1e3:.0f} ms hidden "
        f"({time.perf_counter() - start:.0f} s)")
    return {"layout": name, "flags": flags, "strategy": layout_of(overrides, r["mesh"]), "by_axis": ov["by_axis"],
            "hidden_fraction": ov["hidden_fraction"], "comm_s": ov["comm_s"], "exposed_s": ov["exposed_s"],
            "replayed_step_s": ov["replayed_step_s"], "planner_step_s": r["time"]["calibrated"]["step_s"],
            "compute_s": r["time"]["compute_s"], "peak_bytes": r["memory"]["compiled"]["peak"],
            "compile_s": r["timing"]["compile_s"]}


def layout_of(overrides: list[str], sizes: dict[str, int]) -> str:
    """The planner's key of a compiled layout (plan/overlap.layout_key): the 7B config with `overrides`, as run."""
    from jaxpar.config import apply_overrides, load_config
    from jaxpar.parallel.theory import candidate_from_config
    from jaxpar.plan.overlap import layout_key
    config = load_config(SEVEN_B)
    apply_overrides(config, overrides)
    return layout_key(candidate_from_config(config, sizes))


def gpu_part(out: Path, layouts, log=print) -> list[dict]:
    from jaxpar.measure.targets import gpu_plugin_problem
    problem = gpu_plugin_problem()
    if problem:
        log(f"GPU part skipped: {problem}")
        return []
    return [compile_7b(name, flags, out, log) for name, flags in gpu_runs(layouts)]


def measured_fractions(rows: list[dict]) -> dict:
    """The planner's table (jaxpar/plan/overlap_measured.json): hidden fraction per strategy and axis,
    with XLA's scheduler on (what a run gets by default)."""
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("error") or r["flags"] != "scheduler on":
            continue
        for axis, a in r["by_axis"].items():
            if a["comm_s"] > 0:
                table.setdefault(r["strategy"], {})[axis] = round(a["hidden_fraction"], 4)
    return table


def gpu_table(rows: list[dict]) -> list[str]:
    from jaxpar.labs.base.report import md_table
    body = []
    for r in rows:
        if r.get("error"):
            body.append([r["layout"], r["flags"], "failed", "", "", "", ""])
            continue
        axes = "; ".join(f"{axis}: {a['hidden_s'] * 1e3:.0f} of {a['comm_s'] * 1e3:.0f} ms ({a['hidden_fraction']:.0%})"
                         for axis, a in sorted(r["by_axis"].items()) if a["comm_s"] > 1e-4)
        body.append([r["layout"], r["flags"], axes, f"{r['exposed_s'] * 1e3:.0f} ms",
                     f"{r['replayed_step_s']:.2f} s", f"{r['planner_step_s']:.2f} s",
                     f"{r['peak_bytes'] / 2**30:.1f} GiB"])
    return [md_table(["layout", "XLA flags", "hidden per axis (hidden of α-β time)", "exposed", "replayed step",
                      "planner step", "peak memory"], body)]


# ============================================================================ CPU part

CPU_VARIANTS = {                       # name -> overrides on 8 CPU devices (the one-device oracle: mesh.data=1)
    "ddp": ["mesh.data=8", "parallel.data=ddp"],
    "ddp + buckets": ["mesh.data=8", "parallel.data=ddp", "parallel.grad_buckets=4"],   # 1 layer per bucket
    "zero2": ["mesh.data=8", "parallel.data=zero2"],
    "zero2 + buckets": ["mesh.data=8", "parallel.data=zero2", "parallel.grad_buckets=4"],
    "zero3": ["mesh.data=8", "parallel.data=zero3"],
    "zero3, remat full": ["mesh.data=8", "parallel.data=zero3", "train.remat=full"],   # prefetch's recomputation
    "zero3 + prefetch": ["mesh.data=8", "parallel.data=zero3", "parallel.prefetch=true"],
    "tp+sp": ["mesh.data=2", "mesh.tensor=4", "parallel.tensor=manual", "parallel.sequence=true"],
    "tp+sp + collective matmul": ["mesh.data=2", "mesh.tensor=4", "parallel.tensor=manual",
                                  "parallel.sequence=true", "parallel.tensor_overlap=collective_matmul"],
    "tp+sp + bidirectional": ["mesh.data=2", "mesh.tensor=4", "parallel.tensor=manual",
                              "parallel.sequence=true", "parallel.tensor_overlap=bidirectional"],
}


def _intervals_overlap(a, b) -> float:
    """Length of the intersection of two unions of intervals."""
    def union(xs):
        out = []
        for s, e in sorted(xs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    total, ua, ub = 0.0, union(a), union(b)
    for s, e in ua:
        for t, f in ub:
            total += max(0.0, min(e, f) - max(s, t))
    return total


CONTAINERS = ("while", "call", "conditional")   # XLA:CPU traces these around the ops they run


def lanes_of(events: list[dict]) -> dict[str, dict[str, list]]:
    """Per device, the (start, end) µs intervals of its compute and of its collectives in a trace.

    XLA:CPU: host events carrying `hlo_op` (spelt all_gather, reduce_scatter, ...) and `device_ordinal`,
    loops and calls left out (they enclose their ops). GPU: kernel events on a device's
    stream threads (process `/device:GPU:k`, thread `Stream ...`); NCCL kernels are the collectives."""
    from jaxpar.measure.profile import COLLECTIVE
    processes = {e["pid"]: e["args"].get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lanes: dict[str, dict[str, list]] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or not e.get("dur"):
            continue
        if "hlo_op" in args and "device_ordinal" in args:
            if args["hlo_op"].startswith(CONTAINERS):          # a loop or call: its ops are events of their own
                continue
            lane, label = f"cpu:{args['device_ordinal']}", args["hlo_op"].replace("_", "-")
        elif processes.get(e["pid"], "").startswith("/device:GPU") and \
                threads.get((e["pid"], e.get("tid")), "").startswith("Stream"):
            lane, label = processes[e["pid"]], f"{e['name']} {args.get('hlo_op', '')}"
        else:
            continue
        kind = "collective" if COLLECTIVE.search(label) else "compute"
        lanes.setdefault(lane, {"compute": [], "collective": []})[kind].append((e["ts"], e["ts"] + e["dur"]))
    return lanes


def overlap_of(lanes: dict) -> dict:
    collective = sum(b - a for lane in lanes.values() for a, b in lane["collective"])
    beside = sum(_intervals_overlap(lane["collective"], lane["compute"]) for lane in lanes.values())
    return {"lanes": dict(sorted(lanes.items())), "collective_us": collective, "overlapped_us": beside,
            "overlapped_fraction": beside / collective if collective else 0.0}


def profile_step(strategy, step, state, batch) -> dict:
    """One profiled step: per device its compute and collective ops, and how much of the collective time
    a compute op of the same device ran beside."""
    import gzip

    import jax
    with tempfile.TemporaryDirectory() as directory:
        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = 3          # on CPU, XLA's ops are host events
        with jax.set_mesh(strategy.mesh):
            jax.profiler.start_trace(directory, profiler_options=options, create_perfetto_trace=True)
            jax.block_until_ready(step(state, batch))
            jax.profiler.stop_trace()
        with gzip.open(max(Path(directory).rglob("*.trace.json.gz"))) as f:
            events = json.load(f)["traceEvents"]
    return overlap_of(lanes_of(events))


def cpu_part(out: Path, steps: int, overrides: list[str], log=print) -> dict:
    import jax
    import numpy as np

    from jaxpar.config import apply_overrides, load_config, model_vocab_size
    from jaxpar.data.pipeline import build_token_data, train_dataset
    from jaxpar.measure import overlap as schedule
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    base = load_config(None)
    apply_overrides(base, ["train.warmup_steps=1", *overrides])
    data = build_token_data(base.data)
    vocab = model_vocab_size(base, data.stats["vocab_size"], 4)
    B = base.train.batch_size
    stream = iter(train_dataset(data.train, B, base.data.shuffle_seed, slice(0, B)))
    batches = [np.asarray(next(stream)) for _ in range(steps)]
    results: dict[str, Any] = {}
    for name, extra in {"one device": ["mesh.data=1"], **CPU_VARIANTS}.items():
        config = load_config(None)
        apply_overrides(config, ["train.warmup_steps=1", *overrides, *extra])
        devices = jax.devices()[:1] if name == "one device" else jax.devices()[:8]
        strategy = make_strategy(config, ModelConfig.from_config(config.model, vocab), make_mesh(config, devices))
        with jax.set_mesh(strategy.mesh):
            step = strategy.lower_step().compile()
            state, losses, times = strategy.init_state(), [], []
            for batch in batches:
                placed = jax.device_put(batch, strategy.batch_sharding)
                start = time.perf_counter()
                state, metrics = step(state, placed)
                losses.append(float(metrics["loss"]))          # waits for the step
                times.append(time.perf_counter() - start)
        row = {"losses": losses, "step_times_s": times, "step_s": float(np.median(times)),
               "temp_bytes": step.memory_analysis().temp_size_in_bytes}
        if name != "one device":
            want = np.array(results["one device"]["losses"])
            row["max_loss_rel_dev"] = float(np.max(np.abs(np.array(losses) - want) / want))
            row["profile"] = profile_step(strategy, step, state, jax.device_put(batches[0], strategy.batch_sharding))
            row["schedule"] = {k: v for k, v in schedule.analyse(step.as_text(), strategy.mesh,
                               {"platform": "cpu"}, 1e11).items() if k != "collectives"}
            log(f"  {name}: max loss deviation {row['max_loss_rel_dev']:.1e}, step {row['step_s'] * 1e3:.0f} ms, "
                f"profile: {row['profile']['overlapped_fraction']:.1%} of "
                f"{row['profile']['collective_us'] / 1e3:.1f} ms of collectives beside compute")
        results[name] = row
    return results


def plot_timelines(cpu: dict, path: Path) -> None:
    """One panel per hand-written variant: each device's compute (grey) and collectives (red) in one step."""
    from jaxpar.figures import figure, save
    names = [n for n in cpu if "profile" in cpu[n]]
    fig = figure(8, 1.7 * len(names))
    axes = fig.subplots(len(names), 1, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        lanes = cpu[name]["profile"]["lanes"]
        t0 = min(a for lane in lanes.values() for kind in lane.values() for a, _ in kind)
        for row, (_device, lane) in enumerate(sorted(lanes.items())):
            for kind, colour in (("compute", "0.6"), ("collective", "tab:red")):
                ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in lane[kind]], (row - 0.4, 0.8),
                               facecolors=colour)
        ax.set_title(f"{name}: {cpu[name]['profile']['overlapped_fraction']:.0%} of collective time beside compute",
                     fontsize=9)
        ax.set_ylabel("device")
    axes[-1, 0].set_xlabel("ms (one step, profiler; grey compute, red collectives)")
    save(fig, path)


def cpu_table(cpu: dict) -> list[str]:
    from jaxpar.labs.base.report import md_table
    rows = []
    for name, r in cpu.items():
        if "profile" not in r:
            continue
        p, sch = r["profile"], r["schedule"]
        rows.append([name, f"{r['max_loss_rel_dev']:.1e}", fmt_bytes(r['temp_bytes']),
                     f"{r['step_s'] * 1e3:.0f} ms" if "step_s" in r else "",
                     f"{p['collective_us'] / 1e3:.1f} ms", f"{p['overlapped_fraction']:.1%}",
                     (f"{sum(a['async'] for a in sch['by_axis'].values())} of "
                     f"{sum(a['collectives'] for a in sch['by_axis'].values())}")])
    one = cpu.get("one device", {}).get("step_s")
    return [md_table(["hand-written", "max loss rel. dev. vs one device", "compiled temp",
                      "step (wall, median of the steps)", "collective time (profile, all devices)",
                      "of it beside compute (same device)", "async collectives"], rows),
            "", "Step times are wall clock on a host whose cores the 8 virtual devices share (and other jobs may load)"
            + (f"; one device: {one * 1e3:.0f} ms per step." if one else ".")]


SHEET_HEADER = """# Lab 05: communication hidden behind computation

Every number below is measured from a compiled program (deviceless XLA:GPU for H100, or XLA:CPU) or a
profile; 'hidden' and 'exposed' on GPU come from replaying the compiled schedule with α-β collective
times and roofline compute times (jaxpar/measure/overlap.py): a model of the schedule, not a GPU run."""


def run_lab(out, parts, layouts, steps: int, overrides: list[str], log=print) -> dict:
    from jaxpar.labs.base.results import write_results
    from jaxpar.labs.base.runner import run_directory
    out = run_directory(out, "overlap")
    results: dict[str, Any] = {}
    lines = [SHEET_HEADER]
    if "gpu" in parts:
        log(f"GPU part: the 7B on {TOPOLOGY} H100s, deviceless")
        results["gpu"] = gpu_part(out, layouts, log)
        results["measured_fractions"] = measured_fractions(results["gpu"])
        (out / "overlap_measured.json").write_text(json.dumps(      # copy to jaxpar/plan/ to update the planner
            {"source": f"jaxpar lab overlap, {time.strftime('%Y-%m-%d')}: 7B on {TOPOLOGY} H100 deviceless, "
                       "XLA's scheduler on, schedules replayed (measure/overlap.py)",
             "hidden_fraction": results["measured_fractions"]}, indent=2) + "\n")
        lines += ["", "## 7B on 64 H100 (deviceless compiles)", "", *gpu_table(results["gpu"])]
    if "cpu" in parts:
        log("CPU part: the default model on 8 CPU devices")
        results["cpu"] = cpu_part(out, steps, overrides, log)
        plot_timelines(results["cpu"], out / "timeline.png")
        lines += ["", f"## Default model on 8 CPU devices ({steps} steps, fp32)", "", *cpu_table(results["cpu"]),
                  "", "![timeline](timeline.png)"]
    write_results(out, results)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {out / 'report.md'}")
    return results


def check_arguments(args) -> tuple[list[str], list[str]]:
    """Refuse bad arguments before JAX starts (the CLI calls this first): the parts and layouts (returned), the
    steps, and the CPU part's --set and device count, which used to fail only after the GPU part's compiles."""
    from jaxpar.config import ConfigError, apply_overrides, load_config, validate_fields
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in OVERLAP_PARTS]
    if bad or not parts:
        raise ConfigError("--parts", f"'{args.parts}': valid parts are {', '.join(OVERLAP_PARTS)}")
    layouts = [x.strip() for x in args.layouts.split(",")] if args.layouts else list(LAYOUTS)
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise ConfigError("--layouts", f"unknown {', '.join(unknown)}; valid: {', '.join(LAYOUTS)}")
    if args.steps < 1:
        raise ConfigError("--steps", f"is {args.steps}; must be at least 1")
    if "cpu" in parts:
        config = load_config(None)
        apply_overrides(config, ["train.warmup_steps=1", *args.overrides])
        validate_fields(config)
        cpu_devices(args.cpu_devices)
    return parts, layouts


def cpu_devices(count: int | None) -> None:
    from jaxpar.config import ConfigError
    if count is not None and count < 8:
        raise ConfigError("--cpu-devices", f"is {count}; the CPU part compares its layouts on 8 devices: run with "
                          "--cpu-devices 8 (or leave out --parts cpu)")


def run_from_args(args) -> int:
    parts, layouts = check_arguments(args)
    if "cpu" in parts:
        import jax
        cpu_devices(jax.device_count())
    run_lab(args.out, parts, layouts, args.steps, args.overrides)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/05_overlap/run.py)."""
    from jaxpar.labs.base.runner import standalone_main
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)

"""Dry run: compile a config's full training step for N devices without allocating it, and read the bill.

The train state and the batch are abstract (ShapeDtypeStructs with shardings), so a
7B model on 64 devices compiles on a laptop. From the compiled program we report,
per device: memory (compiler's accounting vs the ZeRO formulas), collectives per
mesh axis with bytes (vs the 2Ψ/3Ψ theory), FLOPs (vs 6Ψ per token), and a predicted
step time: the planner's calibrated model (jaxpar.plan.steptime), with the optimistic
bound (100% of peak, perfect overlap) beside it, labelled. The report's headline is
memory and communication; a GPU target adds the predicted step time. Virtual CPU
devices share one host's cores, so their time is no prediction for any accelerator:
it is reported below, labelled as theirs, and never as the headline.

Targets:
  cpu               N virtual CPU devices (`jax_num_cpu_devices`, fixed before JAX starts).
  h100, h200, a100  a real XLA:GPU compile with no GPU: a topology described by
                    jaxpar's own GpuTargetConfigProto files (measure/gpu_targets/) and
                    the CUDA PJRT plugin wheels (which compile without a GPU). Topology PxHxG =
                    partitions x hosts x GPUs per host.
"""
from __future__ import annotations

import json
import re
import resource
import time
from importlib import metadata
from pathlib import Path

from jaxpar.config import ConfigError

GPU_TARGETS = {   # target -> (GpuTargetConfigProto file, jaxpar.measure.hardware.ACCELERATORS key)
    "h100": ("h100.txtpb", "H100-SXM"),
    "h200": ("h200.txtpb", "H200-SXM"),
    "a100": ("a100.txtpb", "A100-SXM-80GB"),
}
TARGETS = ("cpu", *GPU_TARGETS)
TARGET_DIR = Path(__file__).parent / "measure" / "gpu_targets"
GIB = 2**30


# ----------------------------------------------------------------------------- targets

def parse_topology(text: str) -> tuple[int, int, int]:
    """'1x8x8' -> (partitions, hosts, gpus_per_host)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", text or "")
    if not m or min(int(g) for g in m.groups()) < 1:
        raise ConfigError("--topology", f"'{text}' is not PxHxG (partitions x hosts x gpus_per_host), e.g. 1x8x8")
    return tuple(int(g) for g in m.groups())


def gpu_plugin_problem() -> str | None:
    """Why a deviceless GPU compile cannot run here (None: it can): the CUDA plugin wheels must match jaxlib."""
    jaxlib = metadata.version("jaxlib")
    for cuda in ("cuda12", "cuda13"):
        versions = []
        for dist in (f"jax-{cuda}-plugin", f"jax-{cuda}-pjrt"):
            try:
                versions.append(metadata.version(dist))
            except metadata.PackageNotFoundError:
                versions.append(None)
        if versions == [jaxlib, jaxlib]:
            return None
        if any(versions):
            return (f"found jax-{cuda}-plugin {versions[0]} / jax-{cuda}-pjrt {versions[1]} but jaxlib is {jaxlib}; "
                    f"pip install --no-deps jax-{cuda}-plugin=={jaxlib} jax-{cuda}-pjrt=={jaxlib}")
    return (f"a deviceless GPU compile needs the jax-cuda12-plugin and jax-cuda12-pjrt wheels matching jaxlib "
            f"{jaxlib}: pip install --no-deps jax-cuda12-plugin=={jaxlib} jax-cuda12-pjrt=={jaxlib} "
            "(a separate venv is fine; no GPU needed)")


def prepare_process(target: str, devices: int | None) -> None:
    """Process-wide JAX settings a dry run needs; call before JAX starts a backend (the CLI does).

    cpu: the virtual device count. GPU targets: keep JAX on the CPU platform, so the
    installed CUDA plugin does not look for a GPU; the compile goes through the topology.
    """
    import jax
    if target == "cpu":
        if devices:
            try:
                jax.config.update("jax_num_cpu_devices", int(devices))
            except RuntimeError:   # JAX already started: `target_devices` reports a count mismatch
                pass
    elif target in GPU_TARGETS:
        jax.config.update("jax_platforms", "cpu")


def target_devices(target: str, devices=None, topology: str | None = None) -> tuple[list, dict]:
    """The devices to compile for and a description of the machine they form."""
    import jax
    if target not in TARGETS:
        raise ConfigError("--target", f"unknown target '{target}'; valid: {', '.join(TARGETS)}")
    if target == "cpu":
        if topology:
            raise ConfigError("--topology", "applies to GPU targets only; for cpu give --devices N")
        available = jax.devices("cpu")
        if devices is None:
            chosen = available
        elif isinstance(devices, int):
            if devices != len(available):
                raise ConfigError("--devices", f"{devices} CPU devices asked for but JAX started with "
                                  f"{len(available)}; the count is fixed before JAX starts: run "
                                  f"`jaxpar dryrun --target cpu --devices {devices}` in a fresh process")
            chosen = available
        else:
            chosen = list(devices)
        return chosen, {"target": "cpu", "platform": "cpu", "hosts": 1, "gpus_per_host": len(chosen),
                        "accelerator": None, "topology": None}

    file, accelerator = GPU_TARGETS[target]
    if topology is None:
        if not devices:
            raise ConfigError("--topology", f"target {target} needs --topology PxHxG (e.g. 1x8x8) or --devices N")
        n = int(devices)
        topology = f"1x1x{n}" if n <= 8 else (f"1x{n // 8}x8" if n % 8 == 0 else None)
        if topology is None:
            raise ConfigError("--devices", f"{n} GPUs do not fill 8-GPU hosts; give --topology PxHxG")
    partitions, hosts, per_host = parse_topology(topology)
    if devices is not None and not isinstance(devices, int):
        raise ConfigError("--devices", "GPU targets take a device count, not a device list")
    if devices and devices != partitions * hosts * per_host:
        raise ConfigError("--devices", f"{devices} does not match --topology {topology} "
                          f"= {partitions * hosts * per_host} GPUs")
    problem = gpu_plugin_problem()
    if problem:
        raise ConfigError("--target", problem)
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=(TARGET_DIR / file).read_text(),
                                            topology=topology)
    except Exception as err:   # noqa: BLE001 - XLA's error, reduced to one line
        raise ConfigError("--topology", f"XLA rejected {target} topology {topology}: "
                          f"{str(err).strip().splitlines()[0][:200]}") from None
    return list(topo.devices), {"target": target, "platform": "gpu", "hosts": partitions * hosts,
                                "gpus_per_host": per_host, "accelerator": accelerator, "topology": topology}


# ----------------------------------------------------------------------------- the dry run

def pipeline_summary(trainer, compiled_peak: int) -> dict | None:
    """A pipeline trainer's schedule, bubble (table and formula) and stash, for the dry-run report."""
    from jaxpar.parallel.schedules import bubble_fraction
    schedule = getattr(trainer, "schedule", None)
    name = trainer.config.parallel.pipe
    if name == "auto":
        return None
    p, m, v = trainer.p, trainer.m, trainer.v
    out = {"schedule": name, "stages": p, "microbatches": m, "virtual": v,
           "bubble_formula": float(bubble_fraction(name, p, m, v)), "peak_per_stage": compiled_peak}
    if schedule is not None:
        out.update(bubble_table=float(schedule.bubble()), ticks=schedule.ticks, in_flight=max(schedule.in_flight()),
                   stash_slots=trainer.program.slots["stash"])
    return out


def _links(found, mesh, machine) -> dict[str, tuple[str, float]]:
    """Per mesh axis: the slowest link its collectives cross, and that link's bytes/s per direction."""
    from jaxpar.measure import hardware
    flat = list(mesh.devices.flat)
    if machine["platform"] == "cpu":
        bw = hardware.probe_host().link_bw
        return {c.axis_label: ("host memory", bw) for c in found}
    acc = hardware.ACCELERATORS[machine["accelerator"]]
    links = {}
    for c in found:
        crosses = any(len({flat[i].process_index for i in g}) > 1 for g in c.replica_groups)
        link = ("InfiniBand", acc.scaleout_bw) if crosses else ("NVLink", acc.link_bw)
        if links.get(c.axis_label, ("", float("inf")))[1] > link[1]:
            links[c.axis_label] = link
    return links


def _peak_flops(config, machine, num_devices: int) -> tuple[float, str]:
    from jaxpar.measure import hardware
    if machine["platform"] == "cpu":
        host = hardware.probe_host()
        return host.fp32_flops / num_devices, (f"host f32 matmul {host.fp32_flops / 1e9:.1f} GFLOP/s (measured) "
                                                f"shared by {num_devices} virtual devices")
    acc = hardware.ACCELERATORS[machine["accelerator"]]
    if config.train.compute_dtype == "float8" and acc.fp8_flops:
        return acc.fp8_flops, f"{acc.name} fp8 dense peak (only the weight matmuls run in fp8)"
    if config.train.compute_dtype in ("bfloat16", "float8"):
        return acc.bf16_flops, f"{acc.name} bf16 dense peak"
    return acc.tf32_flops, f"{acc.name} TF32 dense peak (XLA's default for f32 dots)"


def calibrated_step(config, sizes: dict[str, int], vocab: int, machine: dict, n: int) -> dict:
    """The step time jaxpar's planner predicts for this config and machine (jaxpar.plan): compute at a calibrated
    efficiency of the peak, the exposed part of each axis' collectives, the pipeline bubble. On CPU nothing is
    calibrated here (η = 1): `jaxpar lab capstone` measures this host's η."""
    from jaxpar.measure import hardware
    from jaxpar.plan.cluster import cpu_cluster, gpu_cluster
    from jaxpar.plan.planner import predict_config
    from jaxpar.plan.steptime import GPU_CALIBRATION, Calibration
    if machine["platform"] == "cpu":
        host = hardware.probe_host()
        cluster = cpu_cluster(n, {}, host.fp32_flops, host.hbm_bw, host.hbm_bytes or 16e9)
        calibration = Calibration(compute=1.0, overlap=0.0, memory=1.0,
                                  source="η not calibrated on CPU here: `jaxpar lab capstone` measures it")
    else:
        cluster = gpu_cluster(machine["target"], machine["hosts"], machine["gpus_per_host"])
        calibration = GPU_CALIBRATION
    t = predict_config(config, sizes, vocab, cluster, calibration)
    return {"step_s": t.total_s, "mfu": t.model_flops / (t.total_s * cluster.peak("bfloat16")),
            "terms": t.terms(), "source": calibration.source, "efficiency": calibration.compute,
            "overlap": calibration.overlap}


def dryrun(config, target: str = "cpu", devices=None, topology: str | None = None) -> dict:
    """Compile `config`'s training step for `target` without allocating; return every number of the report.

    `devices`: for cpu, the device count JAX was started with (or a device list); for
    GPU targets, a GPU count (or give `topology`, 'PxHxG'). Bad input raises ConfigError.
    """
    import jax
    import jax.numpy as jnp

    from jaxpar.kernels.costs import kernel_flops
    from jaxpar.kernels.kernel_ops import resolve
    from jaxpar.measure import hardware, hlo
    from jaxpar.measure.executed import step_collectives
    from jaxpar.measure.flops import compiled_flops, mfu, model_flops_per_step
    from jaxpar.measure.memory import (
        activation_estimate,
        compiled_memory,
        leaf_bytes_per_device,
        shard_counts,
        state_bytes,
        zero_formula,
    )
    from jaxpar.mesh import describe, make_mesh
    from jaxpar.model.counting import param_count
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_trainer, predicted_collective_bytes
    from jaxpar.parallel.step import activation_dtype

    if config.model.vocab_size <= 0:
        raise ConfigError("model.vocab_size", f"is {config.model.vocab_size}; a dry run has no tokenizer to take "
                          "it from: set it, e.g. --set model.vocab_size=32000")
    chosen, machine = target_devices(target, devices, topology)
    mesh = make_mesh(config, chosen)
    sizes = {name: int(size) for name, size in mesh.shape.items()}
    if config.model.vocab_size % sizes["tensor"]:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is not divisible by "
                          f"mesh.tensor={sizes['tensor']}")
    n = len(chosen)
    model_cfg = ModelConfig.from_config(config.model)
    B, S = config.train.batch_size, config.data.seq_len

    start = time.perf_counter()
    trainer = make_trainer(config, model_cfg, mesh, donate=True)  # accelerator memory: state updated in place
    tokens = trainer.abstract_batch()
    with jax.set_mesh(mesh):   # traced once: the jaxpr gives the kernels' FLOPs, then it is lowered
        traced = trainer.step_fn.trace(trainer.abstract_state, tokens)
        lowered = traced.lower()
    kernels = kernel_flops(traced.jaxpr)
    lowered_at = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = lowered.compile()
    compiled_at = time.perf_counter()
    hlo_text = compiled.as_text()

    # memory
    psi = param_count(model_cfg)["total"]
    compute_bytes = jnp.dtype(activation_dtype(config.train.compute_dtype)).itemsize
    state = state_bytes(trainer.abstract_state)
    formula = zero_formula(psi, shard_counts(config, sizes))
    batch_bytes = leaf_bytes_per_device(tokens)
    micro = B // config.train.microbatches // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    chosen = resolve(config, machine["platform"], activation_dtype(config.train.compute_dtype))
    acts = activation_estimate(layers=model_cfg.layers, seq_len=S, micro_batch=micro, d_model=model_cfg.d_model,
                               heads=model_cfg.heads, vocab_size=model_cfg.vocab_size, tensor=sizes["tensor"],
                               compute_bytes=compute_bytes, remat=config.train.remat,
                               flash=chosen["attention"] in ("pallas", "cudnn"),
                               loss_chunk=config.model.loss_chunk if chosen["loss"] == "chunked" else None,
                               sequence_parallel=config.parallel.sequence)
    mem = compiled_memory(compiled, machine["platform"])

    # collectives
    # a pipeline step runs each tick's branches only on some ticks: its trainer counts what it executes
    found = step_collectives(trainer, hlo_text)
    summary = hlo.summarize(found)
    predicted_bytes = predicted_collective_bytes(config, model_cfg, sizes, machine["platform"])
    links = _links(found, mesh, machine)
    axes = {}
    for c in found:
        link, bw = links[c.axis_label]
        row = axes.setdefault(c.axis_label, {"instructions": 0, "runs": 0, "bytes": 0.0, "link": link,
                                             "link_bw": bw, "time_s": 0.0})
        row["instructions"] += 1
        row["runs"] += c.runs_per_step
        row["bytes"] += c.bytes_per_step
        row["time_s"] += c.bytes_per_step / bw
    for label, row in axes.items():
        row["predicted_bytes"] = predicted_bytes.get(label)

    # flops and time
    flops = compiled_flops(compiled, hlo_text, kernel_flops=kernels.total)
    model_flops = model_flops_per_step(model_cfg, B, S)
    peak, peak_source = _peak_flops(config, machine, n)
    compute_s = flops["corrected"] / peak
    comm_s = sum(row["time_s"] for row in axes.values())
    overlap_s, serial_s = max(compute_s, comm_s), compute_s + comm_s
    calibrated = calibrated_step(config, sizes, model_cfg.vocab_size, machine, n)
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    hbm = hardware.ACCELERATORS[machine["accelerator"]].hbm_bytes if machine["accelerator"] else None
    return {
        "config": config.name, "target": target, "machine": machine, "devices": n, "mesh": sizes,
        "mesh_text": describe(mesh), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
        "timing": {"lower_s": lowered_at - start, "compile_s": compiled_at - lowered_at,
                   "host_peak_rss_bytes": usage},
        "model": {"params": psi, "layers": model_cfg.layers, "d_model": model_cfg.d_model,
                  "vocab_size": model_cfg.vocab_size, "batch_size": B, "seq_len": S,
                  "microbatches": config.train.microbatches, "compute_dtype": config.train.compute_dtype,
                  "remat": config.train.remat, "kernels": chosen},
        "memory": {"compiled": mem.as_dict(), "state_from_shardings": state, "zero_formula": formula,
                   "shard_counts": shard_counts(config, sizes), "batch_bytes": batch_bytes,
                   "activations_estimate": acts, "device_hbm_bytes": hbm},
        "pipeline": pipeline_summary(trainer, mem.peak),
        "collectives": {"by_axis": axes, "total_bytes": summary["total"]["bytes"],
                        "predicted_total_bytes": sum(predicted_bytes.values()),
                        "by_op": summary["by_op"]},
        "flops": {**flops, "model_per_step": model_flops, "model_per_device": model_flops / n,
                  "peak_per_device": peak, "peak_source": peak_source},
        "time": {"compute_s": compute_s, "communication_s": comm_s, "overlapped_s": overlap_s,
                 "serial_s": serial_s,
                 "mfu_overlapped": mfu(model_flops, overlap_s, n, peak),
                 "mfu_serial": mfu(model_flops, serial_s, n, peak), "calibrated": calibrated},
    }


# ----------------------------------------------------------------------------- report

def _gib(x) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    if x is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.0f} B"


def _ratio(measured, predicted) -> str:
    return f"{measured / predicted:.3f}" if measured is not None and predicted else "-"


def _seconds(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.1f} µs"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def headline(r: dict) -> str:
    """The report's first claim: memory and communication per device; a GPU target's predicted step time."""
    mem, col, cal = r["memory"], r["collectives"], r["time"]["calibrated"]
    text = (f"**Per device: {_gib(mem['compiled']['peak'])} peak memory (compiled)"
            + (f", {'fits' if mem['compiled']['peak'] <= mem['device_hbm_bytes'] else 'does NOT fit'} in "
               f"{mem['device_hbm_bytes'] / 1e9:.0f} GB" if mem["device_hbm_bytes"] else "")
            + f"; {_gib(col['total_bytes'])} sent in collectives per step")
    if r["machine"]["platform"] == "cpu":
        return (text + ".** No step time is predicted for virtual CPU devices: they share one host's cores, so "
                "their time says nothing about an accelerator (`--target h100`, `h200` or `a100` predicts a GPU "
                "step time).")
    return text + f"; predicted step time {_seconds(cal['step_s'])}, MFU {cal['mfu']:.1%} (the planner's model).**"


def markdown_report(r: dict) -> str:
    """The dry run as markdown: the headline, memory, collectives, FLOPs, predicted step time."""
    m, mem, col, fl, t = r["model"], r["memory"], r["collectives"], r["flops"], r["time"]
    cal = t["calibrated"]
    cpu = r["machine"]["platform"] == "cpu"
    cm, st, fz, act = mem["compiled"], mem["state_from_shardings"], mem["zero_formula"], mem["activations_estimate"]
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
        "## Memory per device",
        "",
        "| part | analytic: shardings | analytic: ZeRO formula | compiled | compiled / analytic |",
        "|---|---:|---:|---:|---:|",
        f"| params (fp32) | {_gib(st['params'])} | {_gib(fz['params'])} | | |",
        f"| Adam mu + nu | {_gib(st['optimizer'])} | {_gib(fz['optimizer'])} | | |",
        f"| counters | {st['counters']} B | | | |",
        f"| batch (tokens) | {mem['batch_bytes']} B | | | |",
        f"| **arguments** | {_gib(st['state_total'] + mem['batch_bytes'])} | {_gib(fz['state'])} | "
        f"{_gib(cm['argument'])} | {_ratio(cm['argument'], st['state_total'] + mem['batch_bytes'])} |",
        f"| outputs (aliased) | | | {_gib(cm['output'])} ({_gib(cm['alias'])}) | |",
        f"| grads (in temp) | {_gib(st['grads'])} | {_gib(fz['grads'])} | | |",
        f"| activations (estimate, in temp) | {_gib(act['total'])} | | | |",
        f"| **temp** | {_gib(st['grads'] + act['total'])} | | {_gib(cm['temp'])} | "
        f"{_ratio(cm['temp'], st['grads'] + act['total'])} |",
        f"| **peak** | {_gib(st['state_total'] + mem['batch_bytes'] + st['grads'] + act['total'])} | "
        f"{_gib(fz['total'] + act['total'])} | {_gib(cm['peak'])} | "
        f"{_ratio(cm['peak'], st['state_total'] + mem['batch_bytes'] + st['grads'] + act['total'])} |",
        "",
        f"Shards per part {mem['shard_counts']}; formula: 4Ψ/N params, 4Ψ/N grads, 8Ψ/N Adam. "
        f"Activations: {act['note']}; per layer {_gib(act['per_layer'])}, logits {_gib(act['logits'])} "
        "(Korthikanti et al., adapted: an estimate). "
        f"Compiled peak: {cm['peak_method']}.",
    ]
    if mem["device_hbm_bytes"]:
        fits = "fits" if cm["peak"] <= mem["device_hbm_bytes"] else "does NOT fit"
        lines.append(f"Peak {_gib(cm['peak'])} vs {mem['device_hbm_bytes'] / 1e9:.0f} GB of device memory: {fits}.")
    pipe = r.get("pipeline")
    if pipe:
        table = f"{pipe['bubble_table']:.4f} (table, {pipe['ticks']} ticks)" if "bubble_table" in pipe else "-"
        lines += ["", "## Pipeline", "",
                  f"{pipe['schedule']}: p={pipe['stages']} stages, m={pipe['microbatches']} microbatches, "
                  f"v={pipe['virtual']} chunks per stage. Predicted bubble {pipe['bubble_formula']:.4f} (formula, "
                  f"parallel/schedules.py), {table}. Every stage runs the same SPMD program: the compiled memory "
                  f"above is each stage's ({_gib(pipe['peak_per_stage'])} peak)"
                  + (f", with a stash of {pipe['stash_slots']} microbatches' activations "
                     f"(at most {pipe['in_flight']} alive on the busiest stage)." if "stash_slots" in pipe else ".")
                  + (" FLOPs below count every branch of a tick on every tick (an upper bound); the collectives "
                     "count what the busiest stage runs." if "stash_slots" in pipe else "")]
    lines += [
        "",
        "## Collectives per step (bytes each device sends, ring model)",
        "",
        "| mesh axis | link | instructions | runs/step | compiled | predicted | compiled / predicted | time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in sorted(col["by_axis"].items()):
        lines.append(f"| {label} | {row['link']} ({row['link_bw'] / 1e9:.0f} GB/s) | {row['instructions']} | "
                     f"{row['runs']} | {_gib(row['bytes'])} | {_gib(row['predicted_bytes'])} | "
                     f"{_ratio(row['bytes'], row['predicted_bytes'])} | {_seconds(row['time_s'])} |")
    lines += [
        f"| **total** | | | | {_gib(col['total_bytes'])} | {_gib(col['predicted_total_bytes'])} | "
        f"{_ratio(col['total_bytes'], col['predicted_total_bytes'])} | {_seconds(t['communication_s'])} |",
        "",
        "Predicted: the strategy's own `predict` (jaxpar/parallel/<strategy>.py; ZeRO-3 ≈ 3Ψ·e on GPU, 4Ψ·4 on "
        "CPU; DDP 2Ψ·e; Megatron 4-5 all-reduces of b·s·h per layer).",
        "",
        "## FLOPs per device per step",
        "",
        "| | FLOPs | / model |",
        "|---|---:|---:|",
        f"| model (6Ψ + attention, per token x tokens / devices) | {fl['model_per_device']:.4g} | 1.000 |",
        f"| cost_analysis (loop bodies once) | "
        f"{'-' if fl['cost_analysis'] is None else format(fl['cost_analysis'], '.4g')} | "
        f"{_ratio(fl['cost_analysis'], fl['model_per_device'])} |",
        f"| fused kernels (their cost estimates; {'added: custom calls' if fl['kernels_added'] else 'in the HLO count: interpreted'}) | "
        f"{fl['kernels']:.4g} | {_ratio(fl['kernels'], fl['model_per_device'])} |",
        f"| compiled, loop-corrected ({fl['method']}) | {fl['corrected']:.4g} | "
        f"{_ratio(fl['corrected'], fl['model_per_device'])} |",
        "",
        "Compiled > model: remat recomputation, the one-hot embedding matmul, softmax and norms.",
        "",
        *(["## Time on these virtual CPU devices (not a prediction for any accelerator)", "",
            f"{r['devices']} virtual devices share this host's cores and memory; the figures below are theirs."]
          if cpu else ["## Predicted step time (prediction, not a measurement)"]),
        "",
        (f"The planner's step model (jaxpar.plan) for these {r['devices']} virtual CPU devices: "
         f"{_seconds(cal['step_s'])} per step, MFU {cal['mfu']:.1%}: " if cpu else
         f"**The planner's step model (jaxpar.plan): {_seconds(cal['step_s'])} per step, MFU {cal['mfu']:.1%}**: ")
        + "compute at "
        f"η = {cal['efficiency']:.2f} of peak, {cal['overlap']:.0%} of the hideable collectives overlapped "
        f"({cal['source']}); "
        + ", ".join(f"{name} {_seconds(value)}" for name, value in cal["terms"].items()) + ".",
        "",
        f"Optimistic bound (100% of peak: {fl['peak_source']} = {fl['peak_per_device'] / 1e12:.3g} TFLOP/s per "
        "device, collectives at the full link bandwidth), for comparison only:",
        "",
        "| | time | MFU |",
        "|---|---:|---:|",
        f"| compute (compiled FLOPs / peak) | {_seconds(t['compute_s'])} | |",
        f"| communication (bytes / link bandwidth, summed over axes) | {_seconds(t['communication_s'])} | |",
        f"| optimistic bound: perfect overlap, max | {_seconds(t['overlapped_s'])} | {t['mfu_overlapped']:.1%} |",
        f"| step, no overlap: sum | {_seconds(t['serial_s'])} | {t['mfu_serial']:.1%} |",
    ]
    return "\n".join(lines)


def write_json(result: dict, out_dir: str | Path) -> Path:
    """Write the report's numbers (dryrun.json) and its markdown (dryrun.md) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dryrun.md").write_text(markdown_report(result) + "\n")
    path = out / "dryrun.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path

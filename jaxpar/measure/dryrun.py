"""Compile a config's full training step for N devices without allocating it, and read the bill.

The train state and the batch are abstract (ShapeDtypeStructs with shardings), so a 7B model on 64
devices compiles on a laptop. From the compiled program: per device memory (the compiler's accounting
beside the ZeRO formulas), collectives per mesh axis with bytes (beside the strategy's own prediction,
`Strategy.predict`), FLOPs (beside 6Ψ per token), and the optimistic time bound (100% of peak, perfect
overlap). Where it compiles: measure/targets.py.
"""
from __future__ import annotations

import resource
import time

from jaxpar.config import ConfigError
from jaxpar.measure.targets import target_devices


def pipeline_summary(strategy, compiled_peak: int) -> dict | None:
    """A pipeline strategy's schedule, bubble (table and formula) and stash, for the dry-run report."""
    from jaxpar.parallel.schedules import bubble_fraction
    schedule = getattr(strategy, "schedule", None)
    name = strategy.config.parallel.pipe
    if name == "auto":
        return None
    p, m, v = strategy.p, strategy.m, strategy.v
    out = {"schedule": name, "stages": p, "microbatches": m, "virtual": v,
           "bubble_formula": float(bubble_fraction(name, p, m, v)), "peak_per_stage": compiled_peak}
    if schedule is not None:
        out.update(bubble_table=float(schedule.bubble()), ticks=schedule.ticks, in_flight=max(schedule.in_flight()),
                   stash_slots=strategy.program.slots["stash"])
    return out


def _links(found, mesh, machine) -> dict[str, tuple[str, float]]:
    """Per mesh axis: the slowest link its collectives cross, and that link's bytes/s per direction."""
    from jaxpar.measure import hardware
    flat = list(mesh.devices.flat)
    if machine["platform"] == "cpu":
        bw = hardware.probe_host().link_bw
        return {c.axis_label: ("host memory", bw) for c in found}
    acc = hardware.ACCELERATORS[machine["accelerator"]]
    links: dict[str, tuple[str, float]] = {}
    for c in found:
        crosses = any(len({flat[i].process_index for i in g}) > 1 for g in c.replica_groups)
        link = ("InfiniBand", acc.scaleout_bw) if crosses else ("NVLink", acc.link_bw)
        if links.get(c.axis_label, ("", float("inf")))[1] > link[1]:
            links[c.axis_label] = link
    return links


def _peak_flops(config, machine, num_devices: int) -> tuple[float, str]:
    from jaxpar.measure import hardware
    if machine["platform"] == "cpu":   # the host's kept probe, as `train` divides by (JAXPAR_REPROBE_PEAK=1: anew)
        flops, source = hardware.host_matmul_peak(num_devices)
        dtype = config.train.compute_dtype
        note = "" if dtype == "float32" else f" (float32 measured, used for {dtype})"
        return flops / num_devices, (f"host f32 matmul {flops / 1e9:.1f} GFLOP/s shared by {num_devices} virtual "
                                     f"devices{note} ({source})")
    acc = hardware.ACCELERATORS[machine["accelerator"]]
    if config.train.compute_dtype == "float8" and acc.fp8_flops:
        return acc.fp8_flops, f"{acc.name} fp8 dense peak (only the weight matmuls run in fp8)"
    if config.train.compute_dtype in ("bfloat16", "float8"):
        return acc.bf16_flops, f"{acc.name} bf16 dense peak"
    return acc.tf32_flops, f"{acc.name} TF32 dense peak (XLA's default for f32 dots)"


def dryrun(config, target: str = "cpu", devices=None, topology: str | None = None) -> dict:
    """Compile `config`'s training step for `target` without allocating; return every number of the report.

    `devices`: for cpu, the device count JAX was started with (or a device list); for
    GPU targets, a GPU count (or give `topology`, 'PxHxG'). Bad input raises ConfigError.
    """
    import jax

    from jaxpar.measure import hardware, overlap
    from jaxpar.measure.flops import compiled_flops, mfu, model_flops_per_step
    from jaxpar.mesh import describe, make_mesh
    from jaxpar.model.counting import param_count
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

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
    strategy = make_strategy(config, model_cfg, mesh, donate=True)  # accelerator memory: state updated in place
    compiled, kernels, timing = _compile(strategy)
    hlo_text = compiled.as_text()
    memory, kernel_choice = _memory(config, model_cfg, sizes, strategy, compiled, machine)
    collectives = _collectives(config, model_cfg, sizes, strategy, hlo_text, machine)

    flops = compiled_flops(compiled, hlo_text, kernel_flops=kernels.total)
    model_flops = model_flops_per_step(model_cfg, B, S)
    peak, peak_source = _peak_flops(config, machine, n)
    compute_s = flops["corrected"] / peak
    comm_s = sum(row["time_s"] for row in collectives["by_axis"].values())
    overlap_s, serial_s = max(compute_s, comm_s), compute_s + comm_s
    memory["device_hbm_bytes"] = (hardware.ACCELERATORS[machine["accelerator"]].hbm_bytes
                                  if machine["accelerator"] else None)
    hidden = overlap.analyse(hlo_text, mesh, machine, peak)     # each async collective: hidden vs exposed
    return {
        "config": config.name, "target": target, "machine": machine, "devices": n, "mesh": sizes,
        "mesh_text": describe(mesh), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
        "timing": {**timing, "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
        "model": {"params": param_count(model_cfg)["total"], "layers": model_cfg.layers, "d_model": model_cfg.d_model,
                  "vocab_size": model_cfg.vocab_size, "batch_size": B, "seq_len": S,
                  "microbatches": config.train.microbatches, "compute_dtype": config.train.compute_dtype,
                  "remat": config.train.remat, "kernels": kernel_choice},
        "memory": memory,
        "pipeline": pipeline_summary(strategy, memory["compiled"]["peak"]),
        "collectives": collectives,
        "flops": {**flops, "model_per_step": model_flops, "model_per_device": model_flops / n,
                  "peak_per_device": peak, "peak_source": peak_source},
        "time": {"compute_s": compute_s, "communication_s": comm_s, "overlapped_s": overlap_s,
                 "serial_s": serial_s,
                 "mfu_overlapped": mfu(model_flops, overlap_s, n, peak),
                 "mfu_serial": mfu(model_flops, serial_s, n, peak)},
        "overlap": hidden,
    }


def _compile(strategy):
    """(the compiled step, the kernels' FLOPs from its jaxpr, lower and compile seconds): nothing allocated."""
    import jax

    from jaxpar.kernels.costs import kernel_flops
    start = time.perf_counter()
    with jax.set_mesh(strategy.mesh):   # traced once: the jaxpr gives the kernels' FLOPs, then it is lowered
        traced = strategy.step_fn.trace(strategy.abstract_state, strategy.abstract_batch())
        lowered = traced.lower()
    kernels = kernel_flops(traced.jaxpr)
    lowered_at = time.perf_counter()
    with jax.set_mesh(strategy.mesh):
        compiled = lowered.compile()
    return compiled, kernels, {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at}


def _memory(config, model_cfg, sizes, strategy, compiled, machine) -> tuple[dict, dict]:
    """The compiler's memory beside the shardings', the ZeRO formula's and the strategy's predicted (the planner's
    memory model, jaxpar.parallel.memory), and the kernels the config resolved to."""
    from jaxpar.kernels.kernel_ops import resolve
    from jaxpar.measure import hardware
    from jaxpar.measure.memory import compiled_memory, leaf_bytes_per_device, shard_counts, state_bytes, zero_formula
    from jaxpar.model.counting import param_count
    from jaxpar.parallel.step import activation_dtype
    chosen = resolve(config, machine["platform"], activation_dtype(config.train.compute_dtype))
    counts = shard_counts(config, sizes)
    compiled_mem = compiled_memory(compiled, machine["platform"]).as_dict()
    hbm = hardware.ACCELERATORS[machine["accelerator"]].hbm_bytes if machine["accelerator"] else None
    return {"compiled": compiled_mem, "state_from_shardings": state_bytes(strategy.abstract_state),
            "zero_formula": zero_formula(param_count(model_cfg)["total"], counts), "shard_counts": counts,
            "batch_bytes": leaf_bytes_per_device(strategy.abstract_batch()),
            "predicted": predicted_memory(config, model_cfg, sizes, machine["platform"], hbm, compiled_mem)}, chosen


def predicted_memory(config, model_cfg, sizes, platform: str, hbm_bytes, compiled_mem: dict) -> dict:
    """The strategy's predicted per-device memory (`config_memory`, the planner's model) by part, with the
    compiled/predicted ratios and whether the model is calibrated for this platform and precision."""
    from jaxpar.parallel.memory import config_memory
    mem = config_memory(config, model_cfg, sizes, platform, hbm_bytes)
    transient = mem.total - mem.state
    uncalibrated = [why for why, off in (("XLA:CPU", platform == "cpu"),
                                         ("float32", config.train.compute_dtype == "float32")) if off]
    return {"params": mem.params, "optimizer": mem.optimizer, "gradients": mem.gradients,
            "activations": mem.activations, "working": mem.working, "stage_weights": mem.stage_weights,
            "taps": mem.taps, "state": mem.state, "temp": transient, "total": mem.total,
            "fits": mem.fits if hbm_bytes else None, "limit": mem.limit if hbm_bytes else None,
            "peak_ratio": compiled_mem["peak"] / mem.total, "temp_ratio": compiled_mem["temp"] / transient,
            "calibrated": not uncalibrated, "uncalibrated": uncalibrated}


def _collectives(config, model_cfg, sizes, strategy, hlo_text, machine) -> dict:
    """The compiled collectives per mesh axis, each axis' link and time, beside the strategy's prediction."""
    from jaxpar.measure import hlo
    from jaxpar.measure.executed import step_collectives
    from jaxpar.parallel.registry import predicted_collective_bytes
    found = step_collectives(strategy, hlo_text)   # a pipeline stage runs each tick's branches on some ticks only
    predicted = predicted_collective_bytes(config, model_cfg, sizes, machine["platform"])
    links = _links(found, strategy.mesh, machine)
    axes: dict[str, dict] = {}
    for c in found:
        link, bw = links[c.axis_label]
        row = axes.setdefault(c.axis_label, {"instructions": 0, "runs": 0, "bytes": 0.0, "link": link,
                                             "link_bw": bw, "time_s": 0.0})
        row["instructions"] += 1
        row["runs"] += c.runs_per_step
        row["bytes"] += c.bytes_per_step
        row["time_s"] += c.bytes_per_step / bw
    for label, row in axes.items():
        row["predicted_bytes"] = predicted.get(label)
    summary = hlo.summarize(found)
    return {"by_axis": axes, "total_bytes": summary["total"]["bytes"],
            "predicted_total_bytes": sum(predicted.values()), "by_op": summary["by_op"]}

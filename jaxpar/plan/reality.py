"""The planner against reality on the machine we have: N virtual CPU devices, measured step times.

The same planner (same space, same formulas) is pointed at the CPU "cluster": α and β per
collective from a short `jaxpar bench collectives` sweep, the compute rate and memory
bandwidth from the host probe (`measure.hardware.probe_host`), no overlap (XLA:CPU runs
collectives synchronously). One number is calibrated on this machine, as on GPUs: the
compute efficiency η, from ONE strategy (the first, the default data parallel), by solving
measured = compute/η + the rest. Every other strategy's time is then a prediction.

Measurement: every strategy is compiled once, given the same random token batch, warmed
up, and then timed in interleaved rounds (one step of each strategy per round) so that a
load spike from other jobs hits all strategies alike; the median of the rounds is reported.
Each step is timed twice: wall clock, and this process's CPU seconds over the host's cores
(`Measured.cpu_step_s`), which other processes' load does not enter: the step's time on an
idle host if it keeps every core busy. Each basis has its own calibration and links (wall:
`jaxpar bench collectives`; CPU: plan/cpu_links.py, the collectives inside one program). The caller
makes glibc keep freed memory first (measure/host_allocator.py), and each step's page faults are
counted: otherwise some strategies pay for fresh pages every step, which a GPU's allocator never does.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np

from jaxpar.parallel.theory import Candidate
from jaxpar.plan.fleet import Cluster, cpu_cluster
from jaxpar.plan.steptime import Calibration

BENCH_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
BENCH_SIZES = ("16K", "4M")          # the α-β sweep: per-device bytes, doubling
PROBE_SECONDS = 4.0                  # the host probe's timing budget (medians: a loaded host varies)


def default_strategies() -> list[Candidate]:
    """Strategies of the default config jaxpar builds on 8 devices; the first calibrates η."""
    c: dict[str, Any] = dict(remat="none", precision="float32", attention="dot")
    return [
        Candidate(data=8, **c),
        Candidate(fsdp=8, **c),
        Candidate(data=4, fsdp=2, **c),
        Candidate(data=2, tensor=4, **c),
        Candidate(data=8, data_impl="zero1", **c),
        Candidate(data=8, data_impl="zero3", **c),
        Candidate(fsdp=8, microbatches=2, **c),
        Candidate(data=8, **{**c, "remat": "full"}),
    ]


def measure_cluster(devices: int, out_dir, budget_s: float = 0.05, log=print) -> tuple[dict, dict]:
    """The CPU cluster of `devices` virtual devices per timing basis ({"wall": ..., "cpu": ...}): the host probe,
    and α-β per collective from a short bench sweep (wall) or from collectives inside one program (CPU)."""
    import jax

    from jaxpar.bench.collectives import run_collectives_bench
    from jaxpar.measure.hardware import probe_host
    from jaxpar.plan.cpu_links import host_cores, measure_links
    host = probe_host(PROBE_SECONDS)
    log(f"  host probe: {host.source}")
    bench = run_collectives_bench(list(BENCH_OPS), *BENCH_SIZES, budget_s, out_dir)
    inside = measure_links(jax.devices()[:devices])
    for op, fit in bench["fits"].items():
        log(f"  {op}: α {fit['alpha_us']:.0f} µs, β_bus {fit['beta_bus_GBps'] or float('nan'):.2f} GB/s (one call, "
            "wall)")
    for op, fit in inside.items():
        log(f"  {op}: α {fit['alpha_us']:.0f} µs, β_bus {fit['beta_bus_GBps'] or float('nan'):.2f} GB/s (inside a "
            "program, CPU per core)")
    cores = host_cores()
    clusters = {basis: cpu_cluster(devices, fits, host.fp32_flops, host.hbm_bw, host.hbm_bytes or 16e9, cores=cores)
                for basis, fits in (("wall", bench["fits"]), ("cpu", inside))}
    return clusters, {"host": dataclasses.asdict(host), "fits": bench["fits"], "cpu_fits": inside, "cores": cores}


@dataclasses.dataclass
class Measured:
    cand: Candidate
    times: list[float]        # wall-clock seconds per step
    compile_s: float
    compiled_bytes: dict      # mesh axis label -> bytes per step, from the compiled HLO
    cpu_times: list[float] = dataclasses.field(default_factory=list)   # this process's CPU seconds per step
    faults: list[int] = dataclasses.field(default_factory=list)        # this process's minor page faults per step
    memory_bytes: float = 0.0  # the compiled step's per-device peak (measure.memory.compiled_memory)
    global_batch: int = 0
    cores: int = 1            # the host's cores: CPU seconds over them are the load-free step time

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    @property
    def cpu_step_s(self) -> float:
        """The median step's process CPU seconds over the host's cores (module docstring)."""
        return statistics.median(self.cpu_times) / self.cores

    def step_s(self, basis: str) -> float:
        return self.cpu_step_s if basis == "cpu" else self.median_s



def measure_steps(base, strategies: list, global_batch: int, seq_len: int, rounds: int,
                  warmup: int = 2, log=print) -> list[Measured]:
    """Compile every strategy, then time `rounds` interleaved rounds of one step each (see module docstring).
    A strategy given as (candidate, batch) runs that global batch instead of `global_batch`."""
    import jax

    from jaxpar.measure import hlo
    from jaxpar.measure.host_allocator import minor_page_faults
    from jaxpar.measure.memory import compiled_memory
    from jaxpar.parallel.registry import build_strategy
    from jaxpar.plan.cpu_links import host_cores
    from jaxpar.plan.verify import candidate_config

    built = []
    for item in strategies:
        cand, batch_size = item if isinstance(item, tuple) else (item, global_batch)
        tokens = np.random.default_rng(0).integers(0, base.model.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
        config, reason = candidate_config(base, cand, batch_size, seq_len, platform="cpu")
        if config is None:
            log(f"  {cand.label()}: {reason}")
            continue
        strategy = build_strategy(config, jax.devices()[:cand.devices])
        mesh = strategy.mesh
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = strategy.lower_step().compile()
        compile_s = time.perf_counter() - start
        peak = compiled_memory(compiled, jax.devices()[0].platform).peak
        found = hlo.collectives(compiled.as_text(), mesh)
        by_axis: dict[str, float] = {}
        for c in found:
            by_axis[c.axis_label] = by_axis.get(c.axis_label, 0.0) + c.bytes_per_step
        state = strategy.init_state()
        batch = jax.device_put(tokens, strategy.batch_sharding)
        with jax.set_mesh(mesh):
            for _ in range(warmup):
                state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
        log(f"  compiled {cand.label()} in {compile_s:.1f} s")
        built.append([cand, compiled, state, batch, mesh, Measured(cand, [], compile_s, by_axis, memory_bytes=peak,
                                                                global_batch=batch_size, cores=host_cores())])
    for _ in range(rounds):
        for item in built:
            cand, compiled, state, batch, mesh, measured = item
            with jax.set_mesh(mesh):
                start, cpu, faults = time.perf_counter(), time.process_time(), minor_page_faults()
                state, metrics = compiled(state, batch)
                jax.block_until_ready((state, metrics))
            measured.times.append(time.perf_counter() - start)
            measured.cpu_times.append(time.process_time() - cpu)
            measured.faults.append(minor_page_faults() - faults)
            item[2] = state
    return [item[-1] for item in built]


def resolved_pairs(predicted: list[float], steps: list[list[float]]) -> tuple[int, int, int]:
    """(resolved, agreeing, pairs): of all pairs of strategies, those whose measured steps' quartiles do not
    overlap (the measurement resolves their order; a rank correlation over the rest ranks noise), and how many
    of those the predictions order the same way."""
    quartiles = [statistics.quantiles(s, n=4) for s in steps]
    medians = [statistics.median(s) for s in steps]
    resolved = agreeing = pairs = 0
    for i in range(len(steps)):
        for j in range(i + 1, len(steps)):
            pairs += 1
            if quartiles[i][2] < quartiles[j][0] or quartiles[j][2] < quartiles[i][0]:
                resolved += 1
                agreeing += (medians[i] - medians[j]) * (predicted[i] - predicted[j]) > 0
    return resolved, agreeing, pairs


def calibrate(cluster: Cluster, shape, full: Measured, half: Measured | None, seq_len: int,
              basis: str = "wall") -> Calibration:
    """η and the fixed per-step overhead O of the CPU step, from ONE strategy measured at two global batches
    (`basis`: its wall-clock medians or its CPU seconds per core, Measured.step_s).

    The model's time at η = 1 without overhead splits each step into compute C (proportional to the batch) and
    the rest R (memory passes, collectives); measured t = O + C/η + R at batch B and at B/2 gives
    C(B)/(2η) = (t_B - R_B) - (t_B/2 - R_B/2), then O. Without `half`, O = 0 and η alone fits t_B.
    """
    from jaxpar.plan.steptime import step_time
    at_peak = Calibration(compute=1.0, overlap=0.0, memory=1.0, step_overhead_s=0.0, layer_overhead_s=0.0, source="")

    def split(m: Measured) -> tuple[float, float]:
        t = step_time(shape, m.cand, cluster, m.global_batch, seq_len, at_peak)
        return t.compute_s, m.step_s(basis) - (t.total_s - t.compute_s)
    compute, busy = split(full)
    if busy <= 0:     # the model's memory passes and collectives alone take longer than the measured step
        rest = full.step_s(basis) - busy
        return Calibration(compute=1.0, overlap=0.0, memory=1.0, step_overhead_s=0.0, layer_overhead_s=0.0,
                           source=f"not calibrated: on {full.cand.label()} at global batch {full.global_batch} the "
                                  f"model's memory passes and collectives ({rest * 1e3:.0f} ms) exceed the measured "
                                  f"step ({full.step_s(basis) * 1e3:.0f} ms), so no η fits; η = 1 (the host probe's "
                                  "matmul rate), ratios uncalibrated (a size this small is a smoke test)")
    overhead, eta = 0.0, compute / busy
    if half is not None:
        half_compute, half_busy = split(half)
        slope = (busy - half_busy) / (compute - half_compute)       # measured seconds per model second of compute
        if slope > 0 and busy - slope * compute > 0:
            eta, overhead = 1 / slope, busy - slope * compute
    where = (f"measured on {full.cand.label()} at global batch {full.global_batch}"
             + (f" and {half.global_batch}" if half is not None else ""))
    return Calibration(compute=eta, overlap=0.0, memory=1.0, step_overhead_s=overhead, layer_overhead_s=0.0,
                       source=f"η = {eta:.3f} of the host probe's matmul rate and a fixed {overhead * 1e3:.0f} ms "
                              f"per step, {where} ({'CPU seconds per core' if basis == 'cpu' else 'wall clock'})")

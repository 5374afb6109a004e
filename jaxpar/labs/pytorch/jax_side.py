"""The jaxpar side of lab 06: each jaxpar counterpart of a PyTorch strategy, compiled once, trained over the
lab's batches from the lab's initial weights, and read: losses, step times, bytes per collective kind
from the compiled program (`measure.hlo`), per-device memory from XLA's memory analysis.

`run_variants` runs in whatever process has the devices; the lab calls it through
`python -m jaxpar.labs.pytorch.jax_side SPEC.json OUT.json` with `--cpu-devices N` fixed before JAX
starts (the lab's own process may hold another device count). The test calls it directly.
"""
from __future__ import annotations

import copy
import json
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def collective_bytes(strategy, compiled) -> dict:
    """Bytes per device per step by collective kind (ring model), and runs per step, of a compiled step.
    A pipeline's collectives are counted per stage as executed (`executed_collectives`) and averaged;
    its permutes are summed over their source-target pairs (a tick's sends: over the stages that send) and divided
    by the devices."""
    from jaxpar.labs.pipeline.lab import permute_bytes
    from jaxpar.measure import hlo
    from jaxpar.measure.executed import executed_collectives

    text, n = compiled.as_text(), strategy.mesh.size
    sent: defaultdict[str, float] = defaultdict(float)
    runs: defaultdict[str, float] = defaultdict(float)
    if not hasattr(strategy, "program"):
        for c in hlo.collectives(text, strategy.mesh):
            sent[c.op] += c.bytes_per_step
            runs[c.op] += c.runs_per_step
        return {"sent": dict(sent), "calls": dict(runs)}
    stages = strategy.mesh.shape["pipe"]
    sent["collective-permute"] = permute_bytes(strategy, text) / n
    for stage in range(stages):
        for c in executed_collectives(text, strategy.mesh, strategy.program, stage):
            if c.op == "collective-permute":
                runs[c.op] += c.runs_per_step / stages
            else:
                sent[c.op] += c.bytes_per_step / stages
                runs[c.op] += c.runs_per_step / stages
    return {"sent": dict(sent), "calls": dict(runs)}


def run_variants(config, batches: list[np.ndarray], variants: dict[str, list[str]], log=print) -> dict:
    """Train each variant (key -> config overrides on `config`) over `batches` from the same initial state."""
    import jax

    from jaxpar.config import apply_overrides, validate
    from jaxpar.measure.memory import compiled_memory
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    out, initial = {}, None
    for key, overrides in variants.items():
        c = copy.deepcopy(config)
        apply_overrides(c, overrides)
        n = c.mesh.data * c.mesh.fsdp * c.mesh.pipe * c.mesh.tensor * c.mesh.expert
        validate(c, n)
        strategy = make_strategy(c, ModelConfig.from_config(c.model), make_mesh(c, jax.devices()[:n]))
        start = time.perf_counter()
        with jax.set_mesh(strategy.mesh):
            compiled = strategy.lower_step().compile()
        compile_s = time.perf_counter() - start
        if initial is None:
            initial = jax.device_get(strategy.init_state())
        state = jax.device_put(initial, strategy.state_shardings)
        losses, norms, times = [], [], []
        with jax.set_mesh(strategy.mesh):
            for batch in batches:
                tokens = jax.device_put(batch, strategy.batch_sharding)
                t0 = time.perf_counter()
                state, metrics = compiled(state, tokens)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t0)
                losses.append(float(metrics["loss"]))
                norms.append(float(metrics["grad_norm"]))
        memory = compiled_memory(compiled, "cpu")
        out[key] = {"overrides": overrides, "devices": n, "losses": losses, "grad_norms": norms, "step_s": times,
                    "compile_s": compile_s, "comm": collective_bytes(strategy, compiled),
                    "memory": {"argument": memory.argument, "temp": memory.temp, "output": memory.output}}
        log(f"  jaxpar {key} ({' '.join(overrides)}): compiled in {compile_s:.1f} s, "
            f"median step {1e3 * statistics.median(times[1:] or times):.1f} ms")
    return out


def main(argv=None) -> int:
    spec_path, out_path, devices = argv or sys.argv[1:]
    from jaxpar.mesh import set_cpu_devices
    set_cpu_devices(int(devices))
    from jaxpar.config import apply_overrides, load_config
    spec = json.loads(Path(spec_path).read_text())
    config = load_config(spec["config"])
    apply_overrides(config, spec["overrides"])
    batches = list(np.load(spec["batches"])["batches"])
    results = run_variants(config, batches, spec["variants"], log=lambda line: print(line, flush=True))
    results["_process"] = {"ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(out_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Overlap on the devices themselves: per strategy, how much collective time runs beside compute in a profile,
next to what the compiled schedule's replay predicts (jaxpar/measure/overlap.py).

    python benchmarks/overlap.py --out runs/bench-overlap                 # all local GPUs, configs/llama_1b.py
    python benchmarks/overlap.py --cpu 8 --out runs/bench-overlap-cpu     # CPU check: configs/test.py, 8 devices

Each strategy: compile, two warm-up steps on random tokens, one profiled step. From the trace
(jax.profiler): per device, the union of its collective kernels (NCCL on GPU) and of its compute
kernels, and their intersection: the collective time that ran beside compute. From the compiled
HLO: the replay's hidden fraction on this machine's peaks (GPU: the datasheet of the device kind).
Writes overlap.json and overlap.md into --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STRATEGIES = {        # name -> overrides, for N devices (tensor = min(N, 4) for the TP ones)
    "fsdp (XLA)": lambda n: ["mesh.data=1", f"mesh.fsdp={n}"],
    "zero3": lambda n: ["mesh.fsdp=1", f"mesh.data={n}", "parallel.data=zero3"],
    "zero3 + prefetch": lambda n: ["mesh.fsdp=1", f"mesh.data={n}", "parallel.data=zero3", "parallel.prefetch=true"],
    "tp+sp": lambda n: _tp(n, "none"),
    "tp+sp + collective matmul": lambda n: _tp(n, "collective_matmul"),
    "tp+sp + bidirectional": lambda n: _tp(n, "bidirectional"),
}


def _tp(n: int, overlap: str) -> list[str]:
    t = min(n, 4)
    return ["mesh.fsdp=1", f"mesh.data={n // t}", f"mesh.tensor={t}", "parallel.tensor=manual",
            "parallel.sequence=true", f"parallel.tensor_overlap={overlap}"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", type=int, metavar="N", help="CPU check on N virtual devices (configs/test.py)")
    p.add_argument("--config", help="default: configs/llama_1b.py (GPU), configs/test.py (CPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--strategies", help=f"comma list (default all: {', '.join(STRATEGIES)})")
    p.add_argument("--out", default="runs/bench-overlap")
    return p.parse_args(argv)


def measure(name: str, overrides: list[str], devices, vocab: int, log=print) -> dict:
    import jax
    import numpy as np

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.labs.overlap.lab import profile_step
    from jaxpar.measure import hardware, overlap
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy
    config = load_config(ARGS.config)
    apply_overrides(config, [*ARGS.overrides, *overrides])
    strategy = make_strategy(config, ModelConfig.from_config(config.model, vocab), make_mesh(config, devices))
    rng = np.random.default_rng(0)
    batch = jax.device_put(rng.integers(0, vocab, (config.train.batch_size, config.data.seq_len + 1),
                                        dtype=np.int32), strategy.batch_sharding)
    with jax.set_mesh(strategy.mesh):
        step = strategy.lower_step().compile()
        state = strategy.init_state()
        for _ in range(2):
            state, _ = step(state, batch)
    profile = profile_step(strategy, step, state, batch)
    acc = hardware.lookup(devices[0].device_kind)
    platform = "cpu" if devices[0].platform == "cpu" else "gpu"
    peak = (acc.bf16_flops if acc else hardware.probe_host().fp32_flops / len(devices))
    machine = {"platform": platform}
    if platform == "gpu":
        machine.update(target="h100" if "H100" in acc.name else ("h200" if "H200" in acc.name else "a100"),
                       hosts=1, gpus_per_host=len(devices), accelerator=next(
                           k for k, v in hardware.ACCELERATORS.items() if v is acc))
    replay = overlap.analyse(step.as_text(), strategy.mesh, machine, peak)
    log(f"  {name}: profile {profile['overlapped_fraction']:.1%} of {profile['collective_us'] / 1e3:.1f} ms beside "
        f"compute; replay {replay['hidden_fraction']:.1%} hidden")
    return {"overrides": overrides, "profile_overlapped_fraction": profile["overlapped_fraction"],
            "profile_collective_us": profile["collective_us"], "replay_hidden_fraction": replay["hidden_fraction"],
            "replay_by_axis": replay["by_axis"]}


ARGS = None


def main(argv=None) -> int:
    global ARGS
    ARGS = args = parse(argv)
    import jax
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu)
    args.config = args.config or ("configs/test.py" if args.cpu else "configs/llama_1b.py")
    if args.cpu and args.config == "configs/test.py":
        args.overrides = ["model.kv_heads=4", *args.overrides]      # tensor=4 splits every head count
    devices = jax.devices()
    names = [s.strip() for s in args.strategies.split(",")] if args.strategies else list(STRATEGIES)
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        print(f"error: --strategies: unknown {', '.join(unknown)}; valid: {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"overlap on {len(devices)} x {devices[0].device_kind}, {args.config}")
    results = {"devices": len(devices), "device_kind": devices[0].device_kind, "config": args.config}
    for name in names:
        try:
            results[name] = measure(name, STRATEGIES[name](len(devices)), devices, 512 if args.cpu else 32000)
        except Exception as err:  # noqa: BLE001 - one strategy's failure is reported, the others still run
            results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            print(f"  {name}: failed: {results[name]['error']}")
    (out / "overlap.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = [f"| {n} | {r['profile_overlapped_fraction']:.1%} | {r['profile_collective_us'] / 1e3:.2f} ms | "
            f"{r['replay_hidden_fraction']:.1%} |"
            for n, r in results.items() if isinstance(r, dict) and "overrides" in r]
    (out / "overlap.md").write_text(
        f"# Overlap on {len(devices)} x {devices[0].device_kind} ({args.config})\n\n"
        "| strategy | collective time beside compute (profile) | collective time (profile, all devices) | "
        "hidden (schedule replay) |\n|---|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    print(f"wrote {out / 'overlap.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

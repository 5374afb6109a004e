"""Tokens/s of jaxpar's strategies on one reference shape, to compare with other strategies on the same machine.

The shape: vocab 8192, d_model 384, 6 layers, 6 heads, SwiGLU 1024, sequence 256, global batch 16,
fp32, no remat, on 8 devices (fsdp=8 is the headline). Each strategy is compiled once; the
compiled FLOPs (loop-corrected) are compared with the model's 6Ψ + attention, and `--steps`
timed steps (after `--warmup`) give the median step time and tokens/s. Random tokens: the
data does not change the speed.

    python benchmarks/reference_shape.py --cpu-devices 8 [--strategies fsdp,data,zero3] [--steps 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

SHAPE = ["model.vocab_size=8192", "model.d_model=384", "model.layers=6", "model.heads=6", "model.kv_heads=6",
         "model.mlp_dim=1024", "model.max_seq_len=256", "data.seq_len=256", "train.batch_size=16",
         "train.compute_dtype=float32", "train.remat=none", "train.microbatches=1"]
STRATEGIES = {
    "fsdp": ["mesh.data=1", "mesh.fsdp=8"],
    "data": ["mesh.data=8"],
    "tensor2xdata4": ["mesh.data=4", "mesh.tensor=2"],
    "ddp": ["mesh.data=8", "parallel.data=ddp"],
    "zero1": ["mesh.data=8", "parallel.data=zero1"],
    "zero2": ["mesh.data=8", "parallel.data=zero2"],
    "zero3": ["mesh.data=8", "parallel.data=zero3"],
}


def measure(name: str, overrides: list[str], steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    from jaxpar.config import apply_overrides, base_config
    from jaxpar.measure.flops import compiled_flops, model_flops_per_step
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    config = base_config()
    apply_overrides(config, SHAPE + overrides)
    mesh = make_mesh(config)
    model_cfg = ModelConfig.from_config(config.model)
    strategy = make_strategy(config, model_cfg, mesh)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = strategy.lower_step().compile()
    compile_s = time.perf_counter() - start
    B, S = config.train.batch_size, config.data.seq_len
    flops = compiled_flops(compiled)["corrected"] * len(mesh.devices.flat)
    model = model_flops_per_step(model_cfg, B, S)
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (B, S + 1), dtype=np.int32)
    batch = jax.device_put(tokens, strategy.batch_sharding)
    state = strategy.init_state()
    times = []
    with jax.set_mesh(mesh):
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"strategy": name, "step_ms": 1e3 * step_s, "tokens_per_s": B * S / step_s, "compile_s": compile_s,
            "flops_ratio": flops / model, "loss": float(metrics["loss"]), "spread_ms": 1e3 * (max(times) - min(times))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--strategies", default="fsdp,data,ddp,zero1,zero2,zero3,tensor2xdata4",
                        help=f"comma-separated, from {', '.join(STRATEGIES)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or args.steps < 1 or args.warmup < 0 or args.cpu_devices < 8:
        print(f"error: --strategies takes {', '.join(STRATEGIES)}; --steps >= 1, --warmup >= 0, "
              "--cpu-devices >= 8", file=sys.stderr)
        return 2
    import jax
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    rows = []
    for name in names:
        row = measure(name, STRATEGIES[name], args.steps, args.warmup)
        rows.append(row)
        print(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, {row['step_ms']:.0f} ms/step", flush=True)
    print(f"\nReference shape on {args.cpu_devices} {jax.devices()[0].platform} devices, jax {jax.__version__}, "
          f"median of {args.steps} steps after {args.warmup} warm-up\n")
    print("| strategy | tokens/s | step ms (median) | spread ms | compiled FLOPs / model FLOPs | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['strategy']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.0f} | {r['spread_ms']:.0f} | "
              f"{r['flops_ratio']:.3f} | {r['compile_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokens/s and MFU of a config's train step on one device with each attention choice.

    python benchmarks/mfu.py --out runs/bench-mfu                        # a GPU: configs/llama_1b.py
    python benchmarks/mfu.py --cpu --out runs/bench-mfu-cpu              # CPU check: the tiny test model

The step is jaxpar's own (make_strategy), on one device (mesh.data=1, mesh.fsdp=1), on random
tokens. MFU = model FLOPs per step (6 x matmul params + attention, per token: model/counting.py)
/ median step time / the device's dense peak for the compute dtype. The compiled FLOPs
(HLO count + the kernels' cost estimates, as `jaxpar dryrun` reports them) are printed too:
their ratio to the model FLOPs is the recomputation (remat) and the extra kernel work.
Writes mfu.json and mfu.md into --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="CPU check: configs/test.py, interpreted Pallas")
    p.add_argument("--config", help="default: configs/llama_1b.py (GPU), configs/test.py (CPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--attentions", help="comma list (default GPU dot,xla,cudnn,pallas; CPU dot,xla,pallas)")
    p.add_argument("--batch", type=int, help="sequences per step (default GPU 8, CPU 4)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (after one warm-up step)")
    p.add_argument("--out", default="runs/bench-mfu")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import jax
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
    import numpy as np

    from jaxpar.config import ConfigError, apply_overrides, load_config, model_vocab_size
    from jaxpar.kernels.costs import kernel_flops
    from jaxpar.measure.flops import compiled_flops, model_flops_per_step
    from jaxpar.measure.hardware import peak_flops_per_device
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    gpu = jax.default_backend() == "gpu"
    attentions = (args.attentions or ("dot,xla,cudnn,pallas" if gpu else "dot,xla,pallas")).split(",")
    batch = args.batch or (8 if gpu else 4)
    rows = []
    for attention in attentions:
        row = {"attention": attention}
        try:
            config = load_config(args.config or ("configs/llama_1b.py" if gpu else "configs/test.py"))
            apply_overrides(config, ["mesh.data=1", "mesh.fsdp=1", f"train.batch_size={batch}",
                                     f"model.attention={attention}", *args.overrides])
            mesh = make_mesh(config, jax.devices()[:1])
            vocab = model_vocab_size(config, config.data.vocab_size, 1)
            strategy = make_strategy(config, ModelConfig.from_config(config.model, vocab), mesh)
            S = config.data.seq_len
            tokens = np.random.default_rng(0).integers(0, vocab, (batch, S + 1), dtype=np.int32)
            with jax.set_mesh(mesh):
                start = time.perf_counter()
                traced = strategy.step_fn.trace(strategy.abstract_state, strategy.abstract_batch())
                compiled = traced.lower().compile()
                row["compile_s"] = time.perf_counter() - start
                state = strategy.init_state()
                batch_array = jax.device_put(tokens, strategy.batch_sharding)
                state, metrics = compiled(state, batch_array)           # warm-up
                jax.block_until_ready(metrics)
                times = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    state, metrics = compiled(state, batch_array)
                    jax.block_until_ready(metrics)
                    times.append(time.perf_counter() - start)
            step = statistics.median(times)
            peak, peak_source = peak_flops_per_device(config.train.compute_dtype if config.train.compute_dtype
                                                      != "float8" else "bfloat16")
            model_flops = model_flops_per_step(strategy.model_cfg, batch, S)
            counted = compiled_flops(compiled, kernel_flops=kernel_flops(traced.jaxpr).total)
            row.update({"config": config.name, "batch": batch, "seq_len": S, "step_s": step,
                        "tokens_per_s": batch * S / step, "model_flops": model_flops,
                        "compiled_flops": counted["corrected"], "peak": peak, "peak_source": peak_source,
                        "mfu": model_flops / step / peak if peak else None, "loss": float(metrics["loss"]),
                        "compute_dtype": config.train.compute_dtype, "remat": config.train.remat})
        except ConfigError as err:
            row["error"] = f"ConfigError: {err}"
        except Exception as err:   # noqa: BLE001 - out of memory, or a kernel the backend lacks
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    meta = {"device": device.device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "mfu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    ok = [r for r in rows if "error" not in r]
    head = ok[0] if ok else {}
    lines = [(f"### Train step on one {device.device_kind}: {head.get('config', '?')}, batch {batch} x "
              f"{head.get('seq_len', '?')}, {head.get('compute_dtype', '?')}, remat {head.get('remat', '?')} "
              f"(jax {jax.__version__}, {meta['date']})"), "",
             f"Peak: {head.get('peak_source', '-')}." + ("" if gpu else " CPU: Pallas interpreted."), "",
             "| attention | step (ms) | tokens/s | MFU | compiled / model FLOPs | compile (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['attention']} | {r['error']} | | | | |")
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
            lines.append(f"| {r['attention']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | "
                         f"{r['compiled_flops'] / r['model_flops']:.2f} | {r['compile_s']:.1f} |")
    (out / "mfu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

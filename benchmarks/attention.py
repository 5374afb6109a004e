"""Attention forward + backward TFLOP/s for each implementation across sequence lengths (causal), vs the peak.

    python benchmarks/attention.py --out runs/bench-attention            # a GPU: bf16, S 1024..8192
    python benchmarks/attention.py --cpu --out runs/bench-attention-cpu  # CPU check: tiny, Pallas interpreted

Implementations (the values of model.attention): dot (jaxpar's einsum, full [S, S] scores), xla
(jax.nn.dot_product_attention's XLA path), cudnn (its cuDNN fused kernel, GPU only), pallas
(jaxpar's flash attention kernel). FLOPs follow FlashAttention's convention: forward
4·B·H·S²·D, halved for the causal mask, backward 2.5x the forward, so fwd+bwd = 3.5x; the
time is the median of --repeats calls of one jitted function computing the output and dq, dk,
dv. Every implementation is first checked against the fp32 reference at the smallest S.
Writes attention.json and attention.md into --out.
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
    p.add_argument("--cpu", action="store_true", help="CPU check: tiny shapes, interpreted Pallas, no cudnn")
    p.add_argument("--seq-lens", help="comma list (default GPU 1024,2048,4096,8192; CPU 64,128)")
    p.add_argument("--impls", help="comma list of dot,xla,cudnn,pallas (default: all the backend runs)")
    p.add_argument("--batch", type=int, help="default GPU 4, CPU 1")
    p.add_argument("--heads", type=int, help="query heads (default GPU 16, CPU 2)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default = heads)")
    p.add_argument("--head-dim", type=int, default=None, help="default GPU 128, CPU 64")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--repeats", type=int, help="timed calls per point (default GPU 20, CPU 3)")
    p.add_argument("--out", default="runs/bench-attention")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import jax
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels.flash_attention import attention_reference
    from jaxpar.kernels.kernel_ops import library_attention
    from jaxpar.measure.hardware import peak_flops_per_device
    from jaxpar.model.ops import dot_attention

    gpu = jax.default_backend() == "gpu"
    seq_lens = [int(s) for s in (args.seq_lens or ("1024,2048,4096,8192" if gpu else "64,128")).split(",")]
    B = args.batch or (4 if gpu else 1)
    H = args.heads or (16 if gpu else 2)
    KV = args.kv_heads or H
    D = args.head_dim or (128 if gpu else 64)
    repeats = args.repeats or (20 if gpu else 3)
    dtype = jnp.dtype(args.dtype)
    impls = (args.impls or ("dot,xla,cudnn,pallas" if gpu else "dot,xla,pallas")).split(",")
    peak, peak_source = peak_flops_per_device(args.dtype)

    def flash(q, k, v):
        from jaxpar.kernels.flash_attention import flash_attention
        return flash_attention(q, k, v, block_q=args.block_q, block_k=args.block_k, interpret=not gpu)

    attention = {"dot": dot_attention, "xla": lambda q, k, v: library_attention(q, k, v, implementation="xla"),
                 "cudnn": lambda q, k, v: library_attention(q, k, v, implementation="cudnn"), "pallas": flash}
    unknown = [i for i in impls if i not in attention]
    if unknown:
        print(f"error: --impls: unknown {unknown[0]}; valid: {', '.join(attention)}", file=sys.stderr)
        return 2

    def fwd_bwd(fn):
        def run(q, k, v, do):
            out, pullback = jax.vjp(fn, q, k, v)
            return (out, *pullback(do))
        return jax.jit(run)

    rows = []
    for impl in impls:
        for S in seq_lens:
            rng = np.random.default_rng(S)
            q, do = (jnp.asarray(rng.normal(size=(B, S, H, D)), dtype) for _ in range(2))
            k, v = (jnp.asarray(rng.normal(size=(B, S, KV, D)), dtype) for _ in range(2))
            row = {"impl": impl, "seq_len": S, "batch": B, "heads": H, "kv_heads": KV, "head_dim": D,
                   "dtype": args.dtype}
            try:
                fn = fwd_bwd(attention[impl])
                start = time.perf_counter()
                result = jax.block_until_ready(fn(q, k, v, do))
                row["compile_and_first_s"] = time.perf_counter() - start
                if S == seq_lens[0]:
                    want = fwd_bwd(attention_reference)(q, k, v, do)
                    row["max_rel_error"] = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                                                     / jnp.max(jnp.abs(w.astype(jnp.float32))))
                                               for g, w in zip(result, want))
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v, do))
                    times.append(time.perf_counter() - start)
                row["seconds"] = statistics.median(times)
                row["flops"] = 3.5 * 4 * B * H * S * S * D / 2
                row["tflops"] = row["flops"] / row["seconds"] / 1e12
                row["of_peak"] = row["flops"] / row["seconds"] / peak if peak else None
            except Exception as err:   # noqa: BLE001 - an implementation the backend lacks, or out of memory
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    meta = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "peak": peak, "peak_source": peak_source}
    (out / "attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [(f"### Attention forward + backward, causal, {args.dtype}, B {B}, H {H}, KV {KV}, D {D} "
              f"({device.device_kind}, jax {jax.__version__}, {meta['date']})"), "",
             f"Peak: {peak_source}." + ("" if gpu else " CPU: Pallas runs interpreted; speeds are not the kernel's."),
             "", "| impl | S | ms | TFLOP/s | of peak | vs cudnn | max rel. error vs fp32 reference |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    cudnn = {r["seq_len"]: r.get("tflops") for r in rows if r["impl"] == "cudnn"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['seq_len']} | {r['error']} | | | | |")
            continue
        versus = f"{r['tflops'] / cudnn[r['seq_len']]:.2f}" if cudnn.get(r["seq_len"]) else "-"
        share = f"{r['of_peak']:.1%}" if r["of_peak"] else "-"
        error = f"{r['max_rel_error']:.1e}" if "max_rel_error" in r else ""
        lines.append(f"| {r['impl']} | {r['seq_len']} | {r['seconds'] * 1e3:.2f} | {r['tflops']:.3g} | {share} | "
                     f"{versus} | {error} |")
    (out / "attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How efficient a step's weight matmuls are, by their size: small GEMMs do not reach a large one's rate.

Each weight matmul of one microbatch on one device multiplies M tokens (b·s) by a K x N
weight (after the tensor split) and moves e·(MK + KN + MN) bytes (e: bytes per element:
fp8 1, bf16 2, fp32 4) for 2·MKN FLOPs: its arithmetic intensity is I = 2MKN / (e(MK + KN + MN)).
Where the compute and the memory traffic of a kernel do not overlap perfectly, its time is
FLOPs/peak + bytes/bandwidth (the additive form of the roofline; Williams, Waterman and
Patterson 2009), so its efficiency is 1 / (1 + ridge/I), ridge = peak / memory bandwidth
(295 FLOP/byte for an H100's bf16). A Llama-8B's 4096-wide GEMMs on 8192 tokens come out at
~0.87, a 1.1B's 2048-wide at ~0.80, narrow tensor-parallel shards and short microbatches lower.

The step's factor is the time-weighted mean over its matmuls (q, k, v, o, gate, up, down, the
head; MoE experts on the tokens each receives). It multiplies the calibrated η, which is then
the efficiency of an ideal, arbitrarily large GEMM (fitted on published runs, plan/anchors.py).
"""
from __future__ import annotations


def weight_matmuls(shape, tensor: int) -> list[tuple[float, float, float, float]]:
    """(K, N, tokens share, FLOPs weight) of each weight matmul of a layer on one device of a tensor group; MoE
    experts see top_k / experts of the tokens each, and a token visits top_k of them."""
    d, dh = shape.d_model, shape.head_dim
    mlp, share, visits = ((shape.expert_mlp_dim, shape.top_k / shape.experts, shape.top_k) if shape.experts
                          else (shape.mlp_dim, 1.0, 1.0))
    attention = [(d, shape.heads * dh / tensor), (d, shape.kv_heads * dh / tensor),
                 (d, shape.kv_heads * dh / tensor), (shape.heads * dh / tensor, d)]
    mlps = [(d, mlp / tensor), (d, mlp / tensor), (mlp / tensor, d)]
    return [(k, n, 1.0, 1.0) for k, n in attention] + [(k, n, share, visits) for k, n in mlps]


def intensity(m: float, k: float, n: float, e: float) -> float:
    return 2 * m * k * n / (e * (m * k + k * n + m * n))


def gemm_efficiency(shape, cand, tokens_per_microbatch: float, ridge: float) -> float:
    """The step's matmul time at peak over its time under the additive roofline (see the module docstring)."""
    e = {"float8": 1, "float32": 4}.get(cand.precision, 2)
    gemms = [(k, n, s, w * shape.layers) for k, n, s, w in weight_matmuls(shape, cand.tensor)]
    gemms.append((shape.d_model, shape.vocab / cand.tensor, 1.0, 1.0))     # the head
    flops = slow = 0.0
    for k, n, share, weight in gemms:
        work = weight * k * n
        flops += work
        slow += work * (1 + ridge / intensity(tokens_per_microbatch * share, k, n, e))
    return flops / slow

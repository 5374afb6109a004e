"""Bytes and collectives per mesh axis of one training step, per device, from the course's formulas.

Each `Flow` is one kind of collective on one mesh axis: the bytes each device sends per
step (ring model: (n-1)/n of the buffer for all-gather / reduce-scatter / all-to-all,
2(n-1)/n for all-reduce), how many collectives carry them (for the α term), and whether
the strategy lets the compiler hide them behind compute ("hideable").

For the strategies jaxpar builds (automatic data / fsdp / tensor, manual DDP and ZeRO
stages) the bytes are those of `jaxpar.dryrun.predicted_collective_bytes`, the formulas
checked against compiled programs in labs 00 and 02 (tests/test_plan.py keeps the two
equal). Pipeline and expert terms follow the pipeline and MoE trainers' own formulas:
  pipe    every schedule tick each stage sends one activation forward and one gradient
          back, a = b·s·h·e each, over 2(v·m + p - 1) ticks; the embedding/head gradients
          are summed over pipe once, 2(p-1)/p·4·Ψ_o/T. Data and fsdp reduce each stage's
          fp32 gradient once per step.
  expert  per MoE layer and microbatch, dispatch + combine all-to-alls of b·s·k·h·e each,
          forward and backward (and the forward again under remat): (X-1)/X of them leave.

e = bytes per element on the wire: the activation dtype on GPU (bf16 for bfloat16 and float8; but
float8's data-parallel gradient all-reduce runs in fp32: 1.94-1.95x the bf16 bytes in two deviceless
H100 compiles of the 7B, where XLA reduces before the cast back from the fp8 matmul's gradient),
4 on CPU (XLA:CPU communicates bf16 in fp32); XLA:CPU spells a reduce-scatter as an all-reduce +
slice (twice the bytes) and does not merge the q/k/v input-gradient sums (7 tensor all-reduces
per layer instead of 4).
Hideable on GPU: the fsdp gathers and reduce-scatters inside the layer loop (XLA's async
collectives and collective pipeliner overlap them with the layer's matmuls, as the H100 dry
runs of lab 02 show), ZeRO-2/3's per-layer collectives. Not hideable: the automatic data-parallel
all-reduce (issued after the backward layer loop), Megatron's all-reduces (on the critical path),
pipeline sends, MoE all-to-alls. On CPU nothing is hidden (collectives are synchronous).
"""
from __future__ import annotations

import dataclasses

from jaxpar.plan.shape import ModelShape
from jaxpar.plan.space import Candidate

WEIGHTS_PER_LAYER = 9     # attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down: one collective each
OTHER_WEIGHTS = 3         # embed, lm_head, final_norm


@dataclasses.dataclass(frozen=True)
class Flow:
    axis: str            # mesh axis (a group over several axes is named "data+expert")
    op: str              # all-gather | reduce-scatter | all-reduce | all-to-all | permute
    bytes: float         # sent per device per step
    count: float         # collectives per step
    hideable: bool


def wire_bytes(precision: str, platform: str) -> int:
    if platform == "cpu":
        return 4
    return 4 if precision == "float32" else 2


def rows_per_microbatch(cand: Candidate, global_batch: int) -> float:
    return global_batch / cand.batch_shards / cand.microbatches


def flows(shape: ModelShape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> list[Flow]:
    """Every collective flow of one step of `cand` (see the module docstring)."""
    counts = shape.counts()
    D, F, T, P, X, m = cand.data, cand.fsdp, cand.tensor, cand.pipe, cand.expert, cand.microbatches
    e = wire_bytes(cand.precision, platform)
    b = rows_per_microbatch(cand, global_batch)
    s, h, L = seq_len, shape.d_model, shape.layers
    psi_x = counts["experts"]
    psi_layers = counts["blocks"] - psi_x * (X - 1) / X       # this device's share of the layers (experts split)
    psi_other = counts["total"] - counts["blocks"]
    psi = psi_layers + psi_other
    cpu = platform == "cpu"
    out: list[Flow] = []

    if P > 1:
        return _pipeline_flows(shape, cand, b, s, e, psi_layers, psi_other, cpu)

    if cand.data_impl != "auto":
        if D > 1:
            ring = (D - 1) / D
            tied = 2 * counts["embedding"] if shape.tie_embeddings else 0
            arrays = WEIGHTS_PER_LAYER + OTHER_WEIGHTS
            if cand.data_impl in ("ddp", "zero1"):
                op = "all-reduce" if cand.data_impl == "ddp" else "reduce-scatter"
                out.append(Flow("data", op, ring * 2 * 4 * psi, arrays, False))
            elif cand.data_impl == "zero2":
                out.append(Flow("data", "reduce-scatter", ring * e * m * psi, arrays * m, not cpu))
                out.append(Flow("data", "all-gather", ring * 4 * psi, arrays, False))
            else:   # zero3
                out.append(Flow("data", "all-gather", ring * e * m * (2 * psi_layers + psi_other + tied / 2),
                                (2 * L * WEIGHTS_PER_LAYER + OTHER_WEIGHTS) * m, not cpu))
                out.append(Flow("data", "reduce-scatter", ring * e * m * (psi_layers + psi_other + tied / 2),
                                (L * WEIGHTS_PER_LAYER + OTHER_WEIGHTS) * m, not cpu))
        return out

    if F > 1:
        ring = (F - 1) / F
        looked_up = counts["embedding"] if not (shape.tie_embeddings or T > 1 or D > 1 or X > 1) else 0
        layer_gathers = ring * e * 2 * m * psi_layers / T
        other_gathers = ring * e * (psi_other - looked_up) / T
        out.append(Flow("fsdp", "all-gather", layer_gathers, 2 * m * L * WEIGHTS_PER_LAYER, not cpu))
        out.append(Flow("fsdp", "all-gather", other_gathers, OTHER_WEIGHTS - (1 if looked_up else 0), False))
        if looked_up:   # the partitioner moves tokens and activations instead of gathering the table
            out.append(Flow("fsdp", "all-to-all", ring * m * (4 * b * F * s + 2 * e * b * s * h / T), 3 * m, False))
        reduce_op, reduce_e = ("all-reduce", 2 * 4) if cpu else ("reduce-scatter", e)
        out.append(Flow("fsdp", reduce_op, ring * psi_layers / T * reduce_e * m, m * L * WEIGHTS_PER_LAYER, not cpu))
        out.append(Flow("fsdp", reduce_op, ring * (psi_other - looked_up) / T * reduce_e * m,
                        m * OTHER_WEIGHTS, False))
    if X > 1:
        out += _expert_flows(shape, cand, b, s, e, psi, psi_x, cpu)
    elif D > 1:
        grad_e = 4 if cand.precision == "float8" and not cpu else e
        out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * grad_e * psi / (F * T) * m,
                        m * (WEIGHTS_PER_LAYER + OTHER_WEIGHTS), False))
    if T > 1:
        per_layer = (7 if cpu else 4) + (1 if cand.remat == "full" else 0)
        count = (per_layer * L + 2) * m
        out.append(Flow("tensor", "all-reduce", count * 2 * (T - 1) / T * e * b * s * h, count, False))
    return out


def _expert_flows(shape, cand, b, s, e, psi, psi_x, cpu) -> list[Flow]:
    """MoE: the all-to-alls over `expert`, and the gradient reductions of what every expert device holds."""
    D, F, T, X, m = cand.data, cand.fsdp, cand.tensor, cand.expert, cand.microbatches
    runs = 2 * (2 + (0 if cand.remat == "none" else 1))        # dispatch + combine; forward, backward, recompute
    tokens = b * s * shape.top_k
    out = [Flow("expert", "all-to-all", (X - 1) / X * tokens * shape.d_model * e * runs * shape.moe_layers * m,
                runs * shape.moe_layers * m, False)]
    if F == 1:
        shared = psi - psi_x / X
        out.append(Flow("data+expert", "all-reduce", 2 * (D * X - 1) / (D * X) * e * shared / T * m,
                        m * (WEIGHTS_PER_LAYER + OTHER_WEIGHTS), False))
        if D > 1:
            out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * e * psi_x / X / T * m, m * 3, False))
    return out


def _pipeline_flows(shape, cand, b, s, e, psi_layers, psi_other, cpu) -> list[Flow]:
    """The pipeline trainers (parallel/pipeline.py on the pipeline branch): see the module docstring."""
    D, F, T, P, m, v = cand.data, cand.fsdp, cand.tensor, cand.pipe, cand.microbatches, cand.virtual
    h, L = shape.d_model, shape.layers
    a = b * s * h * e
    ticks = 2 * (v * m + P - 1) if cand.schedule != "zb-h1" else 3 * m + 2 * (P - 1)
    out = [Flow("pipe", "permute", 2 * ticks * a, 2 * ticks, False),
           Flow("pipe", "all-reduce", 2 * (P - 1) / P * 4 * psi_other / T, OTHER_WEIGHTS, False)]
    stage = (psi_layers / P + psi_other) / T
    if D > 1:
        out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * 4 * stage, WEIGHTS_PER_LAYER + OTHER_WEIGHTS, False))
    if F > 1:
        out.append(Flow("fsdp", "all-gather", (F - 1) / F * 4 * stage, WEIGHTS_PER_LAYER + OTHER_WEIGHTS, False))
        out.append(Flow("fsdp", "reduce-scatter", (F - 1) / F * 4 * stage, WEIGHTS_PER_LAYER + OTHER_WEIGHTS, False))
    if T > 1:
        per_layer = (7 if cpu else 4) + (1 if cand.remat == "full" else 0)
        count = (per_layer * L // P + 2) * m
        out.append(Flow("tensor", "all-reduce", count * 2 * (T - 1) / T * a, count, False))
    return out


def bytes_by_axis(flow_list: list[Flow]) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in flow_list:
        out[f.axis] = out.get(f.axis, 0.0) + f.bytes
    return out

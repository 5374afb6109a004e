"""Per-device memory of one training step: model state, gradients, activations, working buffers.

  state        fp32 params 4Ψ_d and AdamW μ, ν 8Ψ_d, Ψ_d = the parameters this device stores, as its
               strategy predicts (`Prediction.stored`: e.g. ZeRO stage s over `data` splits the optimizer
               (s >= 1), gradients (s >= 2) and params (s = 3)).
  gradients    fp32, sharded like the params (4Ψ_d); a second fp32 buffer when microbatches
               accumulate (`ACCUMULATOR`).
  activations  per microbatch of b sequences per device, s tokens, h = d_model, e = activation bytes:
               remat full: every layer's input, L·b·s·h·e (the scan carry);
               remat dots: + the saved matmul outputs q, k, v, gate, up: L·b·s·(a·d_h + 2·kv·d_h + 2F)·e/T;
               remat none: + everything else autodiff keeps per layer, `NONE_SCORE_BYTES` per S x S element
               (fp32 scores and probabilities and the bf16 copy) + `NONE_TOKEN_BYTES` per token x h.
               float8 (remat none or dots): + what fp8.py's matmul keeps, `fp8_residuals`.
               Pipelines keep the stage's L/p layers for every microbatch in flight (GPipe m, 1F1B and
               ZB-H1 p, interleaved v·p + p - 1 chunks of L/(v·p) layers), + `PIPELINE_EXTRA_SLOTS`
               (the executor's scan carries its buffers); ZB-H1 also keeps each matmul's (x, dy) taps
               for those microbatches (`tap_elements`). A pipeline stage's weights are all-gathered
               (fp32, fsdp > 1) and cast once per step and its gradient is whole until the step's
               reduce-scatter (parallel/pipeline.py): 4 + 2 + 4 bytes per stage parameter.
  working set  the largest transient: one layer's backward (recomputed forward + gradients):
               `SCORE_BYTES` per S x S element of the einsum attention, or a flash kernel's fp32
               log-sum-exp per query and head, + `WORKING_TOKEN_BYTES` per token x h; or the head's
               logits and their gradient, `LOGIT_BYTES` per token x vocab / T, whichever is larger;
               + `LAYER_WEIGHT_BYTES` per parameter of one layer (gathered copies, its fp32 gradient)
               + `CONSTANT_BYTES`.

Where the constants come from: a least-squares fit (non-negative) to XLA:GPU's buffer assignment
of 17 deviceless H100 compiles of configs/arabic_7b.py (64 GPUs; fsdp, data x fsdp, fsdp x tensor
with T = 2, 4, 8; microbatches 1-8; remat none, dots, full; bf16 and fp8; seq 2048 and 4096; vocab
32000 and 64000; 16 and 32 layers; recorded in tests/data/h100_7b_compiles.json). Each has a
physical reading (10.7 bytes per score element: fp32 scores + fp32 probabilities + a bf16 copy = 10)
and the model reproduces every one of those compiles' peaks within 5% (lab 07 re-checks the top
candidates live). The pipeline terms and LOGIT_BYTES were set the same way from 17 more compiles
once the pipeline and kernel branches were merged (pipelines with fsdp or data, 1F1B, ZB-H1,
interleaved, GPipe, remat none/dots/full, jaxpar's Pallas flash attention): all 36 within 11%. NOT calibrated: float32 compute (one compile: 1.35x the
prediction; the planner leaves fp32 out of the GPU space) and MoE layers (formulas only).
"""
from __future__ import annotations

import dataclasses

from jaxpar.model.counting import ModelShape
from jaxpar.parallel.registry import predict
from jaxpar.parallel.theory import Candidate, Prediction

SCORE_BYTES = 10.7            # per S x S element, one layer's backward working set (einsum attention)
WORKING_TOKEN_BYTES = 6.9     # per token x d_model, one layer's backward working set (not split by tensor)
NONE_SCORE_BYTES = 9.6        # per S x S element per layer kept without remat
NONE_TOKEN_BYTES = 59.4       # per token x d_model per layer kept without remat
LAYER_WEIGHT_BYTES = 0.37     # per parameter of one layer (/ tensor)
ACCUMULATOR = 1.15            # x 4Ψ_d: the accumulation buffer when microbatches > 1
CONSTANT_BYTES = 0.95e9
LOGIT_BYTES = 4               # per token x vocab / tensor live at the head's peak (fitted on a flash-attention compile)
PIPELINE_EXTRA_SLOTS = 2      # a pipeline's stash and taps hold 2 microbatches more than the schedule keeps alive


@dataclasses.dataclass(frozen=True)
class Memory:
    params: float
    optimizer: float
    gradients: float
    activations: float        # kept across the step (per in-flight microbatch x layers)
    working: float            # the largest transient buffer set
    fits: bool
    limit: float
    stage_weights: float = 0.0   # pipelines: the stage's weights gathered (fp32) and cast for the whole step
    taps: float = 0.0            # ZB-H1: each matmul's (x, dy) kept from B to W
    layout: str = "jaxpar"       # the model-state layout assumed (plan/layouts.py)

    @property
    def state(self) -> float:
        return self.params + self.optimizer

    @property
    def total(self) -> float:
        return (self.params + self.optimizer + self.gradients + self.activations + self.working
                + self.stage_weights + self.taps)

    def parts(self) -> dict[str, float]:
        jaxpar = self.layout == "jaxpar"
        parts = {"params (fp32)" if jaxpar else "params (bf16)": self.params,
                 "AdamW μ, ν (fp32)" if jaxpar else "master params + AdamW μ, ν (fp32, split)": self.optimizer,
                 "gradients (fp32)": self.gradients, "activations kept": self.activations, "working set": self.working}
        if self.stage_weights:
            parts["stage weights, gathered and cast"] = self.stage_weights
        if self.taps:
            parts["ZB-H1 taps (x, dy)"] = self.taps
        return parts


def fp8_residuals(shape: ModelShape, cand: Candidate, b: float, s: int) -> float:
    """Per layer, what jaxpar's fp8 matmul (model/fp8.py) saves for its backward pass unless the layer is
    recomputed: each matmul's input in e4m3 (1 byte per element; the inputs of q/k/v and gate/up are whole
    under tensor parallelism, those of wo and w_down split) and its bf16 weight as fetched, i.e. the
    gathered layer under fsdp."""
    T = cand.tensor
    inner = shape.heads * shape.head_dim + (shape.expert_mlp_dim * shape.top_k if shape.experts else shape.mlp_dim)
    inputs = b * s * (2 * shape.d_model + inner / T)
    c = shape.counts()
    weights = 2 * (c["blocks"] - c["experts"] * (1 - 1 / cand.expert)) / shape.layers / T
    return inputs + weights


def stage_params(shape: ModelShape, cand: Candidate) -> float:
    """Parameters of one pipeline stage on one device, whole over fsdp: its layers and the (replicated)
    embedding and head, split only by tensor (the experts also by expert)."""
    c = shape.counts()
    layers = c["blocks"] - c["experts"] * (1 - 1 / cand.expert)
    return (layers / cand.pipe + c["total"] - c["blocks"]) / cand.tensor


def tap_elements(shape: ModelShape, tensor: int) -> float:
    """Per token and layer, what ZB-H1's split backward keeps for W (parallel/deferred.py): each of the 7 matmuls'
    input x (q, k, v and gate, up each keep their own copy of their common input) and output gradient dy."""
    d, attn = shape.d_model, shape.heads * shape.head_dim
    kv = 2 * shape.kv_heads * shape.head_dim
    mlp = shape.expert_mlp_dim * shape.top_k if shape.experts else shape.mlp_dim
    inputs = 5 * d + (attn + mlp) / tensor
    grads = (attn + kv + 2 * mlp) / tensor + 2 * d
    return inputs + grads


def kept_per_layer(shape: ModelShape, cand: Candidate, global_batch: int, seq_len: int) -> float:
    """Bytes one layer keeps for the backward pass, per microbatch on one device (the module doc's activations)."""
    e = 4 if cand.precision == "float32" else 2
    T, h, s = cand.tensor, shape.d_model, seq_len
    b = global_batch / cand.batch_shards / cand.microbatches
    widths = (shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim
              + 2 * (shape.expert_mlp_dim * shape.top_k if shape.experts else shape.mlp_dim)) / T
    if cand.remat == "none":
        scores = 4 * shape.heads / T * s if cand.attention == "flash" else NONE_SCORE_BYTES * shape.heads / T * s * s
        per_layer = b * (scores + NONE_TOKEN_BYTES * e / 2 * s * h + s * h * e)
    else:
        per_layer = b * s * h * e + (b * s * widths * e if cand.remat == "dots" else 0)
    if cand.precision == "float8" and cand.remat != "full" and cand.pipe == 1:
        per_layer += fp8_residuals(shape, cand, b, s)
    return per_layer


def memory(shape: ModelShape, cand: Candidate, global_batch: int, seq_len: int, hbm_bytes: float,
           headroom: float = 0.1, prediction: Prediction | None = None) -> Memory:
    """Per-device bytes of one step of `cand`; `fits` when the total is within (1 - headroom) of `hbm_bytes`.
    What a device stores is its strategy's `prediction` (default: asked of it)."""
    prediction = prediction or predict(shape, cand, global_batch, seq_len, "gpu")
    stored = prediction.stored
    e = 4 if cand.precision == "float32" else 2
    T, L, h, s = cand.tensor, shape.layers, shape.d_model, seq_len
    b = global_batch / cand.batch_shards / cand.microbatches
    scale = e / 2                                       # the fitted bytes are bf16's
    grads = 4 * stored["grads"] * (1 + (ACCUMULATOR if cand.microbatches > 1 and cand.pipe == 1 else 0))

    heads = shape.heads / T
    flash = cand.attention == "flash"
    per_layer = kept_per_layer(shape, cand, global_batch, seq_len)
    count, layers_each = prediction.stash, 1 / (cand.pipe * cand.virtual)   # stash: the schedule table's
    stage_weights = taps = 0.0
    if cand.pipe > 1:
        count += PIPELINE_EXTRA_SLOTS
        stage = stage_params(shape, cand)
        grads = 4 * stage                                   # the stage's full gradient, reduce-scattered at the end
        stage_weights = (4 if cand.fsdp > 1 else 0) * stage + e * stage
        if cand.schedule == "zb-h1":
            taps = count * L * layers_each * b * s * tap_elements(shape, T) * e
    activations = per_layer * L * layers_each * count

    scores = 4 * b * heads * s if flash else SCORE_BYTES * b * heads * s * s
    layer_work = scores + WORKING_TOKEN_BYTES * scale * b * s * h
    head_work = LOGIT_BYTES * b * s * shape.vocab / T
    layer_params = (shape.counts()["blocks"] - shape.counts()["experts"] * (1 - 1 / cand.expert)) / L / T
    working = max(layer_work, head_work) + LAYER_WEIGHT_BYTES * scale * layer_params + CONSTANT_BYTES
    result = Memory(params=4 * stored["params"], optimizer=8 * stored["optimizer"], gradients=grads,
                    activations=activations, working=working, fits=True, limit=(1 - headroom) * hbm_bytes,
                    stage_weights=stage_weights, taps=taps)
    return dataclasses.replace(result, fits=result.total <= result.limit)

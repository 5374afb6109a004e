"""Per-device memory of one training step as its strategy predicts it: the one memory model of jaxpar.

Model state (fp32 params, AdamW μ, ν, fp32 gradients) of what the device stores (`Prediction.stored`),
activations kept per the candidate's remat (times the pipeline's stash), and the largest transient
(`Memory`). The dry run (`config_memory`), the planner and the labs all call `memory`. Its constants
were fitted to deviceless XLA:GPU compiles (bf16, fp8; tests/data/h100_7b_compiles.json): fp32 and
XLA:CPU are not calibrated. Terms, fit and provenance: experiments/10_capstone/README.md, "How the
model is built".
"""
from __future__ import annotations

import dataclasses

from jaxpar.model.counting import ModelShape
from jaxpar.parallel.expert_memory import expert_buffers, expert_weight_copies, moe_kept_extra, swiglu_kept
from jaxpar.parallel.registry import held_memory, predict, workload
from jaxpar.parallel.theory import Candidate, Prediction

SCORE_BYTES = 10.7            # per S x S element, one layer's backward working set (einsum attention)
WORKING_TOKEN_BYTES = 6.9     # per token x d_model, one layer's backward working set (split by tensor only under SP)
NONE_SCORE_BYTES = 9.6        # per S x S element per layer kept without remat
NONE_TOKEN_BYTES = 27.15      # per token x d_model per layer kept without remat beside the SwiGLU's six buffers, at
                              # tensor 1 (`dense_kept`): the 7B's fitted 59.4 less its 6·F·2 bytes (32.25 of it)
LAYER_WEIGHT_BYTES = 0.37     # per parameter of one layer (/ tensor)
ACCUMULATOR = 1.15            # x 4Ψ_d: the accumulation buffer when microbatches > 1
CONSTANT_BYTES = 0.95e9        # the fit's intercept: XLA:GPU's fixed buffers; an XLA:CPU step allocates none
LOGIT_BYTES = 4               # per token x vocab / tensor live at the head's peak (fitted on a flash-attention compile)


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
    activation_model: str = "jaxpar"   # whose kernels' kept tensors `activations` counts (plan/framework_memory.py)

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
                 "gradients (bf16)" if self.layout.endswith("bf16-grads") else "gradients (fp32)": self.gradients,
                 "activations kept" + ("" if self.activation_model == "jaxpar" else f" ({self.activation_model})"):
                     self.activations,
                 "working set": self.working}
        if self.stage_weights:
            parts["stage weights, gathered and cast"] = self.stage_weights
        if self.taps:
            parts["ZB-H1 taps (x, dy)"] = self.taps
        return parts


@dataclasses.dataclass(frozen=True)
class Held:
    """What a strategy's step holds beside the state it stores and the activations one microbatch slot keeps,
    each strategy's own term (its `held_memory`): the gradients, microbatch slots of activations beyond its
    prediction's stash, and a pipeline's gathered stage weights and ZB-H1 taps. `transient`: a buffer set of its
    own step that is never live with a layer's backward (ZB-H1's W), so the working set takes the larger."""
    gradients: float
    extra_slots: float = 0.0
    stage_weights: float = 0.0
    taps: float = 0.0
    transient: float = 0.0


def accumulated_gradients(shape: ModelShape, cand: Candidate, prediction: Prediction, global_batch: int,
                          seq_len: int) -> Held:
    """Every strategy's but a pipeline's: the fp32 gradient of what the device stores, plus the accumulation
    buffer when the batch runs in several microbatches."""
    return Held(gradients=4 * prediction.stored["grads"] * (1 + (ACCUMULATOR if cand.microbatches > 1 else 0)))


def fp8_residuals(shape: ModelShape, cand: Candidate, b: float, s: float) -> float:
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


def sequence_split(cand: Candidate) -> int:
    """How many ways the token-wide activations (the residual stream, norms, the layer's input kept for the
    backward) are split: tensor under sequence parallelism (Megatron's point: [s/t, b, h] between the
    column- and row-parallel matmuls), else 1 (plain tensor parallelism keeps them whole on every device)."""
    return cand.tensor if cand.sequence else 1


def dense_kept(shape: ModelShape, e: int) -> float:
    """Per token, what a dense layer keeps without remat at tensor 1: `NONE_TOKEN_BYTES` x d_model (fitted on the
    7B's compiles) and the SwiGLU's six buffers of this model's own width (`swiglu_kept`), so a model whose MLP is
    wider or narrower than the 7B's (F/h = 2.69) keeps its own; the 7B's is the fitted 59.4 x d_model."""
    return NONE_TOKEN_BYTES * e / 2 * shape.d_model + swiglu_kept(shape.mlp_dim, e)


def tensor_split_kept(shape: ModelShape, e: int) -> float:
    """Per token, the part of a layer's remat-none keep (`dense_kept`, fitted at tensor 1) as wide as the
    heads or the MLP, which tensor parallelism splits with or without SP: q, k, v and the attention's output, and
    the SwiGLU's six hidden-wide buffers (`swiglu_kept`). The rest, copies of the residual stream (4 fp32 and 1
    bf16 of d_model on the 7B beside the layer input: 18 of the constant's 19.15 left), is split only under SP.
    Counted in XLA:GPU's buffer assignment of the 7B's pipeline stash at tensor 1 and 2 (experiments/10_capstone/
    README.md)."""
    return 2 * (shape.heads + shape.kv_heads) * shape.head_dim * e + swiglu_kept(shape.mlp_dim, e)


def kept_per_layer(shape: ModelShape, cand: Candidate, global_batch: int, seq_len: int,
                   platform: str = "gpu") -> float:
    """Bytes one layer keeps for the backward pass, per microbatch on one device (the activations term of
    experiments/10_capstone/README.md, "How the model is built"), averaged over the layers: an MoE layer
    keeps its own (`moe_kept_extra`, parallel/expert_memory.py) in place of the dense MLP's."""
    e = 4 if cand.precision == "float32" else 2
    T, h, s = cand.tensor, shape.d_model, seq_len / cand.context     # context parallelism: this device's rows
    pairs = seq_len * seq_len / cand.context                        # score elements per head, per device
    b = global_batch / cand.batch_shards / cand.microbatches
    widths = (shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim
              + 2 * (shape.expert_mlp_dim * shape.top_k if shape.experts else shape.mlp_dim)) / T
    token = 1 / sequence_split(cand)            # the token-wide activations a device keeps (sequence parallelism)
    if cand.remat == "none":
        scores = 4 * shape.heads / T * s if cand.attention == "flash" else NONE_SCORE_BYTES * shape.heads / T * pairs
        keep, split = dense_kept(shape, e), tensor_split_kept(shape, e)
        per_layer = b * (scores + s * ((keep - split + h * e) * token + split / T))
        per_layer += moe_kept_extra(shape, cand, b, s, platform) * shape.moe_layers / shape.layers
    else:
        per_layer = b * s * h * e * token + (b * s * widths * e if cand.remat == "dots" else 0)
    if cand.precision == "float8" and cand.remat != "full" and cand.pipe == 1:
        per_layer += fp8_residuals(shape, cand, b, s)
    return per_layer


def memory(shape: ModelShape, cand: Candidate, global_batch: int, seq_len: int, hbm_bytes: float,
           headroom: float = 0.1, prediction: Prediction | None = None, platform: str = "gpu") -> Memory:
    """Per-device bytes of one step of `cand`; `fits` when the total is within (1 - headroom) of `hbm_bytes`.
    What a device stores is its strategy's `prediction` (default: asked of it)."""
    prediction = prediction or predict(shape, cand, global_batch, seq_len, platform)
    stored = prediction.stored
    e = 4 if cand.precision == "float32" else 2
    T, L, h, s = cand.tensor, shape.layers, shape.d_model, seq_len / cand.context
    b = global_batch / cand.batch_shards / cand.microbatches
    scale = e / 2                                       # the fitted bytes are bf16's
    held = held_memory(shape, cand, prediction, global_batch, seq_len)

    heads = shape.heads / T
    flash = cand.attention == "flash"
    per_layer = kept_per_layer(shape, cand, global_batch, seq_len, platform)
    count, layers_each = prediction.stash + held.extra_slots, 1 / (cand.pipe * cand.virtual)  # stash: the table's
    activations = per_layer * L * layers_each * count + expert_weight_copies(shape, cand) * shape.moe_layers / cand.pipe

    scores = 4 * b * heads * s if flash else SCORE_BYTES * b * heads * s * seq_len
    # under sequence parallelism the working set is split too, but for the gathered [b, s, h] input of a matmul
    split = sequence_split(cand)
    tokens_work = WORKING_TOKEN_BYTES * scale / split + (e if split > 1 else 0)
    layer_work = scores + tokens_work * b * s * h + expert_buffers(shape, cand, b, s, platform)
    head_work = LOGIT_BYTES * b * s * shape.vocab / T
    layer_params = (shape.counts()["blocks"] - shape.counts()["experts"] * (1 - 1 / cand.expert)) / L / T
    working = max(layer_work, head_work, held.transient) + LAYER_WEIGHT_BYTES * scale * layer_params
    working += CONSTANT_BYTES if platform == "gpu" else 0.0
    result = Memory(params=4 * stored["params"], optimizer=8 * stored["optimizer"], gradients=held.gradients,
                    activations=activations, working=working, fits=True, limit=(1 - headroom) * hbm_bytes,
                    stage_weights=held.stage_weights, taps=held.taps)
    return dataclasses.replace(result, fits=result.total <= result.limit)


def config_memory(config, model_cfg, sizes: dict[str, int], platform: str, hbm_bytes: float | None = None,
                  headroom: float = 0.1) -> Memory:
    """`memory` of the candidate `config` runs on a mesh of `sizes` (the dry run's prediction); `hbm_bytes`
    None: no device limit (virtual CPU devices), `fits` is then always true."""
    shape, cand, global_batch, seq_len, platform = workload(config, model_cfg, sizes, platform)
    prediction = predict(shape, cand, global_batch, seq_len, platform)
    return memory(shape, cand, global_batch, seq_len, float("inf") if hbm_bytes is None else hbm_bytes,
                  headroom, prediction, platform)

"""What a pipeline stage holds beside its stored state: the pipeline strategies' own memory term (`held_memory`
of parallel/pipeline.py's and parallel/circular.py's strategies, read by parallel/memory.py's `memory`).

A stage keeps its whole gradient until the reduce-scatter at the end of the step, its weights gathered (fp32,
under fsdp) and cast for the whole step, activations for the schedule's stash plus PIPELINE_EXTRA_SLOTS (the
executor's scan carries its buffers), and under ZB-H1 each matmul's (x, dy) from B to W (`split_backward`).
Terms and fit: experiments/10_capstone/README.md, "How the model is built".
"""
from __future__ import annotations

from jaxpar.model.counting import ModelShape, block_params
from jaxpar.parallel.memory import Held
from jaxpar.parallel.pipeline_predict import owned_params
from jaxpar.parallel.pipeline_program import program_for
from jaxpar.parallel.theory import Candidate, Prediction, rows_per_microbatch

PIPELINE_EXTRA_SLOTS = 2      # a pipeline's stash holds 2 microbatches more than the schedule keeps alive
SPLIT_EXTRA_SLOTS = 1         # ZB-H1 (peak in W or B, not F): 1 more slot of each stash, the copy B or W reads


def stage_params(shape: ModelShape, cand: Candidate) -> float:
    """Parameters of one pipeline stage on one device, whole over fsdp: its layers and what it owns beside them
    (`owned_params`: its slot of the embedding and head, ...), split only by tensor (the experts also by expert)."""
    c = shape.counts()
    dense = shape.dense_layers * block_params(shape.model) if shape.moe else 0
    layers = c["blocks"] - dense - c["experts"] * (1 - 1 / cand.expert)
    return (layers / cand.pipe + owned_params(shape, cand)) / cand.tensor


def tap_elements(shape: ModelShape, tensor: int) -> float:
    """Per token and layer, what ZB-H1's split backward keeps for W (parallel/deferred.py): each of the 7 matmuls'
    input x and output gradient dy, in the compute dtype. Each tap is its own buffer of the executor's W stash (the
    scan carries 14 per layer): q, k, v keep three copies of their common input, gate and up two (compiled
    H100 HLO, the 7B: XLA merges none of them)."""
    d, attn = shape.d_model, shape.heads * shape.head_dim
    kv = 2 * shape.kv_heads * shape.head_dim
    mlp = shape.expert_mlp_dim * shape.top_k if shape.experts else shape.mlp_dim
    inputs = 5 * d + (attn + mlp) / tensor
    grads = (attn + kv + 2 * mlp) / tensor + 2 * d
    return inputs + grads


def split_backward(shape: ModelShape, cand: Candidate, global_batch: int, seq_len: int) -> tuple[float, float]:
    """ZB-H1's own bytes: (taps, W's transient). Taps: the W stash, the table's `wstash` slots (p: a microbatch's
    taps wait from its B to its W) + the one slot the tick's W reads, each one chunk's `tap_elements` per token.
    W's transient: the new fp32 accumulator of the chunk's weight gradients it writes (4 bytes per layer
    parameter; the old one is the carry's, in `gradients`), live in W only; B's recomputed layer is live in B
    only, so `memory` takes the larger of the two (and of the head's logits). Counted from the buffer
    assignments of deviceless H100 compiles of the 7B (peaks in W, or in B's recomputation under einsum attention
    with remat full)."""
    e = 4 if cand.precision == "float32" else 2
    wstash = program_for(cand.schedule, cand.pipe, cand.microbatches, cand.virtual).slots["wstash"]
    layers = shape.layers / (cand.pipe * cand.virtual)
    slot = layers * rows_per_microbatch(cand, global_batch) * seq_len * tap_elements(shape, cand.tensor) * e
    chunk = (stage_params(shape, cand) - owned_params(shape, cand) / cand.tensor) / cand.virtual
    return (wstash + SPLIT_EXTRA_SLOTS) * slot, 4 * chunk


def stage_memory(shape: ModelShape, cand: Candidate, prediction: Prediction, global_batch: int,
                 seq_len: int) -> Held:
    """A pipeline stage's gradients, extra activation slots, gathered weights and ZB-H1 taps, per device.
    ZB-H1's peak is in W or in B, where the chunk's fp32 gathered weights are dead (only its cast copy and the
    fp32 of what it owns, the embedding's slot, are live): W's fp32 gradient sum takes their place."""
    e = 4 if cand.precision == "float32" else 2
    stage = stage_params(shape, cand)
    fp32 = 4 if cand.fsdp > 1 else 0
    if cand.schedule != "zb-h1":
        return Held(gradients=4 * stage,               # the stage's full gradient, reduce-scattered at the end
                    extra_slots=PIPELINE_EXTRA_SLOTS, stage_weights=fp32 * stage + e * stage)
    taps, transient = split_backward(shape, cand, global_batch, seq_len)
    return Held(gradients=4 * stage, extra_slots=SPLIT_EXTRA_SLOTS,
                stage_weights=fp32 * owned_params(shape, cand) / cand.tensor + e * stage, taps=taps,
                transient=transient)

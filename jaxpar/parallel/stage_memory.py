"""What a pipeline stage holds beside its stored state: the pipeline strategies' own memory term (`held_memory`
of parallel/pipeline.py's and parallel/circular.py's strategies, read by parallel/memory.py's `memory`).

A stage keeps its whole gradient until the reduce-scatter at the end of the step, its weights gathered (fp32,
under fsdp) and cast for the whole step, activations for the schedule's stash plus PIPELINE_EXTRA_SLOTS (the
executor's scan carries its buffers), and under ZB-H1 each matmul's (x, dy) from B to W. Terms and fit:
experiments/10_capstone/README.md, "How the model is built".
"""
from __future__ import annotations

from jaxpar.model.counting import ModelShape, block_params
from jaxpar.parallel.memory import Held
from jaxpar.parallel.pipeline_predict import owned_params
from jaxpar.parallel.theory import Candidate, Prediction, rows_per_microbatch

PIPELINE_EXTRA_SLOTS = 2      # a pipeline's stash and taps hold 2 microbatches more than the schedule keeps alive


def stage_params(shape: ModelShape, cand: Candidate) -> float:
    """Parameters of one pipeline stage on one device, whole over fsdp: its layers and what it owns beside them
    (`owned_params`: its slot of the embedding and head, ...), split only by tensor (the experts also by expert)."""
    c = shape.counts()
    dense = shape.dense_layers * block_params(shape.model) if shape.moe else 0
    layers = c["blocks"] - dense - c["experts"] * (1 - 1 / cand.expert)
    return (layers / cand.pipe + owned_params(shape, cand)) / cand.tensor


def tap_elements(shape: ModelShape, tensor: int) -> float:
    """Per token and layer, what ZB-H1's split backward keeps for W (parallel/deferred.py): each of the 7 matmuls'
    input x (q, k, v and gate, up each keep their own copy of their common input) and output gradient dy."""
    d, attn = shape.d_model, shape.heads * shape.head_dim
    kv = 2 * shape.kv_heads * shape.head_dim
    mlp = shape.expert_mlp_dim * shape.top_k if shape.experts else shape.mlp_dim
    inputs = 5 * d + (attn + mlp) / tensor
    grads = (attn + kv + 2 * mlp) / tensor + 2 * d
    return inputs + grads


def stage_memory(shape: ModelShape, cand: Candidate, prediction: Prediction, global_batch: int,
                 seq_len: int) -> Held:
    """A pipeline stage's gradients, extra activation slots, gathered weights and ZB-H1 taps, per device."""
    e = 4 if cand.precision == "float32" else 2
    stage = stage_params(shape, cand)
    taps = 0.0
    if cand.schedule == "zb-h1":
        slots, layers_each = prediction.stash + PIPELINE_EXTRA_SLOTS, 1 / (cand.pipe * cand.virtual)
        b = rows_per_microbatch(cand, global_batch)
        taps = slots * shape.layers * layers_each * b * seq_len * tap_elements(shape, cand.tensor) * e
    return Held(gradients=4 * stage,                   # the stage's full gradient, reduce-scattered at the end
                extra_slots=PIPELINE_EXTRA_SLOTS, stage_weights=(4 if cand.fsdp > 1 else 0) * stage + e * stage,
                taps=taps)

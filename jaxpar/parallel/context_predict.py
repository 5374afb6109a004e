"""What context parallelism sends per step and device (the builder: parallel/context.py).

The compiler-driven part (data, fsdp, tensor) is `parallel.auto.predict`, for the rows a device holds. On the
`context` axis (c devices; b rows of S tokens per device and microbatch, e bytes per element, L layers, m
microbatches; heads H, KV and head size Dh, split over tensor T):

ring        per layer and pass, c - 1 hops of the device's key/value block, 2·b·(S/c)·(KV/T)·Dh·e each:
            (c-1)/c of the layer's K and V. Passes: the forward, its recomputation under remat (any policy but
            none: the hop is no matmul a policy keeps), and the backward, whose transposed hops carry the
            key/value gradients back round the ring.
all_to_all  per layer and pass, four exchanges (q, k, v in; the output back), (c-1)/c of each local array:
            (c-1)/c·b·(S/c)·Dh·e·(2H + 2KV)/T; the same passes as the ring.
embedding   an untied embedding split over fsdp alone is looked up, not gathered (`auto.embed_lookup_gathers`).
            Its backward then costs the context axis the cheaper of two ways, as XLA chooses (seen at S = 1024
            and 8192): gather the activations' gradient over context twice, (c-1)/c·e·2·b·S·h, or all-reduce
            the whole table's gradient instead of its fsdp share, 2(c-1)/c·e·V·h·(1 - 1/F) more; per microbatch.
gradients   the parameters are whole on every device of a context group, which computed their gradients
            from its own rows: an all-reduce over context, 2(c-1)/c of each gradient as the device holds it
            (split over fsdp x tensor; the norms whole; the embedding, gathered over fsdp for the lookup,
            split only over tensor), once per microbatch, as data parallelism's.
"""
from __future__ import annotations

import dataclasses

from jaxpar.parallel import auto
from jaxpar.parallel.theory import (
    OTHER_WEIGHTS,
    WEIGHTS_PER_LAYER,
    Candidate,
    Flow,
    Prediction,
    rows_per_microbatch,
    wire_bytes,
)


def looked_up(shape, cand: Candidate) -> bool:
    """Whether the embedding is looked up from its fsdp-split table (not gathered first): auto.predict's rule."""
    return cand.fsdp > 1 and shape.counts()["lm_head"] > 0 and cand.tensor == 1 and cand.data == 1 and \
        cand.expert == 1


def held_gradient(shape, cand: Candidate) -> float:
    """Gradient elements a device holds when it reduces them over context (module docstring, `gradients`)."""
    counts, F, T, h = shape.counts(), cand.fsdp, cand.tensor, shape.d_model
    norms = (2 * shape.layers + 1) * h
    embedding = counts["embedding"] / (F if looked_up(shape, cand) else T)
    return (counts["blocks"] + counts["lm_head"] + counts["final_norm"] - norms) / (F * T) + norms + embedding


def context_flows(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> list[Flow]:
    """The `context` axis's flows (module docstring)."""
    C, T, m, L = cand.context, cand.tensor, cand.microbatches, shape.layers
    e = wire_bytes(cand.precision, platform)
    b, s, dh = rows_per_microbatch(cand, global_batch), seq_len / C, shape.head_dim
    passes = (2 if cand.remat != "none" else 1) + 1
    if cand.context_impl == "ring":
        exchange = Flow("context", "permute", passes * L * m * (C - 1) * 2 * b * s * shape.kv_heads / T * dh * e,
                        passes * L * m * (C - 1), False)
    else:
        widths = 2 * (shape.heads + shape.kv_heads) / T
        exchange = Flow("context", "all-to-all", passes * L * m * (C - 1) / C * b * s * dh * e * widths,
                        passes * L * m * 4, False)
    grad_e = 4 if cand.precision == "float8" and platform != "cpu" else e
    gradients = Flow("context", "all-reduce", 2 * (C - 1) / C * grad_e * held_gradient(shape, cand) * m,
                     m * (WEIGHTS_PER_LAYER + OTHER_WEIGHTS), False)
    if not looked_up(shape, cand):
        return [exchange, gradients]
    gather = (C - 1) / C * e * 2 * b * seq_len * shape.d_model * m
    table = 2 * (C - 1) / C * grad_e * shape.counts()["embedding"] * (1 - 1 / cand.fsdp) * m
    if gather <= table:
        return [exchange, gradients, Flow("context", "all-gather", gather, 2 * m, False)]
    return [exchange, dataclasses.replace(gradients, bytes=gradients.bytes + table)]


def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """One step of context parallelism: `auto.predict` for the other axes, with each device's S/c rows of
    activations (the tensor all-reduces move b·(S/c)·h), plus `context_flows`."""
    rows = auto.predict(shape, dataclasses.replace(cand, context=1), global_batch, seq_len // cand.context,
                        platform)
    flows = rows.flows + (context_flows(shape, cand, global_batch, seq_len, platform) if cand.context > 1 else [])
    return dataclasses.replace(rows, flows=flows)

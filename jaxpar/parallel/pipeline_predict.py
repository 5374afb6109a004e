"""What the hand-written pipelines (parallel/pipeline.py) send per mesh axis per step, from the schedule's own table.

Split out of pipeline.py, which builds the strategy: this is the dry run's and the planner's view of it, checked
against the compiled program (tests/test_pipeline.py, tests/test_pipeline_moe.py).
"""
from __future__ import annotations

import math

import numpy as np

from jaxpar.model.counting import block_params, moe_block_params
from jaxpar.parallel.pipeline_program import most_sends_for, program_for, ticks_for
from jaxpar.parallel.schedules import bubble_fraction, placement
from jaxpar.parallel.theory import (
    OTHER_WEIGHTS,
    WEIGHTS_PER_LAYER,
    Candidate,
    Flow,
    Prediction,
    moe_all_to_all_bytes,
    wire_bytes,
)


def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """Bytes per device per step on the busiest stage, from the schedule's own table (T ticks).

    b = microbatch rows per batch shard (data x fsdp, x expert for MoE), a = b·s·h·e one microbatch's activation
    (e = `wire_bytes`); r = train.microbatches, the whole pipeline run r times per step. Ψ_P = the pipelined stack
    (`moe_blocks` for MoE), Ψ_x its routed experts, Ψ_o what a stage owns beside its layers (`owned_params`: one
    V·h slot of the embedding and head, the final norm, an MoE model's dense stack; parallel/stage_owned.py).
      pipe      n·a·r, n = the most activations and gradients one stage sends in the table (`sends_per_stage`:
                2m on a middle stage of one chunk each, m on the first and the last): a tick sends only over the
                pairs that have something to send, a bubble nothing. Under sequence parallelism a is divided by
                the tensor size (the stages pass [b, s/t, h]).
      tensor    Megatron inside every stage: `tensor_bytes`.
      gradients fp32, once per step, every gradient averaged over the batch shards: all-reduced over data
                (and, but for the routed experts, over expert), reduce-scattered over fsdp after the weights'
                all-gather ((F-1)/F·4 for Ψ_o, (F-1)/F·e for the chunks: XLA casts before it gathers). Per device
                Ψ_o/T, (Ψ_P - Ψ_x)/(p·T), Ψ_x/(p·X·T). Nothing over pipe but a tied embedding's gradient: the
                first and the last stage each send theirs to the other, 4·V·h/(F·T). XLA:GPU folds consecutive
                all-reduces into one over the union of their axes (`data+expert`); XLA:CPU keeps one each.
      expert    MoE: the all_to_alls of the stage's MoE layers (`moe_all_to_all_bytes`, L/p layers, m·r
                microbatches; with tensor > 1 every tensor rank exchanges the whole tokens).
      re-deal   v > 1 (interleaved, DualPipeV): the stored stack's layout against the staged one, `redeal`.
    """
    p, D, F, T = cand.pipe, cand.data, cand.fsdp, cand.tensor
    X = cand.expert if shape.moe else 1
    m, v, r = cand.microbatches, cand.virtual, cand.accumulate
    e = wire_bytes(cand.precision, platform)
    a = global_batch // (D * F * X) // (m * r) * seq_len * shape.d_model * e
    counts = shape.counts()
    psi_pipelined = counts["blocks"] - (shape.dense_layers * block_params(shape.model) if shape.moe else 0)
    psi_other, psi_x = owned_params(shape, cand), counts["experts"]
    program = program_for(cand.schedule, p, m, v)
    sent = a / T if cand.sequence else a
    sends = most_sends_for(cand.schedule, p, m, v)
    out = [Flow("pipe", "permute", sends * sent * r, sends * r, False)]
    sizes = {"data": D, "pipe": p, "expert": X}

    def all_reduce(axes, nbytes, arrays, gathered=4):
        live = [x for x in ("data", "pipe", "expert") if x in axes and sizes[x] > 1]
        for group in ([live] if platform != "cpu" and live else [[x] for x in live]):
            n = math.prod(sizes[x] for x in group)
            out.append(Flow("+".join(group), "all-reduce", 2 * (n - 1) / n * nbytes, arrays, False))
        if F > 1:    # the weights' all-gather (`gathered` bytes per fp32 element) and the gradients' reduce-scatter
            out.append(Flow("fsdp", "all-gather", (F - 1) / F * gathered / 4 * nbytes, arrays, False))
            out.append(Flow("fsdp", "reduce-scatter", (F - 1) / F * nbytes, arrays, False))

    all_reduce(("data", "expert"), 4 * psi_other / T, OTHER_WEIGHTS - (1 if head_in_embed(shape, cand) else 0))
    if shape.tie_embeddings and cand.schedule != "dualpipev":     # the tied gradient, between first and last
        out.append(Flow("pipe", "permute", 4 * counts["embedding"] / (F * T), 1, False))
    all_reduce(("data", "expert"), 4 * (psi_pipelined - psi_x) / (p * T), WEIGHTS_PER_LAYER, gathered=e)
    all_reduce(("data",), 4 * psi_x / (p * X * T), 3, gathered=e)
    if T > 1:
        out.append(tensor_bytes(shape, cand, a, a // (shape.d_model * e)))
    out.extend(redeal(shape, cand, psi_pipelined, psi_x))
    if X > 1:
        exchange = moe_all_to_all_bytes(shape, cand, global_batch, seq_len, platform, microbatches=m * r,
                                        layers=shape.moe_layers // p)
        out.append(Flow("expert", "all-to-all", exchange["predicted"], exchange["runs"], False))
    each = ((psi_pipelined - psi_x + psi_x / X) / p + psi_other) / (F * T)
    return Prediction(out, dict.fromkeys(("params", "grads", "optimizer"), each),
                      bubble=bubble_fraction(cand.schedule, p, m, v), stash=program.slots["stash"])


def head_in_embed(shape, cand: Candidate) -> bool:
    """The head stored in the embedding's array, in the last stage's slot: tied, or on another device than the
    embedding (every schedule but DualPipeV's V, whose first and last model stages share device 0)."""
    return bool(shape.tie_embeddings) or cand.schedule != "dualpipev"


def owned_params(shape, cand: Candidate) -> float:
    """Parameters a device stores beside its pipelined layers (parallel/stage_owned.py): one V·h slot (two under
    DualPipeV untied), the final norm, an MoE model's dense stack. The compiler-driven circular pipeline keeps
    them whole on every stage."""
    c = shape.counts()
    dense = shape.dense_layers * block_params(shape.model) if shape.moe else 0
    if cand.schedule == "circular":
        return c["total"] - c["blocks"] + dense
    vocab = c["embedding"] + (0 if head_in_embed(shape, cand) else c["lm_head"])
    return vocab + c["final_norm"] + dense


def tensor_bytes(shape, cand: Candidate, a: float, tokens: int) -> Flow:
    """Megatron's collectives over `tensor` on the busiest stage, in u = (T-1)/T·a (an all-reduce of a is 2u; an
    all-gather or reduce-scatter of it, u); a: one microbatch's activation, `tokens` = b·s; r = train.microbatches
    runs of the pipeline per step.

      per layer per F   TP 2 all-reduces (g after attention and after the MLP) = 4u; an MoE layer also g after
                        its shared experts (+2u). SP: 2 all-gathers + 2 reduce-scatters, the same 4u.
      per layer per B   TP 4u (f before q/k/v and the MLP; an MoE layer +2u for its shared experts, plus its
                        gates' gradient, fp32 [b, s, k], summed with the experts' f), +2u with remat full (the
                        attention g again). SP 6u (the column inputs gathered again, Megatron-LM's choice), an
                        MoE layer 5u (its experts keep their gathered tokens), 7u with remat full or dots;
                        its shared experts +1u per F (their g), per B +2u (+1u with remat). Measured with remat
                        none, full, dots. zb-h1's W has none.
      SP MoE layer      F: its gates' and expert ids' all-gathers (fp32, int32 [b, s, k]) and its router
                        statistics' all-reduce (3 vectors of E, 2 scalars); B: the gates' reduce-scatter, with
                        remat (any policy but none) the gates, ids and one E vector again.
      first stage       F: the embedding's g (TP 2u, SP its reduce-scatter u), an MoE model's dense stack 4u per
                        layer; B: SP the embedding's all-gather u; the dense stack recomputed and differentiated,
                        2u + 8u per layer (TP and SP).
      last stage        the head's f: 2u per F. Its three fp32 [b, s] reductions are left out (h times smaller).
      once per step     SP: the replicated weights' gradients summed, 2(T-1)/T·4 per element: the norms (2 per
                        layer of the stage and of an MoE model's dense stack, the final one), the routers.
    """
    T, r, ticks = cand.tensor, cand.accumulate, ticks_for(cand.schedule, cand.pipe, cand.microbatches, cand.virtual)
    moe = shape.moe is not None
    layers = shape.moe_layers if moe else shape.layers
    chunk = layers // (cand.pipe * cand.virtual)
    shared = 2 if moe and shape.shared_experts else 0
    dense = shape.dense_layers if moe else 0
    ring = (T - 1) / T
    gates = ring * 4 * tokens * shape.top_k if moe else 0          # one [b, s, k] array gathered or scattered
    if cand.sequence:
        per_f, per_b = 4 + shared // 2, 6 + (1 if cand.remat == "full" else 0)
        if moe:
            per_b = 7 + shared // 2 if cand.remat in ("full", "dots") else 5 + shared
        embed, embed_grad = 1 + 4 * dense, (2 + 8 * dense if dense else 1)
        stats = 2 * ring * 4 * (3 * shape.moe.experts + 2) if moe else 0
        again = cand.remat != "none"        # the backward's recomputed router: gates, ids, one E vector again
        moe_f, moe_b = 2 * gates + stats, gates + (2 * gates + 2 * ring * 4 * shape.moe.experts if again and moe else 0)
        arrays = (3, 4 if again else 1)
    else:
        per_f, per_b = 4 + shared, 4 + shared + (2 if cand.remat == "full" else 0)
        embed, embed_grad = 2 + 4 * dense, (2 + 8 * dense if dense else 0)
        moe_f, moe_b, arrays = 0, 2 * gates, (0, 1)
    units = (per_f * ticks["F"] + per_b * ticks["B"]) * chunk + embed * ticks["embed"] + \
        embed_grad * ticks["embed_grad"] + 2 * ticks["head"]
    extra = (moe_f * ticks["F"] + moe_b * ticks["B"]) * chunk
    per_stage = (units * ring * a + extra) * r
    count = (units // 2 + ((arrays[0] * ticks["F"] + arrays[1] * ticks["B"]) * chunk if moe else 0)) * r
    h = shape.d_model
    replicated = (2 * layers // cand.pipe + 1) * h
    if moe:
        replicated += layers // cand.pipe * moe_block_params(shape.model)["router"] + 2 * dense * h
    once = 2 * ring * 4 * replicated if cand.sequence else 0
    busiest = int(np.argmax(per_stage))
    return Flow("tensor", "reduce-scatter" if cand.sequence else "all-reduce", float(per_stage[busiest]) + once,
                float(count[busiest]) + (3 if cand.sequence else 0), False)


def stack_bytes(shape, cand: Candidate, psi_pipelined: float, psi_x: float) -> float:
    """fp32 bytes of the pipelined stack one device stores: 4·(Ψ_P - Ψ_x - R)/(F·T·p) + 4·Ψ_x/(X·F·T·p) + 4·R/p,
    R = the norms and routers (replicated over fsdp and tensor)."""
    X, split = (cand.expert if shape.moe else 1), cand.fsdp * cand.tensor
    layers = shape.moe_layers if shape.moe else shape.layers
    replicated = layers * (2 * shape.d_model + (moe_block_params(shape.model)["router"] if shape.moe else 0))
    return 4 * ((psi_pipelined - psi_x - replicated) / split + psi_x / (X * split) + replicated) / cand.pipe


def redeal(shape, cand: Candidate, psi_pipelined: float, psi_x: float) -> list[Flow]:
    """v > 1: the stack is stored [L], each stage's layers contiguous, but runs [v, p, Lc] (model stage c·p + s on
    device s; the V's chunk 1 reversed), so every step XLA re-deals the params in and the gradients out (fp32,
    outside the tick loop). B = the device's stored block (`stack_bytes`). At p = 2 its groups are the pipe axis:
      interleaved   all_to_alls: (p-1)/p·B in and again out, what has to move.
      DualPipeV     XLA partitions the V's reversed slices with a permute of the whole block beside the
                    all_to_all: in B + B/2, out B + 2·B/2 (3.5 B where B would do: the executor's layout, not the
                    schedule, costs it; Megatron stores each virtual stage where it runs).
    At p > 2 XLA exchanges chunks between pairs of stages, collective-permutes over `pipe`: interleaved, each
    device sends the chunks of its block that run on another stage, in and again out, 2·n·B/v with n the most
    such chunks of one device's block (measured at p=4, v=2, beside a small exchange over groups no axis spans);
    DualPipeV's V at p > 2 moves more than that (measured at p=4): not predicted."""
    p, v = cand.pipe, cand.virtual
    if v == 1:
        return []
    block = stack_bytes(shape, cand, psi_pipelined, psi_x)
    ring, arrays = (p - 1) / p, WEIGHTS_PER_LAYER + (2 if shape.moe else 0)    # an MoE layer: + router, its bias
    if p > 2:
        if cand.schedule == "dualpipev":
            return []
        moved = max(sum(placement(k, p)[0] != s for k in range(s * v, (s + 1) * v)) for s in range(p))
        return [Flow("pipe", "permute", 2 * moved * block / v, 2 * arrays, False)]
    if cand.schedule == "dualpipev":
        return [Flow("pipe", "permute", 2 * block, 2 * arrays, False),
                Flow("pipe", "all-to-all", 3 * ring * block, 3 * arrays, False)]
    return [Flow("pipe", "all-to-all", 2 * ring * block, 2 * arrays, False)]

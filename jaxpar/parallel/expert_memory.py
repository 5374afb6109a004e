"""What an MoE layer holds on a device, per microbatch: its routed experts' buffers while they run
(`expert_buffers`, part of the working set) and what it keeps for the backward pass (`moe_kept_extra`, and
once per layer `expert_weight_copies`, part of the activations). They are sized by the rows the device's
experts receive (`expert_rows`): the exchange in use (parallel/expert_sizes.py), the capacity dispatch's
slots, or on one expert device every assignment. The counts are read off XLA:GPU's buffer assignment.
parallel/memory.py's `memory` adds them; the terms and how XLA's compiles check them:
experiments/07_moe/README.md, "What an MoE layer keeps".
"""
from __future__ import annotations

from jaxpar.model.counting import ModelShape
from jaxpar.parallel.expert_sizes import received_rows, resolve
from jaxpar.parallel.theory import Candidate


def expert_rows(shape: ModelShape, cand: Candidate, tokens: int, platform: str) -> float:
    """Rows one MoE layer's routed experts compute on a device for `tokens` tokens: the capacity dispatch's
    slots, capacity_factor·T·k; dropless on one expert device its T·k assignments; over `expert` what
    parallel.expert_exchange receives (ragged and capacity about 1.25·T·k, padded X·T·min(k, E/X))."""
    moe = shape.moe
    assert moe is not None, "only an MoE model has routed experts"
    if moe.dispatch == "capacity":
        return moe.capacity_factor * tokens * moe.top_k
    if cand.expert == 1:
        return tokens * moe.top_k
    return received_rows(resolve(cand.expert_exchange, platform), tokens, moe.top_k, moe.experts, cand.expert)


def expert_buffers(shape: ModelShape, cand: Candidate, b: float, s: float, platform: str) -> float:
    """Bytes one MoE layer's routed experts hold on a device while they run (the forward, or the backward's
    recomputation): each received row's input and output [d_model] and its gate, up and hidden
    [expert_mlp_dim / tensor]. T = b·s tokens. Over `expert` the compiled program holds room for the padded
    overflow round (X·T·min(k, E/X) rows) whichever round runs: XLA's buffers for both branches of the cond."""
    moe = shape.moe
    if moe is None:
        return 0.0
    e = 4 if cand.precision == "float32" else 2
    rows = expert_rows(shape, cand, int(b * s), platform)
    if moe.dispatch == "dropless" and cand.expert > 1:
        rows = max(rows, received_rows("padded", int(b * s), moe.top_k, moe.experts, cand.expert))
    return rows * (2 * shape.d_model + 3 * shape.expert_mlp_dim / cand.tensor) * e


SWIGLU_SAVED = 6      # [rows, hidden] buffers autodiff keeps per plain SwiGLU (the dense MLP, shared experts): gate,
                      # up and the intermediates of silu(gate)·up (six stacked bf16[L, R, F] in Mixtral's deviceless
                      # H100 compile before the routed experts recomputed them)
EXPERT_SWIGLU_SAVED = 3   # the routed experts': gate, up and silu(gate)·up (down's input); model/moe.py's
                          # `expert_gating` recomputes the rest (-0.82 GiB per Mixtral layer compiled, lab 07)
WEIGHT_COPIES = 1     # bf16 copies of each expert weight a layer keeps for the backward outside a pipeline (Mixtral,
                      # 2 and 4 layers, deviceless H100: a layer's temp fell 2.96 -> 2.63 GiB, one copy of 0.33 GiB,
                      # when the overflow cond stopped keeping one, `with_overflow_round`; where the other comes
                      # from is not traced)


def swiglu_kept(width: float, e: int, saved: int = SWIGLU_SAVED) -> float:
    """Per token (row), what a SwiGLU MLP of hidden `width` on this device keeps for its backward beyond its input."""
    return saved * width * e


def moe_kept_extra(shape: ModelShape, cand: Candidate, b: float, s: float, platform: str) -> float:
    """Bytes one MoE layer keeps for the backward pass (remat none) beyond what a dense layer of this model
    keeps (parallel/memory.py's fitted per-token constant, whose MLP is a SwiGLU of model.mlp_dim): the dense
    MLP's hidden states out, the MoE layer's in. Those are, for T = b·s tokens and R = `expert_rows`:
    the router's fp32 logits and probabilities [T, E] and gates [T, k]; each received row's input [R, d_model]
    (the experts' weight gradients) and its SwiGLU's hidden states [R, expert_mlp_dim / tensor]; the k expert
    outputs of each token [T·k, d_model] (the gates' gradient in the combine), or for the capacity dispatch
    its one-hot dispatch and combine tensors [T, E, C]; and the shared experts' SwiGLU. Only the layer input
    is kept under remat full, as for a dense layer: 0 then; remat dots counts the experts' matmul outputs in
    memory.py's widths."""
    moe = shape.moe
    if moe is None or cand.remat != "none":
        return 0.0
    e, tensor = (4 if cand.precision == "float32" else 2), cand.tensor
    T, h = b * s, shape.d_model
    rows = expert_rows(shape, cand, int(T), platform)
    router = T * (2 * moe.experts + moe.top_k) * 4
    experts = rows * (h * e + swiglu_kept(moe.expert_mlp_dim / tensor, e, EXPERT_SWIGLU_SAVED))
    combine = T * moe.top_k * h * e
    if moe.dispatch == "capacity":   # GShard's one-hot dispatch and combine [T, E, C], in the compute dtype
        combine = 2 * T * moe.experts * moe.capacity(min(moe.group_sequences, int(b)) * int(s)) * e
    shared = T * swiglu_kept(moe.shared_experts * moe.expert_mlp_dim / tensor, e)
    return router + experts + combine + shared - T * swiglu_kept(shape.mlp_dim / tensor, e)


def expert_weight_copies(shape: ModelShape, cand: Candidate) -> float:
    """Bytes of the compute-dtype copies of one MoE layer's local expert weights kept for its backward (remat
    none), once per layer and step: the dense fit's constant is per token and does not scale with the experts.
    A pipeline casts its stage's weights once for the step (`Memory.stage_weights`) and its layers keep those:
    none then (the Mixtral recipe's compile, data 2 x pipe 4 x expert 8, stashes no weight)."""
    moe = shape.moe
    if moe is None or cand.remat != "none" or cand.pipe > 1:
        return 0.0
    e = 4 if cand.precision == "float32" else 2
    weights = 3 * shape.d_model * moe.expert_mlp_dim * moe.experts / cand.expert / cand.tensor
    return WEIGHT_COPIES * weights * e

"""The model's logical axis names: of every parameter, and of every activation it pins.

`parallel/rules.py` maps these names to mesh axes; a strategy never names arrays
itself. Activations are pinned by role (`ACTIVATION_AXES[role]`), so a rule override
such as `length=tensor` (sequence parallelism) reaches every place that role occurs.
"""
from __future__ import annotations

from typing import Any

# The leading "layers" axis of `blocks` is the scan axis (and what pipeline stages split).
PARAM_AXES: dict[str, Any] = {   # a parameter name -> its axes; "blocks" -> the same for each block
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
    "blocks": {
        "attn_norm": ("layers", "norm"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "norm"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    },
}

# The MoE layers' stack (model/moe.py): attention as in `blocks`, then a router and E experts on the
# `experts` axis (each a SwiGLU of hidden size `mlp`), plus the fused always-on shared experts.
# Which of the router/shared entries a model has depends on its config (`moe_param_axes`).
MOE_PARAM_AXES = {
    **{name: names for name, names in PARAM_AXES["blocks"].items() if name not in ("w_gate", "w_up", "w_down")},
    "router": ("layers", "embed", None),
    "router_noise": ("layers", "embed", None),      # router=noisy: the input-dependent noise scale
    "router_bias": ("layers", None),                # router=sigmoid: steers selection, not learned by gradient
    "expert_gate": ("layers", "experts", "embed", "mlp"),
    "expert_up": ("layers", "experts", "embed", "mlp"),
    "expert_down": ("layers", "experts", "mlp", "embed"),
    "shared_gate": ("layers", "embed", "mlp"),
    "shared_up": ("layers", "embed", "mlp"),
    "shared_down": ("layers", "mlp", "embed"),
}

# `length` is the residual stream's sequence axis (norms and residual adds: the regions
# sequence parallelism splits); `inner_length` is the sequence axis inside attention, the
# MLP and the head, where heads, the MLP hidden dim or the vocabulary already use `tensor`.
ACTIVATION_AXES = {
    "tokens": ("batch", None),
    "residual": ("batch", "length", "act_embed"),
    "heads": ("batch", "inner_length", "heads", "head_dim"),
    "kv_heads": ("batch", "inner_length", "kv_heads", "head_dim"),
    "mlp": ("batch", "inner_length", "mlp"),
    "logits": ("batch", "inner_length", "vocab"),
    # capacity dispatch: [experts, groups, slots, d_model] and the experts' hidden [.., mlp]. The groups
    # keep the batch split except over `expert`, which now splits the experts (the all_to_all).
    "expert_slots": ("experts", "expert_batch", None, "act_embed"),
    "expert_mlp": ("experts", "expert_batch", None, "mlp"),
    # MoE weights as a layer uses them: `embed` whole. FSDP's weight all-gather made explicit: left to
    # itself, XLA keeps the weights split and reshards the tokens instead (measured: every device then
    # routes its whole fsdp group's tokens).
    "router_in_use": (None, None),
    "experts_in_use": ("experts", None, "mlp"),        # expert_gate, expert_up [E, D, F]
    "experts_out_use": ("experts", "mlp", None),       # expert_down [E, F, D]
}


def moe_param_axes(router: str, shared_experts: int) -> dict:
    """Logical names of the MoE stack's parameters for this router and shared-expert choice."""
    skip: tuple[str, ...] = {"noisy": ("router_bias",), "sigmoid": ("router_noise",)}.get(
        router, ("router_noise", "router_bias"))
    skip += () if shared_experts else ("shared_gate", "shared_up", "shared_down")
    return {name: names for name, names in MOE_PARAM_AXES.items() if name not in skip}


def param_axes(tie_embeddings: bool) -> dict:
    """Logical names as a pytree shaped like the params dict (no `lm_head` when the embedding is tied)."""
    return {k: v for k, v in PARAM_AXES.items() if not (k == "lm_head" and tie_embeddings)}


def named_arrays(tie_embeddings: bool) -> dict[str, tuple]:
    """Every logical-name tuple the model uses, by a readable name (for checking rule tables)."""
    import jax
    flat = jax.tree_util.tree_flatten_with_path(param_axes(tie_embeddings), is_leaf=lambda x: isinstance(x, tuple))[0]
    named = {f"param {jax.tree_util.keystr(path, simple=True, separator='.')}": names for path, names in flat}
    named.update({f"param moe_blocks.{name}": names for name, names in MOE_PARAM_AXES.items()})
    named.update({f"activation {role}": names for role, names in ACTIVATION_AXES.items()})
    return named

"""The model's logical axis names: of every parameter, and of every activation it pins.

`parallel/rules.py` maps these names to mesh axes; a strategy never names arrays
itself. Activations are pinned by role (`ACTIVATION_AXES[role]`), so a rule override
such as `length=tensor` (sequence parallelism) reaches every place that role occurs.
"""
from __future__ import annotations

# The leading "layers" axis of `blocks` is the scan axis (and what pipeline stages split).
PARAM_AXES = {
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
}


def param_axes(tie_embeddings: bool) -> dict:
    """Logical names as a pytree shaped like the params dict (no `lm_head` when the embedding is tied)."""
    return {k: v for k, v in PARAM_AXES.items() if not (k == "lm_head" and tie_embeddings)}


def named_arrays(tie_embeddings: bool) -> dict[str, tuple]:
    """Every logical-name tuple the model uses, by a readable name (for checking rule tables)."""
    import jax
    flat = jax.tree_util.tree_flatten_with_path(param_axes(tie_embeddings), is_leaf=lambda x: isinstance(x, tuple))[0]
    named = {f"param {jax.tree_util.keystr(path, simple=True, separator='.')}": names for path, names in flat}
    named.update({f"activation {role}": names for role, names in ACTIVATION_AXES.items()})
    return named

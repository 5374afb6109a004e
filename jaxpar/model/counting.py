"""Exact parameter counts and analytic training FLOPs of the decoder, dense or Mixture-of-Experts.

An MoE model has two counts: `total`, what is stored (every expert), and `active`, what one
token's forward pass touches (k of the E routed experts). Training FLOPs follow the active
parameters: that is what makes an MoE cheap per token for its size.
"""
from __future__ import annotations

from jaxpar.model.transformer import ModelConfig


def attention_params(cfg: ModelConfig) -> int:
    return cfg.d_model * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.heads * cfg.head_dim * cfg.d_model


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one dense decoder block (attention, SwiGLU MLP, two norms)."""
    return attention_params(cfg) + 3 * cfg.d_model * cfg.mlp_dim + 2 * cfg.d_model


def moe_block_params(cfg: ModelConfig) -> dict[str, int]:
    """One MoE block by part: attention + norms, router (+ noise weights, + bias), routed and shared experts."""
    moe, D = cfg.moe, cfg.d_model
    router = D * moe.experts * (2 if moe.router == "noisy" else 1) + (moe.experts if moe.router == "sigmoid" else 0)
    return {"attention": attention_params(cfg) + 2 * D, "router": router,
            "experts": moe.experts * 3 * D * moe.expert_mlp_dim,
            "shared": 3 * D * moe.shared_experts * moe.expert_mlp_dim}


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by part; `total` equals the number of elements jaxpar allocates.

    `blocks`: every scanned layer (dense and MoE stacks); `experts`: the routed experts' share of
    it; `active`: parameters one token uses (the routed experts counted k/E of the way).
    """
    embed = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    blocks, experts, inactive = cfg.dense_layers * block_params(cfg), 0, 0
    if cfg.moe:
        part = moe_block_params(cfg)
        blocks += cfg.moe_layers * sum(part.values())
        experts = cfg.moe_layers * part["experts"]
        inactive = experts * (cfg.moe.experts - cfg.moe.top_k) // cfg.moe.experts
    total = embed + head + blocks + cfg.d_model
    return {"embedding": embed, "lm_head": head, "blocks": blocks, "experts": experts, "final_norm": cfg.d_model,
            "non_embedding": total - embed, "total": total, "active": total - inactive}


def matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies with (the active ones): blocks minus norms and biases, and the head."""
    D = cfg.d_model
    dense = cfg.dense_layers * (block_params(cfg) - 2 * D)
    moe = 0
    if cfg.moe:
        m = cfg.moe
        router = D * m.experts * (2 if m.router == "noisy" else 1)
        moe = cfg.moe_layers * (attention_params(cfg) + router + 3 * D * m.expert_mlp_dim * (m.top_k + m.shared_experts))
    return dense + moe + D * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), the MFU numerator.

    6 x active matmul params (2 forward, 4 backward) plus attention scores and values:
    12 x layers x heads x head_dim x seq_len (PaLM's convention, no causal discount).
    Remat recomputation is not counted (MFU measures useful work), nor is the MoE dispatch
    (sorting, the capacity dispatch's one-hot einsums): overhead, not model work.
    """
    attention = 12 * cfg.layers * cfg.heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params(cfg) + attention

"""Exact parameter counts and analytic training FLOPs of the decoder."""
from __future__ import annotations

from jaxpar.model.transformer import ModelConfig


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder block (attention, SwiGLU MLP, two norms)."""
    attn = cfg.d_model * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.heads * cfg.head_dim * cfg.d_model
    mlp = 3 * cfg.d_model * cfg.mlp_dim
    return attn + mlp + 2 * cfg.d_model


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by part; `total` equals the number of elements jaxpar allocates."""
    embed = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    blocks = cfg.layers * block_params(cfg)
    total = embed + head + blocks + cfg.d_model
    return {"embedding": embed, "lm_head": head, "blocks": blocks, "final_norm": cfg.d_model,
            "non_embedding": total - embed, "total": total}


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: blocks (minus norms) and the output head."""
    per_block = block_params(cfg) - 2 * cfg.d_model
    return cfg.layers * per_block + cfg.d_model * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), the MFU numerator.

    6 x matmul params (2 forward, 4 backward) plus attention scores and values:
    12 x layers x heads x head_dim x seq_len (PaLM's convention, no causal discount).
    Remat recomputation is not counted: MFU measures useful work.
    """
    attention = 12 * cfg.layers * cfg.heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params(cfg) + attention

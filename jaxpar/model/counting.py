"""Exact parameter counts and analytic training FLOPs of the decoder, dense or Mixture-of-Experts.

An MoE model has two counts: `total`, what is stored (every expert), and `active`, what one
token's forward pass touches (k of the E routed experts). Training FLOPs follow the active
parameters: that is what makes an MoE cheap per token for its size.
"""
from __future__ import annotations

import dataclasses

from jaxpar.model.transformer import ModelConfig


def attention_params(cfg: ModelConfig) -> int:
    return cfg.d_model * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.heads * cfg.head_dim * cfg.d_model


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one dense decoder block (attention, SwiGLU MLP, two norms)."""
    return attention_params(cfg) + 3 * cfg.d_model * cfg.mlp_dim + 2 * cfg.d_model


def moe_block_params(cfg: ModelConfig) -> dict[str, int]:
    """One MoE block by part: attention + norms, router (+ noise weights, + bias), routed and shared experts."""
    moe, D = cfg.moe, cfg.d_model
    assert moe is not None, "moe_block_params counts an MoE model's block"
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
        active_experts = m.top_k + m.shared_experts
        moe = cfg.moe_layers * (attention_params(cfg) + router + 3 * D * m.expert_mlp_dim * active_experts)
    return dense + moe + D * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), the MFU numerator.

    6 x active matmul params (2 forward, 4 backward) plus attention scores and values:
    12 x layers x heads x head_dim x seq_len (PaLM's convention, no causal discount).
    Remat recomputation is not counted (MFU measures useful work), nor is the MoE dispatch
    (sorting, the capacity dispatch's one-hot einsums): overhead, not model work.
    """
    return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Scores and values, forward + backward, no causal discount (PaLM's convention): 12·L·a·d_h·s."""
    return 12.0 * cfg.layers * cfg.heads * cfg.head_dim * seq_len


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A `ModelConfig` as the strategies' predictions and the planner read it: sizes by name, and the counts
    above (there is no second counter)."""

    model: ModelConfig

    @classmethod
    def from_config(cls, config, vocab: int | None = None) -> ModelShape:
        return cls(ModelConfig.from_config(config.model, vocab))

    @classmethod
    def dense(cls, *, vocab: int, d_model: int, layers: int, heads: int, kv_heads: int, head_dim: int, mlp_dim: int,
              tie_embeddings: bool = False) -> ModelShape:
        """A dense decoder by its sizes alone (published models the planner is anchored on)."""
        return cls(ModelConfig(vocab_size=vocab, d_model=d_model, layers=layers, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, mlp_dim=mlp_dim, max_seq_len=0, tie_embeddings=tie_embeddings))

    def __getattr__(self, name):   # d_model, layers, heads, kv_heads, head_dim, mlp_dim, tie_embeddings, ...
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    @property
    def vocab(self) -> int:
        return self.model.vocab_size

    @property
    def moe(self):
        return self.model.moe

    @property
    def experts(self) -> int:
        return self.moe.experts if self.moe else 0

    @property
    def top_k(self) -> int:
        return self.moe.top_k if self.moe else 0

    @property
    def expert_mlp_dim(self) -> int:
        return self.moe.expert_mlp_dim if self.moe else 0

    @property
    def shared_experts(self) -> int:
        return self.moe.shared_experts if self.moe else 0

    def counts(self) -> dict[str, int]:
        return param_count(self.model)

    @property
    def params(self) -> int:
        return self.counts()["total"]

    def active_matmul_params(self) -> int:
        return matmul_params(self.model)

    def attention_flops_per_token(self, seq_len: int) -> float:
        return attention_flops_per_token(self.model, seq_len)

    def flops_per_token(self, seq_len: int) -> float:
        return train_flops_per_token(self.model, seq_len)

    def describe(self) -> str:
        moe = (f", MoE {self.experts} experts top-{self.top_k} in {self.moe_layers} layers" if self.experts else "")
        return (f"{self.params / 1e9:.2f} B params ({self.layers} layers, d_model {self.d_model}, {self.heads} heads "
                f"/ {self.kv_heads} kv, SwiGLU {self.mlp_dim}, vocab {self.vocab}{moe})")

"""The model as the planner sees it: sizes, parameter counts by part, FLOPs per token.

A config's `model.*` fields become a `ModelShape`. Dense counts are jaxpar's exact
counts (model/counting.py: the test checks they agree). Mixture-of-Experts configs
(a `model.moe` section with `experts > 0`, where the checkout has one) add the routed
experts: stored Ψ counts every expert, the FLOPs per token only the k a token visits.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    tie_embeddings: bool = False
    experts: int = 0              # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_mlp_dim: int = 0
    shared_experts: int = 0
    moe_layers: int = 0           # the last `moe_layers` layers are MoE

    @classmethod
    def from_config(cls, config, vocab: int | None = None) -> ModelShape:
        m = config.model
        moe = m.get("moe") if hasattr(m, "get") else None
        experts = int(moe.experts) if moe is not None and moe.get("experts", 0) else 0
        return cls(vocab=int(vocab or m.vocab_size), d_model=m.d_model, layers=m.layers, heads=m.heads,
                   kv_heads=m.kv_heads, head_dim=m.head_dim or m.d_model // m.heads, mlp_dim=m.mlp_dim,
                   tie_embeddings=bool(m.tie_embeddings), experts=experts,
                   top_k=int(moe.top_k) if experts else 0,
                   expert_mlp_dim=int(moe.expert_mlp_dim or m.mlp_dim) if experts else 0,
                   shared_experts=int(moe.shared_experts) if experts else 0,
                   moe_layers=m.layers - int(moe.dense_layers) if experts else 0)

    # ------------------------------------------------------------------ parameters
    @property
    def attention_params(self) -> int:
        d, dh = self.d_model, self.head_dim
        return d * (self.heads + 2 * self.kv_heads) * dh + self.heads * dh * d

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def counts(self) -> dict[str, int]:
        """Parameters by part: embedding, lm_head, blocks (every layer), experts (routed, in blocks), total."""
        d = self.d_model
        dense_block = self.attention_params + 3 * d * self.mlp_dim + 2 * d
        experts = self.moe_layers * self.experts * 3 * d * self.expert_mlp_dim
        shared = 3 * d * self.shared_experts * self.expert_mlp_dim
        moe_block_rest = self.attention_params + 2 * d + d * self.experts + shared
        blocks = self.dense_layers * dense_block + self.moe_layers * moe_block_rest + experts
        embed = self.vocab * d
        head = 0 if self.tie_embeddings else d * self.vocab
        return {"embedding": embed, "lm_head": head, "blocks": blocks, "experts": experts, "final_norm": d,
                "total": embed + head + blocks + d}

    @property
    def params(self) -> int:
        return self.counts()["total"]

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with: dense blocks, the k routed + shared experts and router, the head."""
        d = self.d_model
        dense = self.dense_layers * (self.attention_params + 3 * d * self.mlp_dim)
        moe = self.moe_layers * (self.attention_params + d * self.experts
                                 + 3 * d * self.expert_mlp_dim * (self.top_k + self.shared_experts))
        return dense + moe + d * self.vocab

    # ------------------------------------------------------------------ FLOPs
    def attention_flops_per_token(self, seq_len: int) -> float:
        """Scores and values, forward + backward, no causal discount (PaLM's convention): 12·L·a·d_h·s."""
        return 12.0 * self.layers * self.heads * self.head_dim * seq_len

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token, the MFU numerator: 6 x active matmul params + attention."""
        return 6.0 * self.active_matmul_params() + self.attention_flops_per_token(seq_len)

    def describe(self) -> str:
        moe = (f", MoE {self.experts} experts top-{self.top_k} in {self.moe_layers} layers" if self.experts else "")
        return (f"{self.params / 1e9:.2f} B params ({self.layers} layers, d_model {self.d_model}, {self.heads} heads "
                f"/ {self.kv_heads} kv, SwiGLU {self.mlp_dim}, vocab {self.vocab}{moe})")

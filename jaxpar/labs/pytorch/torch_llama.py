"""jaxpar's Llama written in plain PyTorch, for the PyTorch lab (experiments/06_pytorch).

A short module rather than transformers' LlamaForCausalLM because tensor and pipeline
parallelism need to see the layers: each linear layer is its own `nn.Linear` (what
`ColwiseParallel`/`RowwiseParallel` shard), attention reads its head count from the
tensor it gets (so a rank holding H/t heads runs unchanged), and `Llama.keep_stage`
drops what a pipeline stage does not run. The parameter names are Hugging Face's, so
the checkpoint jaxpar exports (`model/hf.py`) loads with `load_state_dict`;
`transformers_deviation` checks the logits against LlamaForCausalLM's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, h, kv, self.head_dim = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(h * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin):
        b, s = x.shape[:2]
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)   # -1: this rank's heads under TP
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def rope(x, cos, sin):
    """Rotate-half RoPE on [b, heads, s, head_dim], as jaxpar and transformers compute it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Decoder(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c["num_hidden_layers"])})
        self.norm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        inv_freq = 1.0 / c["rope_theta"] ** (torch.arange(0, c["head_dim"], 2, dtype=torch.float32) / c["head_dim"])
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class Llama(nn.Module):
    """tokens [b, s] -> logits [b, s, vocab]; a pipeline stage (`keep_stage`) maps its input to its output."""

    def __init__(self, c: dict):
        super().__init__()
        if c.get("tie_word_embeddings"):
            raise ValueError("tie_word_embeddings: the lab's torch model has a separate lm_head (jaxpar's default)")
        self.model = Decoder(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, x):
        m = self.model
        positions = torch.arange(x.shape[1], dtype=torch.float32)   # before SP splits the tokens
        if m.embed_tokens is not None:
            x = m.embed_tokens(x)
        angles = positions[:, None] * m.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for layer in m.layers.values():
            x = layer(x, cos, sin)
        if m.norm is not None:
            x = m.norm(x)
        return self.lm_head(x) if self.lm_head is not None else x

    def keep_stage(self, stage: int, stages: int) -> Llama:
        """Drop every part stage `stage` of `stages` does not run (layers split evenly, embedding first, head last)."""
        names = list(self.model.layers)
        per = len(names) // stages
        for name in names[:stage * per] + names[(stage + 1) * per:]:
            del self.model.layers[name]
        if stage > 0:
            self.model.embed_tokens = None   # type: ignore[assignment]  # nn.Module takes None: the part is dropped
        if stage < stages - 1:
            self.model.norm, self.lm_head = None, None   # type: ignore[assignment]  # as embed_tokens
        return self


def load(path) -> Llama:
    """The Llama in an HF directory written by `jaxpar.model.hf.export_hf_llama` (fp32)."""
    from safetensors.torch import load_file
    path = Path(path)
    model = Llama(json.loads((path / "config.json").read_text()))
    model.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    return model


def loss_fn(logits, targets):
    """Mean next-token cross-entropy, jaxpar's objective."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def transformers_deviation(path, tokens) -> float:
    """max |logits - LlamaForCausalLM's logits| on `tokens` [b, s] for the checkpoint in `path`."""
    import transformers
    reference = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    with torch.no_grad():
        ours = load(path).eval()(tokens)
        theirs = reference(tokens).logits
    return float((ours - theirs).abs().max())

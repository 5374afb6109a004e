"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

The N blocks' parameters are stacked along a leading `layers` axis and run with
`jax.lax.scan`, so compile time does not grow with depth and pipeline stages
are a reshape of that axis. Each parameter is an `nnx.Param` whose metadata
carries its logical axis names; `parallel/rules.py` turns them into shardings.

Conventions follow Hugging Face's LlamaForCausalLM (rotate-half RoPE, fp32
norms) so its checkpoints load without permuting weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.model.fp8 import fp8_einsum
from jaxpar.parallel.rules import constrain


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    @classmethod
    def from_config(cls, model, vocab_size: int | None = None) -> "ModelConfig":
        return cls(
            vocab_size=vocab_size or model.vocab_size, d_model=model.d_model, layers=model.layers,
            heads=model.heads, kv_heads=model.kv_heads, head_dim=model.head_dim or model.d_model // model.heads,
            mlp_dim=model.mlp_dim, max_seq_len=model.max_seq_len, rope_theta=model.rope_theta,
            norm_eps=model.norm_eps, tie_embeddings=model.tie_embeddings, init_std=model.init_std)


# Logical axis names of every parameter (the leading "layers" axis is the scan axis).
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


def _param(key, shape, std, names):
    value = std * jax.random.normal(key, shape, jnp.float32) if std else jnp.ones(shape, jnp.float32)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class Blocks(nnx.Module):
    """The N decoder blocks' weights, stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, H, KV, Dh, F = cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * L) ** 0.5  # GPT-2 style scaled residual outputs
        ax = PARAM_AXES["blocks"]
        self.attn_norm = _param(None, (L, D), 0, ax["attn_norm"])
        self.wq = _param(rngs.params(), (L, D, H, Dh), std, ax["wq"])
        self.wk = _param(rngs.params(), (L, D, KV, Dh), std, ax["wk"])
        self.wv = _param(rngs.params(), (L, D, KV, Dh), std, ax["wv"])
        self.wo = _param(rngs.params(), (L, H, Dh, D), out_std, ax["wo"])
        self.mlp_norm = _param(None, (L, D), 0, ax["mlp_norm"])
        self.w_gate = _param(rngs.params(), (L, D, F), std, ax["w_gate"])
        self.w_up = _param(rngs.params(), (L, D, F), std, ax["w_up"])
        self.w_down = _param(rngs.params(), (L, F, D), out_std, ax["w_down"])


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.init_std, PARAM_AXES["embed"])
        self.blocks = Blocks(cfg, rngs)
        self.final_norm = _param(None, (cfg.d_model,), 0, PARAM_AXES["final_norm"])
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.init_std, PARAM_AXES["lm_head"])

    def __call__(self, tokens, *, compute_dtype=jnp.float32, remat_policy=None):
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.cfg, compute_dtype=compute_dtype, remat_policy=remat_policy)


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq_len, head_dim, theta):
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)            # [S, Dh], rotate-half layout
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """x: [B, S, heads, Dh]; rotate the two halves of the head dimension."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    x32 = x.astype(jnp.float32)
    out = x32 * cos[None, :, None, :] + rotated.astype(jnp.float32) * sin[None, :, None, :]
    return out.astype(x.dtype)


def precision(compute_dtype):
    """(activation dtype, einsum for the activation x weight matmuls) of a compute dtype.

    float32 and bfloat16: that dtype and `jnp.einsum`. float8 (`jnp.float8_e4m3fn`) is a recipe,
    not an activation dtype: activations stay bfloat16 between matmuls and the weight matmuls run
    as `fp8.fp8_einsum` (e4m3 operands forward, e5m2 gradients backward, per-tensor scales).
    """
    if jnp.dtype(compute_dtype) == jnp.float8_e4m3fn:
        return jnp.bfloat16, fp8_einsum
    return compute_dtype, jnp.einsum


def attention(x, p, cos, sin, cfg: ModelConfig, matmul=jnp.einsum):
    """Causal grouped-query attention; heads are the tensor-parallel axis.

    `matmul` computes the four weight matmuls (see `precision`); the score and value
    einsums multiply two activations and always use `jnp.einsum`.
    """
    q = matmul("bsd,dhk->bshk", x, p["wq"])
    k = matmul("bsd,dhk->bshk", x, p["wk"])
    v = matmul("bsd,dhk->bshk", x, p["wv"])
    q = constrain(q, ("batch", "length", "heads", "head_dim"))
    k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    B, S, H, Dh = q.shape
    group = H // cfg.kv_heads
    q = q.reshape(B, S, cfg.kv_heads, group, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / jnp.sqrt(Dh).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((S, S), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(B, S, H, Dh)
    out = constrain(out, ("batch", "length", "heads", "head_dim"))
    return matmul("bshk,hkd->bsd", out, p["wo"])


def mlp(x, p, matmul=jnp.einsum):
    """SwiGLU: gate and up are column-parallel, down is row-parallel under tensor parallelism."""
    gate = matmul("bsd,df->bsf", x, p["w_gate"])
    up = matmul("bsd,df->bsf", x, p["w_up"])
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    return matmul("bsf,fd->bsd", hidden, p["w_down"])


def block(x, p, cos, sin, cfg: ModelConfig, matmul=jnp.einsum):
    """One pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""
    attn_out = attention(rms_norm(x, p["attn_norm"], cfg.norm_eps), p, cos, sin, cfg, matmul)
    x = x + checkpoint_name(attn_out, "attn_out")
    x = constrain(x, ("batch", "length", "act_embed"))
    mlp_out = mlp(rms_norm(x, p["mlp_norm"], cfg.norm_eps), p, matmul)
    x = x + checkpoint_name(mlp_out, "mlp_out")
    return constrain(x, ("batch", "length", "act_embed"))


def embed_lookup(tokens, table):
    """Vocab-parallel embedding as a one-hot matmul (Megatron's masked lookup + all-reduce).

    With the table's vocab axis split over `tensor`, each device multiplies by its
    own rows and XLA sums the partial results; a gather from a sharded table would
    instead make the partitioner replicate it.
    """
    one_hot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
    one_hot = constrain(one_hot, ("batch", "length", "vocab"))
    return constrain(jnp.einsum("bsv,vd->bsd", one_hot, table), ("batch", "length", "act_embed"))


def forward(params, tokens, cfg: ModelConfig, *, compute_dtype=jnp.float32, remat_policy=None):
    """tokens [B, S] int32 -> logits [B, S, vocab] float32.

    `params` is the pure dict of fp32 master weights; they are cast to the
    activation dtype at use (mixed precision), norms and softmax stay fp32.
    `compute_dtype`: float32, bfloat16, or float8_e4m3fn for FP8 matmuls with
    bfloat16 activations (see `precision`; the embedding lookup stays bfloat16).
    `remat_policy`: None (keep activations) or a `jax.checkpoint_policies` policy.
    """
    dtype, matmul = precision(compute_dtype)
    cast = lambda a: a.astype(dtype)
    S = tokens.shape[1]
    cos, sin = rope_tables(S, cfg.head_dim, cfg.rope_theta)
    x = embed_lookup(tokens, cast(params["embed"]))

    def body(carry, layer_params):
        return block(carry, jax.tree.map(cast, layer_params), cos, sin, cfg, matmul), None

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, params["blocks"])
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    logits = matmul("bsd,dv->bsv", x, cast(head), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "vocab"))


def param_axes(cfg: ModelConfig) -> dict:
    """Logical axis names, as a pytree shaped like the params dict."""
    axes = {k: v for k, v in PARAM_AXES.items() if not (k == "lm_head" and cfg.tie_embeddings)}
    return axes


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """Fresh fp32 parameters as a pure dict (the pytree the trainer, Optax and Orbax see)."""
    model = Transformer(cfg, nnx.Rngs(params=seed))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))

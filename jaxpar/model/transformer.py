"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) as composable pieces.

`embed`, `run_blocks` (any contiguous slice of the stacked `layers` axis: what a
pipeline stage runs), `head_loss` / `head_logits`; `forward` and `loss` are their
composition. What a strategy or kernel changes is injected through `ops` (model/ops.py),
so nobody copies this forward pass.

The N blocks' parameters are stacked along a leading `layers` axis and run with
`jax.lax.scan`: compile time does not grow with depth. A Mixture-of-Experts model
(`model.moe.experts > 0`, model/moe.py) has two stacks, each scanned: `blocks`, the
first `moe.dense_layers` layers with the dense MLP, then `moe_blocks`, whose feed-forward
is a router and E experts (plus the shared experts as a dense MLP). Conventions follow Hugging
Face's LlamaForCausalLM (rotate-half RoPE, fp32 norms) so its checkpoints load
without permuting weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.model.axes import ACTIVATION_AXES, moe_param_axes, param_axes
from jaxpar.model.moe import MoEConfig, bias_update, moe_feed_forward, moe_layer_ops, noise_seeds
from jaxpar.model.ops import Ops

ACT = ACTIVATION_AXES
REFERENCE_OPS = Ops()


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
    moe: MoEConfig | None = None      # None: every layer dense

    @classmethod
    def from_config(cls, model, vocab_size: int | None = None) -> ModelConfig:
        return cls(
            vocab_size=vocab_size or model.vocab_size, d_model=model.d_model, layers=model.layers,
            heads=model.heads, kv_heads=model.kv_heads, head_dim=model.head_dim or model.d_model // model.heads,
            mlp_dim=model.mlp_dim, max_seq_len=model.max_seq_len, rope_theta=model.rope_theta,
            norm_eps=model.norm_eps, tie_embeddings=model.tie_embeddings, init_std=model.init_std,
            moe=MoEConfig.from_config(model.moe, model.mlp_dim))

    @property
    def dense_layers(self) -> int:
        """Layers in the dense stack `blocks` (all of them for a dense model)."""
        return self.moe.dense_layers if self.moe else self.layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def param_axes(self) -> dict:
        axes = param_axes(self.tie_embeddings)
        if self.moe:
            axes["moe_blocks"] = moe_param_axes(self.moe.router, self.moe.shared_experts)
            if not self.dense_layers:
                del axes["blocks"]
        return axes


# ----------------------------------------------------------------------------- parameters

def _param(key, shape, std, names):
    value = std * jax.random.normal(key, shape, jnp.float32) if std else jnp.ones(shape, jnp.float32)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class Blocks(nnx.Module):
    """The dense decoder blocks' weights, stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, F = cfg.dense_layers, cfg.d_model, cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.layers) ** 0.5  # GPT-2 style scaled residual outputs
        ax = cfg.param_axes()["blocks"]
        _attention_params(self, cfg, L, ax, rngs)
        self.w_gate = _param(rngs.params(), (L, D, F), std, ax["w_gate"])
        self.w_up = _param(rngs.params(), (L, D, F), std, ax["w_up"])
        self.w_down = _param(rngs.params(), (L, F, D), out_std, ax["w_down"])


def _attention_params(module, cfg: ModelConfig, L: int, ax: dict, rngs: nnx.Rngs):
    """The attention half of L stacked blocks and both norms (shared by the dense and MoE stacks)."""
    D, H, KV, Dh = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.layers) ** 0.5
    module.attn_norm = _param(None, (L, D), 0, ax["attn_norm"])
    module.wq = _param(rngs.params(), (L, D, H, Dh), std, ax["wq"])
    module.wk = _param(rngs.params(), (L, D, KV, Dh), std, ax["wk"])
    module.wv = _param(rngs.params(), (L, D, KV, Dh), std, ax["wv"])
    module.wo = _param(rngs.params(), (L, H, Dh, D), out_std, ax["wo"])
    module.mlp_norm = _param(None, (L, D), 0, ax["mlp_norm"])


class MoEBlocks(nnx.Module):
    """The MoE blocks' weights, stacked on `layers`: attention, router, E experts, shared experts."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        moe, L, D = cfg.moe, cfg.moe_layers, cfg.d_model
        assert moe is not None, "MoEBlocks is built for an MoE model"
        E, F, shared = moe.experts, moe.expert_mlp_dim, moe.shared_experts * moe.expert_mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.layers) ** 0.5
        ax = cfg.param_axes()["moe_blocks"]
        _attention_params(self, cfg, L, ax, rngs)
        self.router = _param(rngs.params(), (L, D, E), std, ax["router"])
        if moe.router == "noisy":   # zero init: noise scale softplus(0) = 0.69 (Shazeer et al. start at 0 too)
            self.router_noise = nnx.Param(jnp.zeros((L, D, E)), out_sharding=ax["router_noise"], eager_sharding=False)
        if moe.router == "sigmoid":
            self.router_bias = nnx.Param(jnp.zeros((L, E)), out_sharding=ax["router_bias"], eager_sharding=False)
        self.expert_gate = _param(rngs.params(), (L, E, D, F), std, ax["expert_gate"])
        self.expert_up = _param(rngs.params(), (L, E, D, F), std, ax["expert_up"])
        self.expert_down = _param(rngs.params(), (L, E, F, D), out_std, ax["expert_down"])
        if shared:
            self.shared_gate = _param(rngs.params(), (L, D, shared), std, ax["shared_gate"])
            self.shared_up = _param(rngs.params(), (L, D, shared), std, ax["shared_up"])
            self.shared_down = _param(rngs.params(), (L, shared, D), out_std, ax["shared_down"])


class Transformer(nnx.Module):
    """The parameter tree with its logical-axis metadata; the computation is the functions below."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        axes = cfg.param_axes()
        self.embed = _param(rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.init_std, axes["embed"])
        if cfg.dense_layers:
            self.blocks = Blocks(cfg, rngs)
        if cfg.moe:
            self.moe_blocks = MoEBlocks(cfg, rngs)
        self.final_norm = _param(None, (cfg.d_model,), 0, axes["final_norm"])
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.init_std, axes["lm_head"])


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """Fresh fp32 parameters as a pure dict (the pytree the strategy, Optax and Orbax see)."""
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(params=seed)), nnx.Param))


# ----------------------------------------------------------------------------- one block

def rope_tables(positions, head_dim, theta):
    """cos and sin [S, Dh] of each row's position (`positions` [S]: 0..S-1, or a context-parallel chunk order)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.asarray(positions, jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)            # [S, Dh], rotate-half layout
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """x: [B, S, heads, Dh]; rotate the two halves of the head dimension."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[None, :, None, :] + rotated.astype(jnp.float32) * sin[None, :, None, :]
    return out.astype(x.dtype)


def attention(x, w, cfg: ModelConfig, ops: Ops):
    """q/k/v are column-parallel (split by heads), wo row-parallel under tensor parallelism."""
    x = ops.column_in(x)
    q = ops.constrain(ops.matmul("bsd,dhk->bshk", x, w["wq"]), ACT["heads"])
    k = ops.constrain(ops.matmul("bsd,dhk->bshk", x, w["wk"]), ACT["kv_heads"])
    v = ops.constrain(ops.matmul("bsd,dhk->bshk", x, w["wv"]), ACT["kv_heads"])
    cos, sin = rope_tables(ops.positions(q.shape[1]), q.shape[-1], cfg.rope_theta)
    out = ops.attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    out = ops.constrain(out, ACT["heads"])
    return ops.row_out(ops.matmul("bshk,hkd->bsd", out, w["wo"]))


def mlp(x, w, ops: Ops):
    """SwiGLU: gate and up are column-parallel, down is row-parallel under tensor parallelism."""
    x = ops.column_in(x)
    gate = ops.matmul("bsd,df->bsf", x, w["w_gate"])
    up = ops.matmul("bsd,df->bsf", x, w["w_up"])
    hidden = ops.constrain(jax.nn.silu(gate) * up, ACT["mlp"])
    return ops.row_out(ops.matmul("bsf,fd->bsd", hidden, w["w_down"]))


def feed_forward(x, w, cfg: ModelConfig, ops: Ops, noise=None):
    """The dense MLP, or in an MoE block the routed experts plus the shared experts (a dense MLP)."""
    if "router" not in w:
        return mlp(x, w, ops), {}
    ops = moe_layer_ops(ops)
    assert cfg.moe is not None, "a router weight means an MoE model"
    out, aux = moe_feed_forward(x, w, cfg.moe, ops, noise)
    if "shared_gate" in w:
        out = out + mlp(x, {"w_gate": w["shared_gate"], "w_up": w["shared_up"], "w_down": w["shared_down"]}, ops)
    return out, aux


def block(x, w, cfg: ModelConfig, ops: Ops, noise=None):
    """One pre-norm decoder block: x + attn(norm(x)), then + feed_forward(norm(x)). Returns (x, aux).

    `noise`: the noisy router's (seeds, layer) in training (MoE blocks only), else None.
    """
    attn_out = attention(ops.norm(x, w["attn_norm"], cfg.norm_eps), w, cfg, ops)
    x = ops.constrain(x + checkpoint_name(attn_out, "attn_out"), ACT["residual"])
    mlp_out, aux = feed_forward(ops.norm(x, w["mlp_norm"], cfg.norm_eps), w, cfg, ops, noise)
    x = ops.constrain(x + checkpoint_name(mlp_out, "mlp_out"), ACT["residual"])
    return x, aux


# ----------------------------------------------------------------------------- the pieces

def embed(params, tokens, ops: Ops = REFERENCE_OPS):
    """tokens [B, S] -> the residual stream [B, S, D] in the compute dtype."""
    return ops.constrain(ops.embed(tokens, ops.weights("embed", params["embed"])), ACT["residual"])


def run_blocks(blocks, x, cfg: ModelConfig, ops: Ops = REFERENCE_OPS, remat_policy=None, seeds=None, first_layer=0):
    """Run the stacked layers `blocks` (any contiguous slice of one stack) over x -> (x, aux).

    aux: what the blocks report per layer (stacked on a leading layers axis); keys ending
    in `_loss` are weighted auxiliary losses the objective adds (see `loss`).
    `remat_policy`: None keeps every activation; else a `jax.checkpoint` policy for the body.
    `seeds` [B]: the noisy router's per-sequence noise seeds (training only; MoE blocks).
    `first_layer`: the stack index of the slice's first layer (a pipeline stage's chunk), which keys the noise.
    """
    if ops.layers is not None and "router" not in blocks:   # a strategy's own loop (parallel/prefetch.py)
        return ops.layers(blocks, x, lambda x, w: block(x, w, cfg, ops))
    if "router" not in blocks:
        def body(x, stored):
            return block(x, ops.weights("blocks", stored), cfg, ops)
    else:
        def body(x, layer):
            stored, index = layer
            noise = None if seeds is None else (seeds, index)
            return block(x, ops.weights("moe_blocks", stored), cfg, ops, noise)
        blocks = (blocks, first_layer + jnp.arange(jax.tree.leaves(blocks)[0].shape[0]))

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    return jax.lax.scan(body, x, blocks)


def run_layers(params, x, cfg: ModelConfig, ops: Ops = REFERENCE_OPS, remat_policy=None, seeds=None):
    """Every layer: the dense stack `blocks`, then the MoE stack `moe_blocks` when the model has one."""
    aux = {}
    for stack in ("blocks", "moe_blocks"):
        if stack in params:
            x, stack_aux = run_blocks(params[stack], x, cfg, ops, remat_policy, seeds)
            aux.update(stack_aux)
    return x, aux


def _head_inputs(params, x, cfg: ModelConfig, ops: Ops):
    x = ops.norm(x, ops.weights("final_norm", params["final_norm"]), cfg.norm_eps)
    head = ops.weights("embed", params["embed"]).T if cfg.tie_embeddings else ops.weights("lm_head", params["lm_head"])
    return ops.column_in(x), head


def head_loss(params, x, targets, cfg: ModelConfig, ops: Ops = REFERENCE_OPS):
    """Final norm, output head and the mean cross-entropy against `targets` [B, S]."""
    x, head = _head_inputs(params, x, cfg, ops)
    return ops.cross_entropy(x, head, targets, ops)


def head_logits(params, x, cfg: ModelConfig, ops: Ops = REFERENCE_OPS):
    """Final norm and output head: fp32 logits [B, S, vocab] (for decoding)."""
    x, head = _head_inputs(params, x, cfg, ops)
    return ops.constrain(ops.logits(x, head), ACT["logits"])


def forward(params, tokens, cfg: ModelConfig, ops: Ops = REFERENCE_OPS, remat_policy=None):
    """tokens [B, S] int32 -> (logits [B, S, vocab] float32, aux)."""
    x, aux = run_layers(params, embed(params, tokens, ops), cfg, ops, remat_policy)
    return head_logits(params, x, cfg, ops), aux


def split_aux(aux: dict) -> tuple[dict, dict]:
    """Per-layer aux -> (weighted losses summed over layers, statistics kept per layer)."""
    losses = {k: jnp.sum(v) for k, v in aux.items() if k.endswith("_loss")}
    return losses, {k: v for k, v in aux.items() if not k.endswith("_loss")}


def cross_entropy_and_aux(params, tokens, cfg: ModelConfig, ops: Ops = REFERENCE_OPS, remat_policy=None,
                          training: bool = False):
    """A [B, S+1] token batch -> (mean next-token cross-entropy, per-layer aux). Evaluation uses the first.

    `training`: draw the noisy router's noise (only `loss`, the training objective, sets it).
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seeds = noise_seeds(inputs) if training and cfg.moe and cfg.moe.router == "noisy" else None
    x, aux = run_layers(params, embed(params, inputs, ops), cfg, ops, remat_policy, seeds)
    return head_loss(params, x, targets, cfg, ops), aux


def loss(params, tokens, cfg: ModelConfig, ops: Ops = REFERENCE_OPS, remat_policy=None):
    """The training objective of a [B, S+1] token batch -> (loss, metrics).

    loss = mean next-token cross-entropy + the blocks' weighted auxiliary losses.
    metrics: `loss`, and when auxiliary outputs exist `ce_loss`, each auxiliary loss and
    each statistic (strategies pass them through to metrics.jsonl without naming them).
    """
    ce, aux = cross_entropy_and_aux(params, tokens, cfg, ops, remat_policy, training=True)
    losses, stats = split_aux(aux)
    total = ce + sum(losses.values())
    return total, {"loss": total, **({"ce_loss": ce} if aux else {}), **losses, **stats}


def outside_gradient(metrics: dict, cfg: ModelConfig) -> dict:
    """Changes to parameters that learn from the step's observed statistics, not from the gradient.

    {stack: {name: delta}} with full-shape deltas; {} for most models. Today: the MoE router's
    aux-free bias (router=sigmoid), moved against each expert's observed load (moe.bias_update).
    Strategies apply it after the optimizer (parallel/step.py `apply_outside_gradient`).
    """
    if not cfg.moe or cfg.moe.router != "sigmoid" or not cfg.moe.bias_rate:
        return {}
    return {"moe_blocks": {"router_bias": bias_update(metrics["moe_routed"], cfg.moe.bias_rate)}}

"""Hugging Face Llama and Mixtral checkpoints in and out, without torch.

jaxpar's decoder follows LlamaForCausalLM's conventions (rotate-half RoPE, fp32
RMSNorm, SwiGLU), so converting is only renaming, transposing (torch's Linear
stores [out, in], jaxpar's einsums want [in, out]), splitting the fused head
axis and stacking the per-layer tensors on the leading `layers` axis.

Only plain Llama and Mixtral (MixtralForCausalLM: every layer MoE, softmax top-k
router with renormalised gates, dropless, no shared expert) are accepted: a config
that asks for something this model does not compute (biases, scaled RoPE, another
activation, sliding-window attention, router jitter, another MoE architecture) is
refused with one line naming the field, rather than loaded into weights that would
silently differ. A Mixtral checkpoint's experts load from either layout transformers
writes (per-expert `block_sparse_moe.experts.{j}.w1/w2/w3`, or the fused
`mlp.experts.gate_up_proj` / `down_proj` of transformers >= 5) and export in the first,
which both transformers 4 and 5 read.
Fields that say the same thing twice (RoPE in `rope_parameters` and `rope_scaling`,
a top-level `rope_theta`, a tied head stored as `lm_head.weight`) must agree: a
conflict is refused too, since picking one would be a guess.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers numpy's "bfloat16" dtype, which safetensors' numpy reader needs
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxpar.model.moe import MoEConfig
from jaxpar.model.transformer import ModelConfig

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"

# Per-layer HF tensor name -> (jaxpar blocks key, how to turn the [out, in] matrix into jaxpar's layout).
# The lambdas take the HF array and the config; the export side inverts them below.
_LAYER_IMPORT = {
    "input_layernorm.weight": ("attn_norm", lambda w, c: w),
    "self_attn.q_proj.weight": ("wq", lambda w, c: w.T.reshape(c.d_model, c.heads, c.head_dim)),
    "self_attn.k_proj.weight": ("wk", lambda w, c: w.T.reshape(c.d_model, c.kv_heads, c.head_dim)),
    "self_attn.v_proj.weight": ("wv", lambda w, c: w.T.reshape(c.d_model, c.kv_heads, c.head_dim)),
    "self_attn.o_proj.weight": ("wo", lambda w, c: w.T.reshape(c.heads, c.head_dim, c.d_model)),
    "post_attention_layernorm.weight": ("mlp_norm", lambda w, c: w),
    "mlp.gate_proj.weight": ("w_gate", lambda w, c: w.T),
    "mlp.up_proj.weight": ("w_up", lambda w, c: w.T),
    "mlp.down_proj.weight": ("w_down", lambda w, c: w.T),
}

_LAYER_EXPORT = {
    "attn_norm": ("input_layernorm.weight", lambda w, c: w),
    "wq": ("self_attn.q_proj.weight", lambda w, c: w.reshape(c.d_model, c.heads * c.head_dim).T),
    "wk": ("self_attn.k_proj.weight", lambda w, c: w.reshape(c.d_model, c.kv_heads * c.head_dim).T),
    "wv": ("self_attn.v_proj.weight", lambda w, c: w.reshape(c.d_model, c.kv_heads * c.head_dim).T),
    "wo": ("self_attn.o_proj.weight", lambda w, c: w.reshape(c.heads * c.head_dim, c.d_model).T),
    "mlp_norm": ("post_attention_layernorm.weight", lambda w, c: w),
    "w_gate": ("mlp.gate_proj.weight", lambda w, c: w.T),
    "w_up": ("mlp.up_proj.weight", lambda w, c: w.T),
    "w_down": ("mlp.down_proj.weight", lambda w, c: w.T),
}


def _rope_kind(rope: dict) -> dict:
    """A RoPE dict without its base and with `type` spelled `rope_type`, for comparing the two layouts."""
    kind = {("rope_type" if key == "type" else key): value for key, value in rope.items() if key != "rope_theta"}
    kind.setdefault("rope_type", "default")
    return kind


def _rope_theta(hf: dict) -> float:
    """RoPE base from either config generation, refusing any scaled variant and any disagreement.

    transformers >= 5 writes `rope_parameters: {rope_type, rope_theta}`; older
    versions write a top-level `rope_theta` and an optional `rope_scaling`
    whose kind is under `rope_type` (or the older `type`). A config may carry
    both; then they must describe the same RoPE, and every `rope_theta` must match.
    """
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    if params and scaling and _rope_kind(params) != _rope_kind(scaling):
        raise ValueError(f"rope_scaling: {json.dumps(scaling)} disagrees with rope_parameters {json.dumps(params)}; "
                         "keep one, or make them describe the same RoPE")
    thetas = {where: float(rope["rope_theta"]) for where, rope in
              (("rope_parameters", params), ("rope_scaling", scaling), ("top-level", hf))
              if rope.get("rope_theta") is not None}
    if len(set(thetas.values())) > 1:
        found = ", ".join(f"{where} {theta:g}" for where, theta in thetas.items())
        raise ValueError(f"rope_theta: the config gives different values ({found}); make them equal")
    kind = _rope_kind(params or scaling)["rope_type"]
    if kind != "default":
        field = "rope_parameters" if params else "rope_scaling"
        raise ValueError(f"{field}: rope type {kind!r} is not supported (only unscaled 'default' RoPE)")
    return next(iter(thetas.values()), 10000.0)


def _mixtral_moe(hf: dict) -> MoEConfig:
    """The MoE half of a Mixtral config, refusing what MixtralForCausalLM computes and jaxpar does not."""
    if hf.get("sliding_window") is not None:
        raise ValueError(f"sliding_window: {hf['sliding_window']} is not supported (jaxpar's attention is full "
                         "causal); only checkpoints with sliding_window null load")
    if hf.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise: {hf['router_jitter_noise']} is not supported (only 0; jaxpar's "
                         "noisy router is Shazeer's gating, model.moe.router=noisy)")
    experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok: {top_k} must be in 1..num_local_experts={experts}")
    return MoEConfig(experts=experts, top_k=top_k, expert_mlp_dim=hf["intermediate_size"], router="softmax",
                     normalize_top_k=True, dispatch="dropless",
                     balance_loss=float(hf.get("router_aux_loss_coef", 0.001)), z_loss=0.0)


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a parsed HF `config.json`, or a ValueError naming the unsupported field."""
    kind = hf.get("model_type", "llama")
    if kind not in ("llama", "mixtral"):
        raise ValueError(f"model_type: {kind!r} is not supported (only 'llama' and 'mixtral')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise ValueError(f"{flag}: biases are not supported (jaxpar's Llama has no bias terms)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):   # transformers maps both names to SiLU
        raise ValueError(f"hidden_act: {hf['hidden_act']!r} is not supported (only 'silu' or 'swish', i.e. SwiGLU)")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),  # only used if training restarts from init
        moe=_mixtral_moe(hf) if kind == "mixtral" else None,
    )


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor in the checkpoint as float32 numpy, single-file or sharded."""
    if (path / _SINGLE_FILE).exists():
        files = [path / _SINGLE_FILE]
    elif (path / _INDEX_FILE).exists():
        weight_map = json.loads((path / _INDEX_FILE).read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(f"{path}: no {_SINGLE_FILE} or {_INDEX_FILE} (only safetensors checkpoints load)")
    tensors = {}
    for file in files:
        # framework="np" reads bf16 as ml_dtypes.bfloat16; astype widens it (and fp16) exactly.
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).astype(np.float32)
    return tensors


def _mixtral_layer(take, i: int, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Layer i's router and experts in jaxpar's layout, from whichever layout the checkpoint uses."""
    assert cfg.moe is not None, "a Mixtral layer belongs to an MoE model"
    D, E, F = cfg.d_model, cfg.moe.experts, cfg.moe.expert_mlp_dim
    prefix = f"model.layers.{i}."
    if take.has(prefix + "mlp.gate.weight"):                  # transformers >= 5: fused experts
        gate_up = take(prefix + "mlp.experts.gate_up_proj", (E, 2 * F, D))
        return {"router": take(prefix + "mlp.gate.weight", (E, D)).T,
                "expert_gate": gate_up[:, :F].transpose(0, 2, 1), "expert_up": gate_up[:, F:].transpose(0, 2, 1),
                "expert_down": take(prefix + "mlp.experts.down_proj", (E, D, F)).transpose(0, 2, 1)}
    moe = prefix + "block_sparse_moe."
    experts = [[take(f"{moe}experts.{j}.{w}.weight", shape).T for j in range(E)]
               for w, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F)))]
    return {"router": take(moe + "gate.weight", (E, D)).T, "expert_gate": np.stack(experts[0]),
            "expert_up": np.stack(experts[1]), "expert_down": np.stack(experts[2])}


class _Taker:
    """Pops named tensors from a checkpoint, checking each one's shape against the config."""

    def __init__(self, tensors: dict, path: Path):
        self.tensors, self.path = tensors, path

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: checkpoint has no tensor {name!r}")
        value = self.tensors.pop(name)
        if value.shape != shape:
            raise ValueError(f"{name}: shape {value.shape} does not match config (expected {shape})")
        return value


def load_hf_mixtral(path) -> tuple[ModelConfig, dict]:
    """Load a HF MixtralForCausalLM directory (see `load_hf_llama`; the same loader reads both)."""
    return load_hf_llama(path)


def load_hf_llama(path) -> tuple[ModelConfig, dict]:
    """Load a HF LlamaForCausalLM (or MixtralForCausalLM) directory as (ModelConfig, fp32 jax params).

    The checkpoint's dtype does not matter: everything becomes fp32 master
    weights, as the strategy expects. Tensors the model does not use are an
    error (they would mean a different architecture), except RoPE's cached
    `inv_freq` buffers that old checkpoints carry.
    """
    path = Path(path)
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    tensors = _read_tensors(path)
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]

    take = _Taker(tensors, path)

    D, F, V = cfg.d_model, cfg.mlp_dim, cfg.vocab_size
    hf_shapes = {  # [out, in] shapes of each per-layer tensor, to catch a config/weights mismatch early
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (cfg.heads * cfg.head_dim, D),
        "self_attn.k_proj.weight": (cfg.kv_heads * cfg.head_dim, D),
        "self_attn.v_proj.weight": (cfg.kv_heads * cfg.head_dim, D),
        "self_attn.o_proj.weight": (D, cfg.heads * cfg.head_dim),
        "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
    }
    blocks = {}
    for suffix, (key, convert) in _LAYER_IMPORT.items():
        if cfg.moe and suffix.startswith("mlp."):
            continue
        per_layer = [convert(take(f"model.layers.{i}.{suffix}", hf_shapes[suffix]), cfg) for i in range(cfg.layers)]
        blocks[key] = np.stack(per_layer)
    if cfg.moe:   # Mixtral: every layer is MoE, so the one stack is `moe_blocks`
        layers = [_mixtral_layer(take, i, cfg) for i in range(cfg.layers)]
        blocks.update({key: np.stack([layer[key] for layer in layers]) for key in layers[0]})

    params: dict[str, Any] = {"embed": take("model.embed_tokens.weight", (V, D)),
                              "moe_blocks" if cfg.moe else "blocks": blocks,
                              "final_norm": take("model.norm.weight", (D,))}
    if cfg.tie_embeddings:
        head = tensors.pop("lm_head.weight", None)  # some writers store the tied copy too; it must be a copy
        if head is not None and not np.array_equal(head, params["embed"]):
            raise ValueError(f"tie_word_embeddings: true, but lm_head.weight in {path} differs from "
                             "model.embed_tokens.weight; set tie_word_embeddings to false to load the separate head")
    else:
        params["lm_head"] = take("lm_head.weight", (V, D)).T
    if tensors:
        extra = sorted(tensors)
        raise ValueError(f"{path}: {len(extra)} unexpected tensor(s), e.g. {extra[:3]} (not a plain "
                         f"{'Mixtral' if cfg.moe else 'Llama'}?)")
    return cfg, jax.tree.map(lambda a: jnp.asarray(np.ascontiguousarray(a)), params)


def _check_mixtral_export(cfg: ModelConfig) -> None:
    """Refuse (ValueError, one line) an MoE model MixtralForCausalLM would compute differently."""
    moe = cfg.moe
    assert moe is not None, "only an MoE model exports as Mixtral"
    for field, value, wanted in (("dense_layers", moe.dense_layers, 0), ("shared_experts", moe.shared_experts, 0),
                                 ("router", moe.router, "softmax"), ("normalize_top_k", moe.normalize_top_k, True)):
        if value != wanted:
            raise ValueError(f"model.moe.{field}: is {value!r}; MixtralForCausalLM needs {wanted!r} "
                             "(only Mixtral-style MoE models export)")


def config_to_hf(cfg: ModelConfig) -> dict:
    """The `config.json` fields transformers needs to rebuild this model as LlamaForCausalLM (MixtralForCausalLM).

    RoPE's base is written both ways (top-level `rope_theta` for transformers 4,
    `rope_parameters` for 5), and the dtype both as `torch_dtype` (4) and `dtype` (5).
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
        "dtype": "float32",
    } if not cfg.moe else _mixtral_config_to_hf(cfg)


def _mixtral_config_to_hf(cfg: ModelConfig) -> dict:
    _check_mixtral_export(cfg)
    assert cfg.moe is not None, "only an MoE model exports as Mixtral"
    dense = config_to_hf(ModelConfig(**{**cfg.__dict__, "moe": None, "mlp_dim": cfg.moe.expert_mlp_dim}))
    drop = ("attention_bias", "mlp_bias")
    return {**{k: v for k, v in dense.items() if k not in drop}, "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "num_local_experts": cfg.moe.experts, "num_experts_per_tok": cfg.moe.top_k,
            "router_aux_loss_coef": cfg.moe.balance_loss, "router_jitter_noise": 0.0, "sliding_window": None,
            "output_router_logits": False}


def _token_ids(name: str, value, vocab_size: int) -> int | list[int]:
    """`value` (one id or a list of ids) as JSON-ready ints, or a ValueError naming `name`."""
    ids = value if isinstance(value, (list, tuple)) else [value]
    if not ids or not all(isinstance(i, (int, np.integer)) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"{name}: {value!r} is not a token id (or list of ids) in 0..{vocab_size - 1}")
    ids = [int(i) for i in ids]
    return ids if isinstance(value, (list, tuple)) else ids[0]


def export_hf_mixtral(params: dict, cfg: ModelConfig, path, bos_token_id=None, eos_token_id=None) -> None:
    """Write a Mixtral-style MoE model as a HF MixtralForCausalLM directory (see `export_hf_llama`)."""
    export_hf_llama(params, cfg, path, bos_token_id, eos_token_id)


def export_hf_llama(params: dict, cfg: ModelConfig, path, bos_token_id=None, eos_token_id=None) -> None:
    """Write `params` as a HF Llama (Mixtral, for an MoE model) directory (config.json,
    generation_config.json, fp32 model.safetensors).

    The BOS/EOS ids, when given, go into both JSON files: without them transformers
    assumes Llama's defaults (1 and 2), which are not this tokenizer's.
    `path` must be new or an empty directory: a checkpoint directory is never
    partly overwritten, so an old export cannot end up mixed with a new one.
    """
    path = Path(path)
    hf_config = config_to_hf(cfg)          # refuses an MoE model Mixtral cannot express, before anything else
    special = {name: _token_ids(name, value, cfg.vocab_size)
               for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id))
               if value is not None}
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path}: exists and is not an empty directory; export into a new one")
    host = jax.tree.map(lambda a: np.asarray(jax.device_get(a), dtype=np.float32), params)

    tensors = {"model.embed_tokens.weight": host["embed"], "model.norm.weight": host["final_norm"]}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = host["lm_head"].T
    layers = host["moe_blocks" if cfg.moe else "blocks"]
    for key, (suffix, convert) in _LAYER_EXPORT.items():
        if key in layers:
            for i in range(cfg.layers):
                tensors[f"model.layers.{i}.{suffix}"] = convert(layers[key][i], cfg)
    if cfg.moe:
        for i in range(cfg.layers):
            moe = f"model.layers.{i}.block_sparse_moe."
            tensors[moe + "gate.weight"] = layers["router"][i].T
            for j in range(cfg.moe.experts):
                for w, key in (("w1", "expert_gate"), ("w3", "expert_up"), ("w2", "expert_down")):
                    tensors[f"{moe}experts.{j}.{w}.weight"] = layers[key][i, j].T
    tensors = {name: np.ascontiguousarray(value) for name, value in tensors.items()}

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf_config, **special}, indent=2) + "\n")
    # No "transformers_version": GenerationConfig.from_pretrained does not need it.
    (path / "generation_config.json").write_text(json.dumps(special, indent=2) + "\n")
    # transformers refuses safetensors files whose metadata lacks a known "format".
    save_file(tensors, str(path / _SINGLE_FILE), metadata={"format": "pt"})

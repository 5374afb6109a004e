"""Which implementation of attention, norm and loss a run uses: `model.attention`, `model.norm`, `model.loss`.

| field           | choices                                   | what each is                                        |
|-----------------|-------------------------------------------|-----------------------------------------------------|
| model.attention | dot                                       | jaxpar's einsum attention: full [S, S] fp32 scores   |
|                 | xla                                       | `jax.nn.dot_product_attention(implementation="xla")` |
|                 | cudnn                                     | the same call, `implementation="cudnn"`: cuDNN's     |
|                 |                                           | fused flash attention (NVIDIA GPU, bf16/fp16)        |
|                 | pallas                                    | jaxpar's flash attention kernel (kernels/)           |
| model.norm      | xla (plain jnp, XLA fuses it) or pallas   | RMSNorm                                              |
| model.loss      | full (fp32 [B, S, V] logits) or chunked   | the head's cross-entropy                             |

`auto` picks, per backend (the platform of the mesh's devices, so a deviceless H100 dry run
picks GPU kernels): GPU: cudnn attention for bf16 activations (its kernel needs 16-bit
inputs), pallas for fp32 (xla if the head dim is not a power of two); pallas norm; chunked loss.
CPU: dot attention and xla norm (interpreted Pallas is for checking kernels, ~100x slower), chunked loss.
TPU: xla attention and norm (jaxpar's kernels are written for Triton), chunked loss.

Kernels the SPMD partitioner cannot split (a Pallas or cuDNN custom call would be run
replicated: every device gathering the whole batch) run through `shard_local`: a shard_map
over the mesh axes still left to the partitioner, with specs from the logical-axis rules
(batch and heads split, the sequence whole), so each device runs the kernel on its own shard.
Inside a manual strategy's shard_map those axes are already manual, and the kernels read
their (local) sizes from the shapes.
"""
from __future__ import annotations

from functools import partial
from typing import Literal

import jax

from jaxpar.config import KERNEL_CHOICES, ConfigError, head_dim
from jaxpar.config_checks import check_kernel_choices, flash_tileable
from jaxpar.kernels.cross_entropy import chunked_cross_entropy
from jaxpar.kernels.flash_attention import flash_attention
from jaxpar.kernels.rms_norm import rms_norm as fused_rms_norm
from jaxpar.model.ops import Ops, cross_entropy, dot_attention, rms_norm

# logical names of the kernels' operands for shard_local (None: that dimension stays whole on every device)
_Q, _KV = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
_ROWS = ("batch", "length", None)


def platform_of(mesh) -> str:
    """'gpu', 'cpu' or 'tpu' for a mesh's devices (CUDA/ROCm devices and deviceless GPU topologies are 'gpu')."""
    platform = str(mesh.devices.flat[0].platform).lower()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def interpreted_pallas(config, platform: str) -> bool:
    """Whether the run calls a Pallas kernel interpreted (on CPU): a manual strategy then turns off check_vma.

    JAX's CPU interpreter of `pallas_call` re-evaluates the kernel body while the enclosing
    `shard_map(check_vma=True)` is lowered, with every loaded block typed as varying: a block
    meeting a constant (`x / width`) or a loop carry fails the check, although each device's
    values are right. On GPU the kernel is one opaque call and the check passes.
    """
    return platform == "cpu" and "pallas" in (config.model.attention, config.model.norm)


def resolve(config, platform: str, activation_dtype) -> dict[str, str]:
    """The concrete implementation of each op (`auto` decided), checked against the backend and strategy."""
    model = config.model
    half = jax.numpy.dtype(activation_dtype).itemsize == 2
    flash = "pallas" if flash_tileable(head_dim(model)) else "xla"      # the head dims the kernel takes
    auto = {"gpu": {"attention": "cudnn" if half else flash, "norm": "pallas", "loss": "chunked"},
            "cpu": {"attention": "dot", "norm": "xla", "loss": "chunked"}}.get(
        platform, {"attention": "xla", "norm": "xla", "loss": "chunked"})
    check_kernel_choices(model)
    chosen = {op: auto[op] if model[op] == "auto" else model[op] for op in KERNEL_CHOICES}
    if chosen["attention"] == "cudnn":
        if platform != "gpu":
            raise ConfigError("model.attention", f"cudnn needs an NVIDIA GPU, the mesh is on {platform}; "
                              f"valid here: dot, xla, pallas, auto")
        if not half:
            raise ConfigError("model.attention", "cudnn attention takes bf16/fp16 inputs; set "
                              "train.compute_dtype=bfloat16, or use pallas/xla/dot for float32")
    for op in ("attention", "norm"):
        if chosen[op] != "pallas":
            continue
        if platform not in ("gpu", "cpu"):
            raise ConfigError(f"model.{op}", f"jaxpar's Pallas kernels lower through Triton (GPU) or run "
                              f"interpreted (CPU), not on {platform}; use xla")
    return chosen


def kernel_ops(base: Ops, config, platform: str, rules=None) -> Ops:
    """`base` with the attention, norm and cross-entropy `config.model.*` selects for `platform`.

    `rules` (an AxisRules) puts the kernels the partitioner cannot split under `shard_local`.
    """
    model = config.model
    chosen = resolve(config, platform, base.dtype)
    interpret = platform == "cpu"
    wrap = (lambda fn, ins, out: shard_local(fn, rules, ins, out)) if rules is not None else (lambda fn, ins, out: fn)
    attention = {
        "dot": dot_attention,
        "xla": partial(library_attention, implementation="xla"),
        "cudnn": wrap(partial(library_attention, implementation="cudnn"), (_Q, _KV, _KV), _Q),
        "pallas": wrap(partial(flash_attention, causal=True, block_q=model.attention_block_q,
                               block_k=model.attention_block_kv, interpret=interpret), (_Q, _KV, _KV), _Q),
    }[chosen["attention"]]
    norm = rms_norm if chosen["norm"] == "xla" else _pallas_norm(wrap, interpret)
    loss = cross_entropy if chosen["loss"] == "full" else partial(chunked_cross_entropy, chunk=model.loss_chunk)
    return base.replace(attention=attention, norm=norm, cross_entropy=loss)


# ----------------------------------------------------------------------------- the implementations

def library_attention(q, k, v, *, implementation: Literal["xla", "cudnn"]):
    """jax.nn.dot_product_attention, causal, grouped-query (it takes KV heads dividing the query heads)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _pallas_norm(wrap, interpret: bool):
    def norm(x, scale, eps):
        return wrap(partial(fused_rms_norm, eps=eps, interpret=interpret), (_ROWS, (None,)), _ROWS)(x, scale)
    return norm


# ----------------------------------------------------------------------------- per-device kernels

def shard_local(fn, rules, in_names, out_names):
    """`fn` run by every device on its own shard, with specs from the logical-axis rules.

    At trace time: the mesh axes of size > 1 that are still Auto (not made manual by an
    enclosing shard_map) become manual here, each operand split as `rules.spec(names)`
    says. With no such axis (one device, or inside a fully manual strategy) `fn` is called
    as is. check_vma=False: the kernels are pure per-shard functions of their operands.
    """
    def run(*args):
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else tuple(a for a in mesh.axis_names
                                           if a not in mesh.manual_axes and mesh.shape[a] > 1)
        if not axes:
            return fn(*args)
        in_specs = tuple(rules.spec(names, axes) for names in in_names)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=rules.spec(out_names, axes),
                             axis_names=set(axes), check_vma=False)(*args)
    return run

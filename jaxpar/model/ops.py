"""What a strategy or a kernel may swap inside the one forward pass: the `Ops` bundle.

The model (`model/transformer.py`) is written once. A single device, the
compiler-driven strategies, manual tensor parallelism, ZeRO-2/3 or a fused kernel
differ only in the functions they put in this bundle: how weights are fetched before
use (cast, ZeRO-3's all-gather), the matmul (FP8), the attention core, the norm, the
embedding lookup and the cross-entropy (vocab-parallel), the hooks around the
column- and row-parallel matmuls (Megatron's f and g), and how activations are pinned
to the mesh. The defaults below are the plain single-device reference of each op.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.model.fp8 import fp8_einsum

# train.compute_dtype -> the dtype `precision` takes. "float8" is FP8 matmuls (e4m3 forward, e5m2
# gradients) between bfloat16 activations: see model/fp8.py.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float8": jnp.float8_e4m3fn}


def precision(compute_dtype) -> tuple[Any, Callable]:
    """(activation dtype, einsum for the activation x weight matmuls) of a compute dtype.

    float32 and bfloat16: that dtype and `jnp.einsum`. float8 is a recipe, not an activation
    dtype: activations stay bfloat16 and the weight matmuls run as `fp8.fp8_einsum`.
    """
    if jnp.dtype(compute_dtype) == jnp.float8_e4m3fn:
        return jnp.bfloat16, fp8_einsum
    return compute_dtype, jnp.einsum


# ----------------------------------------------------------------------------- reference ops

def rms_norm(x, scale, eps):
    """RMSNorm in fp32 whatever the activation dtype (as Hugging Face's Llama)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def dot_attention(q, k, v):
    """Causal grouped-query attention with the full S x S scores: q [B,S,H,Dh], k/v [B,S,KV,Dh].

    Head and group counts come from the shapes, so the same code runs on a device's local
    heads under tensor parallelism. Scores and softmax are fp32.
    """
    B, S, H, Dh = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(B, S, kv_heads, H // kv_heads, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / jnp.sqrt(Dh).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((S, S), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(B, S, H, Dh)


def gather_embedding(tokens, table):
    """Embedding lookup as a gather (no one-hot matmul: that costs 2·B·S·V·D FLOPs forward)."""
    return jnp.take(table, tokens, axis=0)


def cross_entropy(x, head, targets, ops: Ops):
    """Mean next-token cross-entropy from the final hidden states: full fp32 logits, then optax."""
    logits = ops.constrain(ops.logits(x, head), ACTIVATION_AXES["logits"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _identity(x):
    return x


def _fetch_as_is(name, weights):
    return weights


def _no_constraint(x, names):
    return x


@dataclasses.dataclass(frozen=True)
class Ops:
    """The swappable operations of the forward pass (see the module docstring)."""

    dtype: Any = jnp.float32                   # activations and cast weights
    matmul: Callable = jnp.einsum              # activation x weight einsum (fp8_einsum for float8)
    attention: Callable = dot_attention        # (q, k, v) -> out, causal
    positions: Callable = jnp.arange           # (seq_len) -> each row's position, for RoPE (context parallelism:
                                               # its load-balanced chunk order)
    norm: Callable = rms_norm                  # (x, scale, eps) -> x
    embed: Callable = gather_embedding         # (tokens, table) -> x
    cross_entropy: Callable = cross_entropy    # (x, head, targets, ops) -> mean loss
    fetch: Callable = _fetch_as_is             # (param name, cast weights) -> weights used (ZeRO-3: gather)
    column_in: Callable = _identity            # before column-parallel matmuls (Megatron's f)
    row_out: Callable = _identity              # after row-parallel matmuls (Megatron's g)
    constrain: Callable = _no_constraint       # (x, logical names) -> x pinned to the mesh
    layers: Callable | None = None             # (stored dense blocks, x, block(x, w)) -> (x, aux): a hand-written
                                               # layer loop (ZeRO-3 prefetch); None: jax.lax.scan

    def weights(self, name: str, stored):
        """The weights a layer computes with: `stored` cast to the compute dtype, then fetched."""
        return self.fetch(name, jax.tree.map(lambda w: w.astype(self.dtype), stored))

    def logits(self, x, head):
        """The output head's matmul in the compute dtype, upcast to fp32 after (as PyTorch's autocast does):
        softmax and loss see fp32, and the two backward matmuls stay in the compute dtype."""
        return self.matmul("bsd,dv->bsv", x, head).astype(jnp.float32)

    def replace(self, **changes) -> Ops:
        return dataclasses.replace(self, **changes)


def make_ops(compute_dtype: str = "float32", rules=None) -> Ops:
    """The reference ops for `train.compute_dtype`, pinning activations with `rules` (an AxisRules) if given."""
    dtype, matmul = precision(DTYPES[compute_dtype])
    return Ops(dtype=dtype, matmul=matmul, constrain=rules.constrain if rules is not None else _no_constraint)

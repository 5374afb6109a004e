"""Context parallelism: the sequence split over the `context` mesh axis (`parallel.context`: ring | all_to_all).

Long sequences outgrow one device's activation memory before the weights do. Here every activation's
sequence axis (`length`, `inner_length`) is split over `context` by the logical-axis rules, so norms, the
MLP, the head and the loss each work on their own rows; only attention needs the other rows' keys and
values, and crosses the split by hand inside `shard_map` (parallel/context_attention.py): a ring of
key/value blocks, or all_to_all between a slice of the sequence and a slice of the heads. Everything else
is the compiler-driven strategy (data, fsdp and tensor stay `auto` and compose).

Positions follow the split: for the ring, the sequence is reordered once, at the embedding and at the loss
targets, into the load-balanced chunk order (`zigzag_order`), and RoPE takes each row's true position from
the same order (`Ops.positions`); the mean loss does not depend on the order. all_to_all keeps the natural
order. The token rows themselves reach every device of a context group whole ([B, S+1] int32, 4 bytes a
token): the split starts at the embedding. `predict` is in parallel/context_predict.py.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import CONTEXT_IMPLS, ConfigError, validate_context
from jaxpar.kernels.flash_attention import flash_attention_with_lse
from jaxpar.kernels.kernel_ops import platform_of, resolve
from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.context_attention import all_to_all_attention, block_attention, ring_attention, zigzag_order
from jaxpar.parallel.context_predict import predict

AXIS = "context"


def split_attention(impl: str, rules, *, inner: Callable, block: Callable = block_attention) -> Callable:
    """(q, k, v) of the whole program -> attention, each device working on its slice of the sequence.

    A shard_map over every mesh axis still left to the partitioner (as `kernels.kernel_ops.shard_local`):
    batch, sequence (`context`) and heads (`tensor`) split as the rules say. `inner`: the attention
    all_to_all runs on whole sequences; `block`: the ring's chunk-pair attention.
    """
    def body(q, k, v):
        if impl == "ring":
            return ring_attention(q, k, v, axis=AXIS, block=block)
        return all_to_all_attention(q, k, v, axis=AXIS, attention=inner)

    def run(q, k, v):
        mesh = jax.sharding.get_abstract_mesh()
        axes = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)
        if AXIS not in axes:
            axes += (AXIS,)            # a context of one: the ring is one device (no ppermute), still exact
        q_spec, kv_spec = rules.spec(ACTIVATION_AXES["heads"], axes), rules.spec(ACTIVATION_AXES["kv_heads"], axes)
        return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             axis_names=set(axes), check_vma=False)(q, k, v)
    return run


def flash_block(*, block_q: int, block_k: int, interpret: bool) -> Callable:
    """The ring's chunk-pair attention as jaxpar's Pallas flash kernel (model.attention=pallas): its forward
    keeps the log-sum-exp the merge needs, and its backward takes that statistic's cotangent too."""
    def block(q, k, v, causal):
        out, lse = flash_attention_with_lse(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                            interpret=interpret)
        return out.astype(jnp.float32), lse
    return block


def in_order(order, embed: Callable, cross_entropy: Callable) -> dict[str, Callable]:
    """The ops that put the sequence into `order`: embedding, targets, positions. (The natural order too is
    taken by index: sliced, the token rows would be resharded over context, a halo exchange per step.)"""
    index = jnp.asarray(order)
    return {"embed": lambda tokens, table: embed(tokens[:, index], table),
            "cross_entropy": lambda x, head, targets, ops: cross_entropy(x, head, targets[:, index], ops),
            "positions": lambda seq_len: index}


class ContextStrategy(AutoStrategy):
    """The compiler-driven strategy with attention across a sequence split over `context` by hand."""

    RUNS = {"context": CONTEXT_IMPLS}

    @classmethod
    def check(cls, config, sizes: dict[str, int]) -> None:
        validate_context(config, sizes)
        cls._check_loss(config.model.loss)

    @staticmethod
    def _check_loss(loss: str) -> None:
        if loss == "chunked":
            raise ConfigError("model.loss", "is chunked, whose chunks are slices of the whole sequence: across the "
                              "context split the partitioner gathers each one; use full (each device's logits "
                              "are its S/context rows)")

    def with_ops(self, ops):
        impl, context = self.config.parallel.context, int(self.mesh.shape[AXIS])
        seq_len = self.config.data.seq_len
        order = zigzag_order(seq_len, context) if impl == "ring" else np.arange(seq_len)
        platform = platform_of(self.mesh)
        chosen = resolve(self.config, platform, ops.dtype)
        self._check_loss(chosen["loss"])
        block = block_attention
        if chosen["attention"] == "pallas":
            model = self.config.model
            block = flash_block(block_q=model.attention_block_q, block_k=model.attention_block_kv,
                                interpret=platform == "cpu")
        return ops.replace(attention=split_attention(impl, self.rules, inner=ops.attention, block=block),
                           **in_order(order, ops.embed, ops.cross_entropy))

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

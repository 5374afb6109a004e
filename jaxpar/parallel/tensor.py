"""Course module 3 by hand: Megatron tensor parallelism over `tensor` (optionally with sequence
parallelism), composed with data parallelism over `data`, as one `shard_map` program.

The automatic trainer (`parallel/auto.py`) states where the weights live and XLA writes the
collectives. Here every collective is one of Megatron's operators (`parallel/megatron.py`),
injected into the unchanged model through `Ops`:

  column-parallel  wq, wk, wv, w_gate, w_up, the output head: each device holds 1/t of the
                   output columns (heads, MLP hidden units, vocabulary); f before them
  row-parallel     wo, w_down: 1/t of the input rows, a partial sum out; g after them
  vocabulary       the embedding looks up its own rows and sums with g; the cross-entropy
                   reduces max, sum of exponentials and target logit over the shards

Per layer per step that is 4 all-reduces of b·s·h (f and g, forward and backward).
With `parallel.sequence=true` (Korthikanti et al. 2022) the norms and residual adds see
s/t tokens per device: all-gather before the column-parallel matmuls, reduce-scatter after
the row-parallel ones, the same bytes, plus one all-gather per column-parallel input in the
backward pass (only the s/t shard is kept for it, as in Megatron-LM: `regather`). The norm
weights then see only a device's tokens, so their gradients are summed over `tensor`.

The data axis is DDP by hand: each (data) row of devices computes the gradient of its
batch shard, which is averaged over `data` with one `pmean` after the backward pass.
What the registry runs here: parallel.tensor=manual with parallel.data=auto or ddp (both
mean this DDP), mesh.fsdp = pipe = expert = 1, no parallel.rules overrides. Anything else is
refused with one line. The state is every trainer's (same pytree, same global shapes):
params and Adam moments split over `tensor` as the default rules say, replicated over `data`.
Under `train.compute_dtype=float8` each device scales its own shards (per-shard amax), so the
losses are close to, not equal to, one device's. `predict` (end of file): these collectives' bytes.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.transformer import cross_entropy_and_aux, loss
from jaxpar.parallel.megatron import sequence_parallel_ops, sequence_parallel_policy, tensor_parallel_ops
from jaxpar.parallel.step import accumulate, clip_to_norm
from jaxpar.parallel.strategy import Strategy
from jaxpar.parallel.theory import (
    OTHER_WEIGHTS,
    WEIGHTS_PER_LAYER,
    Candidate,
    Flow,
    Prediction,
    stored_params,
    wire_bytes,
)

AXIS = "tensor"
DATA = "data"


def _is_split(spec: P) -> bool:
    return AXIS in jax.tree.leaves(tuple(spec))


class TensorTrainer(Strategy):
    """Manual Megatron TP (+ SP) over `tensor`, DDP over `data`; checkpoints interchange with every trainer."""

    RUNS = {"tensor": ("manual",), "data": ("ddp",)}
    PLANNED: dict = {}   # the planner ranks the automatic tensor axis (same bytes without sequence parallelism)

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

    @classmethod
    def check(cls, config, sizes):
        others = [f"mesh.{axis}={size}" for axis, size in sizes.items() if axis not in (AXIS, DATA) and size > 1]
        if others:
            raise ConfigError("parallel.tensor", f"manual runs over mesh.tensor and mesh.data only, but "
                              f"{', '.join(others)}; set those axes to 1 or use parallel.tensor=auto")
        if config.parallel.rules.strip():
            raise ConfigError("parallel.rules", "parallel.tensor=manual places every array itself (Megatron's "
                              "layout); leave parallel.rules empty or use parallel.tensor=auto")

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None, *, regather: bool = True):
        """`regather=False` (lab only) keeps the gathered [b, s, h] input of each column-parallel layer for
        the backward pass instead of gathering it again: exactly TP's bytes, less memory saved."""
        super().__init__(config, model_cfg, mesh, donate)
        self.t, self.d = int(mesh.shape[AXIS]), int(mesh.shape[DATA])
        if model_cfg.vocab_size % self.t:
            raise ConfigError("model.vocab_size", f"{model_cfg.vocab_size} is not divisible by mesh.tensor={self.t} "
                              "(the vocabulary-parallel embedding and head split it)")
        self.sequence = bool(config.parallel.sequence)
        if self.sequence:
            self.ops = sequence_parallel_ops(self.ops, AXIS)
            if regather:
                self.policy = sequence_parallel_policy(self.policy)
        else:
            self.ops = tensor_parallel_ops(self.ops, AXIS)

        abstract = jax.eval_shape(self.make_state)       # the same pytree as every trainer's
        self.param_specs = self.rules.tree_specs(model_cfg.param_axes(), (AXIS,))
        self.state_specs = self._state_layout(abstract, self.param_specs, replicated=P())
        self.state_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs)
        self.param_shardings = self.state_shardings["params"]
        self.batch_sharding = NamedSharding(mesh, P(DATA, None))
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)

        replicated = NamedSharding(mesh, P())
        shard = partial(jax.shard_map, mesh=mesh, check_vma=False)   # every collective is written out
        step = shard(self._local_step, in_specs=(self.state_specs, P(DATA, None)), out_specs=(self.state_specs, P()))
        self.step_fn = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        evaluate = shard(self._local_eval, in_specs=(self.param_specs, P(DATA, None)), out_specs=P())
        self.eval_fn = jax.jit(evaluate, in_shardings=(self.param_shardings, self.batch_sharding),
                               out_shardings=replicated)
        # (loss, mean gradient) of a batch in the state's layout: for tests and the lab, not the loop
        grads = shard(self._local_grads, in_specs=(self.param_specs, P(DATA, None)), out_specs=(P(), self.param_specs))
        self.grad_fn = jax.jit(grads)

    # ---------------------------------------------------------------- per-device program
    def _local_grads(self, params, tokens):
        """Loss and gradient of the whole batch on this device's shards: Megatron's collectives inside the
        forward and backward pass, then SP's norm-weight sums over `tensor` and DDP's mean over `data`."""
        objective = partial(loss, cfg=self.model_cfg, ops=self.ops, remat_policy=self.policy)
        (_, metrics), grads = accumulate(jax.value_and_grad(objective, has_aux=True), params, tokens,
                                         self.microbatches)
        if self.sequence:   # a replicated weight used on s/t tokens: each device holds a partial gradient
            grads = jax.tree.map(lambda g, spec: g if _is_split(spec) else jax.lax.psum(g, AXIS),
                                 grads, self.param_specs)
        return jax.lax.pmean(metrics, DATA), jax.lax.pmean(grads, DATA)   # ALL-REDUCE over data (DDP)

    def _global_norm(self, grads):
        """L2 norm of the whole gradient: split leaves summed over `tensor`, replicated ones counted once."""
        square = lambda leaves: sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves), jnp.float32(0))
        flat, specs = jax.tree.leaves(grads), jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P))
        split = square(g for g, s in zip(flat, specs) if _is_split(s))
        whole = square(g for g, s in zip(flat, specs) if not _is_split(s))
        return jnp.sqrt(jax.lax.psum(split, AXIS) + whole)

    def _local_step(self, state, tokens):
        params = state["params"]
        metrics, grads = self._local_grads(params, tokens)
        norm = self._global_norm(grads)
        grads = clip_to_norm(grads, norm, self.config.train.grad_clip)   # by the true global norm
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        metrics = {**metrics, "grad_norm": norm}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def _local_eval(self, params, tokens):
        return jax.lax.pmean(cross_entropy_and_aux(params, tokens, self.model_cfg, self.ops)[0], DATA)


# ============================================================================ prediction

def layer_units(remat: str, sequence: bool, regather: bool = True) -> int:
    """Collective bytes of one layer, one microbatch, in units u = (T-1)/T·e·b·s·h (an all-reduce of b·s·h is
    2u; an all-gather or reduce-scatter of it, u). See `predict` for what each term is."""
    recompute_row = remat in ("full", "dots")
    if not sequence:
        return 8 + (2 if recompute_row else 0)
    return 8 + (2 if regather or remat != "none" else 0) + (1 if recompute_row else 0)


def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str,
            regather: bool = True) -> Prediction:
    """Bytes each device sends per step, by mesh axis (u = (T-1)/T·e·b·s·h, e = `wire_bytes`, b rows per data
    shard per microbatch, m microbatches).

    tensor, TP  per layer 4 all-reduces of b·s·h = 8u (g after wo and w_down forward, f before q/k/v and
                gate/up backward), +2u with remat full/dots (the attention g is recomputed). Outside the
                layers 4u: the embedding's g forward, the head's f backward.
            SP  the same 8u as 4 all-gathers + 4 reduce-scatters, +2u for gathering each column-parallel input
                again in the backward (`regather`, also whenever remat does not save it), +1u with remat
                full/dots. Outside 4u. Once per step: the norm weights' gradient sum 2(T-1)/T·4·(2L+1)·h.
          both  per microbatch the cross-entropy's three fp32 reductions 3·2(T-1)/T·4·b·s; once per step the
                grad-norm scalar 2(T-1)/T·4.
    data        DDP: one all-reduce of this device's fp32 gradient, 2(D-1)/D·4·(Ψ_split/T + Ψ_norms), + the loss.
    """
    T, D = cand.tensor, cand.data
    m, L, h, s = cand.microbatches, shape.layers, shape.d_model, seq_len
    b = global_batch // m // D
    e = wire_bytes(cand.precision, platform)
    norms = (2 * L + 1) * h
    out = []
    if T > 1:
        u = (T - 1) / T * e * b * s * h
        ring = 2 * (T - 1) / T
        units = layer_units(cand.remat, cand.sequence, regather) * L + 4
        total = m * (units * u + ring * 4 * 3 * b * s) + ring * 4 + (ring * 4 * norms if cand.sequence else 0)
        count = m * (units // 2 + 3) + 1
        out.append(Flow("tensor", "reduce-scatter" if cand.sequence else "all-reduce", total, count, False))
    if D > 1:
        psi = shape.counts()["total"]
        out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * 4 * ((psi - norms) / T + norms + 1),
                        WEIGHTS_PER_LAYER + OTHER_WEIGHTS, False))
    return Prediction(out, stored_params(shape, cand))

"""`parallel.tensor=manual`: Megatron tensor parallelism over `tensor` (optionally with sequence
parallelism), DDP over `data` and FSDP over `fsdp` (torchtitan's 2D layout), as one `shard_map` program.

Every collective is one of Megatron's operators (parallel/megatron.py) injected into the unchanged model
through `Ops`. MoE layers split each expert's hidden dimension over `tensor`; with `mesh.expert > 1` and
under SP, parallel/tensor_moe.py adds the exchange and the s/t router. Runs parallel.tensor=manual with
parallel.data=auto|ddp, parallel.expert=auto|manual, mesh.pipe = 1 and no parallel.rules; anything else is
one ConfigError. The state is every strategy's pytree, split over tensor (and fsdp), replicated over data.
`predict` (end of file): these collectives' bytes. How it works and why, with the bytes derived:
experiments/03_tensor/README.md, "How the manual strategies are written".
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.transformer import cross_entropy_and_aux, loss
from jaxpar.parallel.collective_matmul import collective_matmul_ops, ring_policy
from jaxpar.parallel.expert import ExpertStrategy
from jaxpar.parallel.megatron import sequence_parallel_ops, sequence_parallel_policy, tensor_parallel_ops
from jaxpar.parallel.step import accumulate, apply_outside_gradient, clip_to_norm
from jaxpar.parallel.strategy import Strategy
from jaxpar.parallel.tensor_moe import moe_tensor_bytes, tensor_moe_ops
from jaxpar.parallel.theory import (
    OTHER_WEIGHTS,
    WEIGHTS_PER_LAYER,
    Candidate,
    Flow,
    Prediction,
    moe_all_to_all_bytes,
    stored_params,
    wire_bytes,
)
from jaxpar.parallel.zero import STACKS, all_gather_weight, refetch_policy

AXIS = "tensor"
DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
BATCH = (DATA, FSDP)    # (EXPERT, DATA, FSDP) for an MoE model on mesh.expert > 1


def _is_split(spec: P, axis: str = AXIS) -> bool:
    return axis in jax.tree.leaves(tuple(spec))


def _fsdp_dim(spec: P, stacked: bool) -> int:
    """The dimension of a parameter split over `fsdp` as a layer uses it (-1: not split)."""
    dim = next((d for d, entry in enumerate(spec) if FSDP in jax.tree.leaves(entry)), -1)
    return dim - 1 if stacked and dim > 0 else dim


class TensorStrategy(Strategy):
    """Manual Megatron TP (+ SP) over `tensor`, FSDP over `fsdp`, DDP over `data`; checkpoints interchange
    with every strategy."""

    RUNS = {"tensor": ("manual",), "data": ("ddp",), "expert": ("manual",)}
    PLANNED: dict = {}   # the planner ranks the automatic tensor axis (same bytes without sequence parallelism)

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

    @classmethod
    def check(cls, config, sizes):
        others = [f"mesh.{a}={size}" for a, size in sizes.items() if a not in (AXIS, DATA, FSDP, EXPERT) and size > 1]
        if others:
            raise ConfigError("parallel.tensor", f"manual runs over mesh.tensor, mesh.fsdp, mesh.data and mesh.expert "
                              f"only, but {', '.join(others)}; set those axes to 1 or use parallel.tensor=auto")
        if config.parallel.tensor != "manual":
            raise ConfigError("parallel.tensor", f"is '{config.parallel.tensor}' with parallel.expert=manual and "
                              "parallel.data=ddp, which run only under manual TP: set parallel.tensor=manual")
        if config.parallel.expert == "manual":
            ExpertStrategy.check(config, sizes)
        elif sizes.get(EXPERT, 1) > 1:
            raise ConfigError("parallel.expert", f"is '{config.parallel.expert}' with mesh.expert={sizes[EXPERT]}; "
                              "under parallel.tensor=manual the experts' exchange is written by hand: set "
                              "parallel.expert=manual")
        if config.parallel.rules.strip():
            raise ConfigError("parallel.rules", "parallel.tensor=manual places every array itself (Megatron's "
                              "layout); leave parallel.rules empty or use parallel.tensor=auto")

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None, *, regather: bool = True):
        """`regather=False` (lab only) keeps the gathered [b, s, h] input of each column-parallel layer for
        the backward pass instead of gathering it again: exactly TP's bytes, less memory saved."""
        super().__init__(config, model_cfg, mesh, donate)
        self.t, self.d, self.f = int(mesh.shape[AXIS]), int(mesh.shape[DATA]), int(mesh.shape[FSDP])
        self.x = int(mesh.shape[EXPERT])
        self.batch = (EXPERT, *BATCH) if self.x > 1 else BATCH
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
        if model_cfg.moe:    # the balance statistics over the batch, the exchange over `expert`, SP's router
            self.ops = tensor_moe_ops(self.ops, model_cfg.moe, dict(mesh.shape),
                                      tuple(a for a in self.batch if mesh.shape[a] > 1), self.sequence,
                                      config.parallel.expert_exchange)
        self.overlap = config.parallel.tensor_overlap if self.sequence else "none"
        if self.overlap != "none":   # the gathers and reduce-scatters as ppermute rings beside matmuls
            self.ops = collective_matmul_ops(self.ops, AXIS, self.overlap)
            self.policy = ring_policy(self.policy) if regather else self.policy

        abstract = jax.eval_shape(self.make_state)       # the same pytree as every strategy's
        live = tuple(a for a in (AXIS, FSDP, EXPERT) if a == AXIS or mesh.shape[a] > 1)
        self.param_specs = self.rules.tree_specs(model_cfg.param_axes(), live)
        if self.f > 1:   # FSDP: every layer gathers its weights where it runs, and again in the backward pass
            self.fsdp_dims = {name: jax.tree.map(lambda s, stacked=name in STACKS: _fsdp_dim(s, stacked), specs,
                                                 is_leaf=lambda x: isinstance(x, P))
                              for name, specs in self.param_specs.items()}
            self.ops = self.ops.replace(fetch=self._gather)
            self.policy = refetch_policy(self.policy)
        self.state_specs = self._state_layout(abstract, self.param_specs, replicated=P())
        self.state_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs)
        self.param_shardings = self.state_shardings["params"]
        self.batch_sharding = NamedSharding(mesh, P(self.batch, None))
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)

        replicated = NamedSharding(mesh, P())
        shard = partial(jax.shard_map, mesh=mesh, check_vma=False)   # every collective is written out
        step = shard(self._local_step, in_specs=(self.state_specs, P(self.batch, None)),
                     out_specs=(self.state_specs, P()))
        self.step_fn = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        evaluate = shard(self._local_eval, in_specs=(self.param_specs, P(self.batch, None)), out_specs=P())
        self.eval_fn = jax.jit(evaluate, in_shardings=(self.param_shardings, self.batch_sharding),
                               out_shardings=replicated)
        # (loss, mean gradient) of a batch in the state's layout: for tests and the lab, not the loop
        grads = shard(self._local_grads, in_specs=(self.param_specs, P(self.batch, None)),
                      out_specs=(P(), self.param_specs))
        self.grad_fn = jax.jit(grads)

    # ---------------------------------------------------------------- per-device program
    def _gather(self, name, shards):
        """Ops.fetch under FSDP: all-gather over `fsdp` (backward: reduce-scatter) what rests split on it."""
        return jax.tree.map(lambda w, dim: w if dim < 0 else all_gather_weight(w, dim, FSDP), shards,
                            self.fsdp_dims[name])

    def _local_grads(self, params, tokens):
        """Loss and gradient of the whole batch on this device's shards: Megatron's collectives inside the
        forward and backward pass (FSDP's reduce-scatters too), then SP's norm-weight sums over `tensor`, the
        unsplit weights' sums over `fsdp`, the mean over `expert` (the experts' own gradients already hold every
        shard's tokens: the exchange's transpose) and DDP's mean over `data`."""
        objective = partial(loss, cfg=self.model_cfg, ops=self.ops, remat_policy=self.policy)
        (_, metrics), grads = accumulate(jax.value_and_grad(objective, has_aux=True), params, tokens,
                                         self.microbatches)
        if self.sequence:   # a replicated weight used on s/t tokens: each device holds a partial gradient
            grads = jax.tree.map(lambda g, spec: g if _is_split(spec) else jax.lax.psum(g, AXIS),
                                 grads, self.param_specs)
        if self.f > 1:      # split leaves were reduce-scattered in the backward pass; the others are summed here
            grads = jax.tree.map(lambda g, spec: (g if _is_split(spec, FSDP) else jax.lax.psum(g, FSDP)) / self.f,
                                 grads, self.param_specs)
        if self.x > 1:
            grads = jax.tree.map(lambda g, spec: (g if _is_split(spec, EXPERT) else jax.lax.psum(g, EXPERT)) / self.x,
                                 grads, self.param_specs)
        return jax.lax.pmean(metrics, self.batch), jax.lax.pmean(grads, DATA)   # ALL-REDUCE over data (DDP)

    def _global_norm(self, grads):
        """L2 norm of the whole gradient: each leaf's square summed over the axes it is split on (tensor,
        fsdp, expert), replicated ones counted once."""
        groups = {}
        flat, specs = jax.tree.leaves(grads), jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P))
        for g, spec in zip(flat, specs):
            axes = tuple(a for a in (AXIS, FSDP, EXPERT) if _is_split(spec, a))
            groups[axes] = groups.get(axes, jnp.float32(0)) + jnp.sum(jnp.square(g.astype(jnp.float32)))
        return jnp.sqrt(sum(jax.lax.psum(total, axes) if axes else total for axes, total in groups.items()))

    def _local_step(self, state, tokens):
        params = state["params"]
        metrics, grads = self._local_grads(params, tokens)
        norm = self._global_norm(grads)
        grads = clip_to_norm(grads, norm, self.config.train.grad_clip)   # by the true global norm
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        params = apply_outside_gradient(state["params"], optax.apply_updates(params, updates), metrics,
                                        self.model_cfg)   # the MoE router's aux-free bias (replicated)
        metrics = {**metrics, "grad_norm": norm}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def _local_eval(self, params, tokens):
        return jax.lax.pmean(cross_entropy_and_aux(params, tokens, self.model_cfg, self.ops)[0], self.batch)


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
    """Bytes each device sends per step, by mesh axis (u = (T-1)/T·e·b·s·h, e = `wire_bytes`, b rows per batch
    shard (data x fsdp, x expert for MoE) per microbatch, m microbatches).

    tensor, TP  per layer 4 all-reduces of b·s·h = 8u (g after wo and w_down forward, f before q/k/v and
                gate/up backward), +2u with remat full/dots (the attention g is recomputed). Outside the
                layers 4u: the embedding's g forward, the head's f backward.
            SP  the same 8u as 4 all-gathers + 4 reduce-scatters, +2u for gathering each column-parallel input
                again in the backward (`regather`, also whenever remat does not save it), +1u with remat
                full/dots. Outside 4u. Once per step: the replicated weights' gradient sum (norms, router),
                2(T-1)/T·4 per element.
          both  per microbatch the cross-entropy's three fp32 reductions 3·2(T-1)/T·4·b·s; once per step the
                grad-norm scalar 2(T-1)/T·4. MoE layers add `moe_tensor_bytes` (gates, shared experts, SP's router).
    data        DDP: one all-reduce of this device's fp32 gradient, 2(D-1)/D·4·(its elements + the loss).
    fsdp        `fsdp_bytes`: each parameter split over fsdp gathered where it runs and its gradient
                reduce-scattered; the ones fsdp does not split all-reduce their gradient.
    expert      MoE: the exchange's all_to_alls (`moe_all_to_all_bytes`) and the all-reduce of every gradient
                but the routed experts', 2(X-1)/X·4 per element. The router bias has no gradient: not sent.
    """
    T, D, F = cand.tensor, cand.data, cand.fsdp
    X = cand.expert if shape.moe else 1
    m, L, h, s = cand.microbatches, shape.layers, shape.d_model, seq_len
    b = global_batch // m // (D * F * X)
    e = wire_bytes(cand.precision, platform)
    every = leaf_sizes(shape.model, T, F, X)
    leaves = [leaf for leaf in every if leaf[0] != "router_bias"]   # the ones with a gradient
    kept = sum(size / (F if "fsdp" in axes else 1) for _, size, axes in leaves)
    out, stored = [], stored_params(shape, cand)
    if T > 1:
        u = (T - 1) / T * e * b * s * h
        ring = 2 * (T - 1) / T
        units = layer_units(cand.remat, cand.sequence, regather) * L + 4
        replicated = sum(size / (F if "fsdp" in axes else 1) for _, size, axes in leaves if "tensor" not in axes)
        total = m * (units * u + ring * 4 * 3 * b * s) + ring * 4 + (ring * 4 * replicated if cand.sequence else 0)
        if shape.moe:
            total += m * moe_tensor_bytes(shape, cand, b, s, e)
        count = m * (units // 2 + 3) + 1
        out.append(Flow("tensor", "reduce-scatter" if cand.sequence else "all-reduce", total, count, False))
    arrays = WEIGHTS_PER_LAYER + OTHER_WEIGHTS
    if F > 1:
        sent = fsdp_bytes(shape.model, T, F, X, e)
        stored = dict.fromkeys(stored, sum(size / (F if "fsdp" in axes else 1) for _, size, axes in every))
        out.append(Flow("fsdp", "all-gather", sent, 3 * L * WEIGHTS_PER_LAYER + 2 * OTHER_WEIGHTS, False))
    if D > 1:
        out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * 4 * (kept + 1), arrays, False))
    if X > 1:
        exchange = moe_all_to_all_bytes(shape, cand, global_batch, seq_len, platform)
        out.append(Flow("expert", "all-to-all", exchange["predicted"], exchange["runs"], False))
        shared = sum(size / (F if "fsdp" in axes else 1) for _, size, axes in leaves if "expert" not in axes)
        out.append(Flow("expert", "all-reduce", 2 * (X - 1) / X * 4 * shared, arrays, False))
    return Prediction(out, stored)


def leaf_sizes(model_cfg, T: int, F: int, X: int) -> list[tuple[str, float, tuple[str, ...]]]:
    """(name, elements a layer uses on one device, mesh axes it rests split on) of every parameter under manual
    TP (default rules): split over tensor and expert as stored; over fsdp too at rest (size / F) when F > 1."""
    from jaxpar.model.transformer import init_params
    from jaxpar.parallel.rules import DEFAULT

    shapes = jax.eval_shape(lambda: init_params(model_cfg, 0))
    live = ("tensor",) + (("fsdp",) if F > 1 else ()) + (("expert",) if X > 1 else ())
    specs = DEFAULT.tree_specs(model_cfg.param_axes(), live)
    out = []
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        axes = tuple(jax.tree.leaves(tuple(spec)))
        size = float(np.prod(leaf.shape)) / (T if "tensor" in axes else 1) / (X if "expert" in axes else 1)
        out.append((jax.tree_util.keystr(path[-1:], simple=True), size, axes))
    return out


def fsdp_bytes(model_cfg, T: int, F: int, X: int = 1, e: int = 4) -> float:
    """fsdp bytes per device per step of manual TP x FSDP (default rules): per parameter split over fsdp,
    g = its `leaf_sizes` size, (F-1)/F·e·g per all-gather, 3 per layer weight (forward, the backward's re-gather,
    the gradient's reduce-scatter), 2 for the embedding and head (a tied one 4); the learned parameters fsdp does
    not split (norms) all-reduce their gradient, 2(F-1)/F·e·size. e = `wire_bytes`: Ops.weights casts to the
    compute dtype before fetching, so the gather and its transpose, the reduce-scatter, move bf16 (a compiled
    7B on 64 H100s sends the predicted bytes, lab 05); XLA:CPU sends fp32. The scalars (loss, norm) that
    reduce over data x fsdp together are left out."""
    sent = 0.0
    for name, size, axes in leaf_sizes(model_cfg, T, F, X):
        gathers = 4 if name == "embed" and model_cfg.tie_embeddings else 2 if name in ("embed", "lm_head") else 3
        if "fsdp" in axes:
            sent += (F - 1) / F * e * size * gathers
        elif name != "router_bias":     # no gradient
            sent += 2 * (F - 1) / F * e * size
    return sent

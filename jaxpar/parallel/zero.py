"""Course module 2 by hand: DDP and ZeRO-1/2/3 as `shard_map` programs over the mesh axis `data`.

The automatic path (`parallel/auto.py`) states *where arrays live* and lets XLA insert
the collectives. Here every collective is written out: the step is one per-device
program that sees its own batch shard and its own slices of the state. The four stages
are the four short functions below; diff them to see which collective changes:

| parallel.data | params | grads | Adam m,v | gradient reduction                    | after update | sent/device/step |
|---------------|--------|-------|----------|---------------------------------------|--------------|------------------|
| ddp           | full   | full  | full     | all-reduce                            | -            | 2Ψ               |
| zero1         | full   | full  | 1/N      | reduce-scatter once, after backward   | all-gather   | Ψ + Ψ = 2Ψ       |
| zero2         | full   | 1/N   | 1/N      | reduce-scatter per layer, in backward | all-gather   | Ψ + Ψ = 2Ψ       |
| zero3         | 1/N    | 1/N   | 1/N      | reduce-scatter per layer, in backward | -            | Ψ + Ψ + Ψ = 3Ψ   |

(elements, times (N-1)/N under a ring.) ZeRO-1 and ZeRO-2 send the same bytes; they
differ in *when*: ZeRO-1 finishes the backward pass holding the full local gradient,
ZeRO-2 reduce-scatters each layer's gradient as the backward scan produces it, so the
full gradient never exists on a device. ZeRO-2 and ZeRO-3 differ only in the weight
fetch: a local full copy, or an all-gather of the slice (`Ops.fetch`). ZeRO-3 gathers
each layer in the forward pass and again in the backward pass (its remat policy never
saves a gathered weight); the embedding, final norm and head are fetched outside the
layer loop, so their bytes are 2Ψ_o, not 3Ψ_o. A tied embedding is fetched twice.

Every parameter (and its Adam moments) is split along its first dimension divisible by
N, never the stacked `layers` axis. Clipping uses the true global norm. Gradients
are fp32; a bfloat16 run casts weights before the fetch, so ZeRO-3 gathers and
reduce-scatters bfloat16. Only mesh.data may be > 1. `parallel.grad_buckets` (DDP, ZeRO-2;
buckets.py) reduces the layers' gradients in that many flat collectives inside the backward
pass. `predict` (end of file): the table's bytes, per stage, as the compiled programs send them.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.kernels.kernel_ops import interpreted_pallas, platform_of
from jaxpar.model.transformer import cross_entropy_and_aux, loss
from jaxpar.parallel.buckets import bucketed_layers, reduce_flat
from jaxpar.parallel.prefetch import prefetching_layers
from jaxpar.parallel.step import accumulate, apply_outside_gradient, clip_to_norm, never_saving, produced_by
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

AXIS = "data"
STACKS = ("blocks", "moe_blocks")                         # the scanned layer stacks (leading `layers` axis)
STAGE_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


# ============================================================================ the four stages
# Each runs on one device inside shard_map: `params`/`opt_state` are what this device
# stores, `tokens` its batch shard. Returns (metrics, params, opt_state, grad norm).

def ddp_step(t: ZeroStrategy, params, opt_state, tokens):
    """DDP: everything replicated; the gradient is all-reduced."""
    if t.buckets:                                          # ALL-REDUCE per bucket, inside the backward (buckets.py)
        metrics, grads = t.bucketed_grads(params, tokens)
    else:
        metrics, grads = t.local_grads(params, tokens)     # gradient of this device's batch shard
        grads = jax.lax.pmean(grads, AXIS)                 # ALL-REDUCE: every device holds the mean gradient
    norm = optax.tree.norm(grads)
    params, opt_state = t.apply_optimizer(grads, norm, opt_state, params)  # same update everywhere
    return metrics, params, opt_state, norm


def zero1_step(t: ZeroStrategy, params, opt_state, tokens):
    """ZeRO-1: Adam m, v sliced; the finished gradient is reduce-scattered, each device updates its slice."""
    metrics, grads = t.local_grads(params, tokens)         # the full local gradient exists here
    my_grads = t.reduce_scatter(grads)                     # REDUCE-SCATTER: my 1/N of the mean gradient
    norm = t.sharded_norm(my_grads)                        # ALL-REDUCE of one scalar
    my_params, opt_state = t.apply_optimizer(my_grads, norm, opt_state, t.my_slice(params))
    return metrics, t.all_gather(my_params), opt_state, norm   # ALL-GATHER the updated slices


def zero2_step(t: ZeroStrategy, params, opt_state, tokens):
    """ZeRO-2: as ZeRO-1, but each layer's gradient is reduce-scattered inside the backward pass."""
    metrics, my_grads = t.sliced_grads(params, tokens, fetch=t.local_copy)   # REDUCE-SCATTER per layer
    norm = t.sharded_norm(my_grads)
    my_params, opt_state = t.apply_optimizer(my_grads, norm, opt_state, t.my_slice(params))
    return metrics, t.all_gather(my_params), opt_state, norm   # ALL-GATHER the updated slices


def zero3_step(t: ZeroStrategy, params, opt_state, tokens):
    """ZeRO-3: params stored sliced too; each layer all-gathered in forward and again in backward."""
    metrics, my_grads = t.sliced_grads(params, tokens, fetch=t.gather)   # ALL-GATHER, REDUCE-SCATTER per layer
    norm = t.sharded_norm(my_grads)
    params, opt_state = t.apply_optimizer(my_grads, norm, opt_state, params)  # params are my slice already
    return metrics, params, opt_state, norm                # nothing to gather: params stay sliced


STAGES = {"ddp": ddp_step, "zero1": zero1_step, "zero2": zero2_step, "zero3": zero3_step}


def split_over(stage: str, n: int) -> dict[str, int]:
    """The table's columns as numbers: over how many of the `n` data devices each part of the state is split
    under `stage` (ZeRO's stage s splits the optimizer state from 1, the gradients from 2, the params at 3)."""
    level = tuple(STAGES).index(stage)
    return {"params": n if level >= 3 else 1, "grads": n if level >= 2 else 1, "optimizer": n if level >= 1 else 1}


def gradient_held(stage: str, psi: int, psi_layers: int, layers: int, n: int, grad_bytes: int = 4) -> float:
    """Gradient bytes a stage holds at its peak, per device.

    ddp, zero1: the whole local gradient, 4Ψ, before the one reduction after the backward pass.
    zero2, zero3: each layer's gradient is reduce-scattered inside the backward scan, so the
    accumulated slices (4Ψ_L/N) plus one layer's full gradient (4Ψ_L/L) and the gradients
    of the embedding, head and final norm (4Ψ_o: computed outside the layer loop, whole until
    their reduce-scatter).
    """
    if stage in ("ddp", "zero1"):
        return grad_bytes * psi
    return grad_bytes * (psi_layers / n + psi_layers / layers + (psi - psi_layers))


# ============================================================================ the weight fetches

@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_gather_weight(shard, dim, axis):
    """ZeRO-3's / FSDP's pair of collectives over `axis`: forward all-gathers the weight, backward
    reduce-scatters its gradient (the sum over `axis`; the caller divides by the axis size)."""
    return jax.lax.all_gather(shard, axis, axis=dim, tiled=True)


def _gather_fwd(shard, dim, axis):
    return all_gather_weight(shard, dim, axis), None


def _gather_bwd(dim, axis, _, full_grad):
    return (jax.lax.psum_scatter(full_grad, axis, scatter_dimension=dim, tiled=True),)


all_gather_weight.defvjp(_gather_fwd, _gather_bwd)


def gather_weight(shard, dim):
    """ZeRO-3's fetch over `data`."""
    return all_gather_weight(shard, dim, AXIS)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def use_local_copy(my_slice, full, dim):
    """ZeRO-2's bucket: forward uses this device's full copy; backward reduce-scatters the gradient
    into `my_slice`'s cotangent at once, so a layer's full gradient lives only inside its backward step.
    The copy is marked varying, so the gradient arriving here is this device's own (no implicit sum)."""
    return jax.lax.pcast(full, AXIS, to="varying")


def _copy_fwd(my_slice, full, dim):
    return use_local_copy(my_slice, full, dim), None


def _copy_bwd(dim, _, full_grad):
    sliced = jax.lax.psum_scatter(full_grad, AXIS, scatter_dimension=dim, tiled=True)
    return sliced, jnp.zeros(full_grad.shape, full_grad.dtype)


use_local_copy.defvjp(_copy_fwd, _copy_bwd)


def refetch_policy(policy):
    """The remat policy of ZeRO-2/3's layer body: `policy` (None: save everything), but never a fetched
    weight. ZeRO-3's backward pass therefore gathers each layer again; ZeRO-2's re-reads its local copy
    (saving it would stack a copy of every layer's weights). Broadcasts are never saved either: they are
    free to recompute and bigger than their input (the norm scales' [B, S, D] broadcasts)."""
    fetched = produced_by(("all_gather", "pvary"))
    return never_saving(lambda prim, params: fetched(prim, params) or prim.name == "broadcast_in_dim", policy)


# ============================================================================ the split rule

def split_dims(abstract_params, n: int, stage: str) -> dict:
    """For each parameter, the dimension split over `data`: the first one divisible by n, never `layers`.

    The leading dimension when it divides: all-gathers and reduce-scatters along it need no transposes."""
    def pick(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        first = 1 if name.startswith(STACKS) else 0       # the stacked layers axis is never split
        dims = [d for d in range(first, leaf.ndim) if leaf.shape[d] % n == 0]
        if not dims:
            unsplittable.append(f"{name} {list(leaf.shape)}")
            return -1
        return dims[0]

    unsplittable: list[str] = []
    dims = jax.tree_util.tree_map_with_path(pick, abstract_params)
    if unsplittable:
        raise ConfigError("mesh.data", f"{STAGE_NAMES[stage]} splits every parameter over mesh.data={n}, but no "
                          f"dimension (layers axis excluded) of {', '.join(unsplittable)} is divisible by {n}; "
                          "use a mesh.data that divides model.d_model, or parallel.data=ddp")
    return dims


# ============================================================================ the strategy

class ZeroStrategy(Strategy):
    """DDP and ZeRO-1/2/3 over `data`, with the automatic strategy's state layout (checkpoints interchange)."""

    RUNS = {"data": tuple(STAGES)}
    PLANNED = {"data": ("zero1", "zero3")}   # ddp and zero2 send what zero1 sends and store more

    @classmethod
    def check(cls, config, sizes):
        others = [f"mesh.{axis}={size}" for axis, size in sizes.items() if axis != AXIS and size > 1]
        if others:
            raise ConfigError(f"parallel.{AXIS}", f"{config.parallel.data} runs over mesh.data only, but "
                              f"{', '.join(others)}; set those axes to 1 or use parallel.data=auto")
        if config.parallel.data != "ddp" and config.model.d_model % sizes[AXIS]:
            raise ConfigError("mesh.data", f"{STAGE_NAMES[config.parallel.data]} splits every parameter over "
                              f"mesh.data={sizes[AXIS]}, which must divide model.d_model={config.model.d_model}")

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        self.stage = config.parallel.data
        self.n = int(mesh.shape[AXIS])
        self.buckets = config.parallel.grad_buckets   # ddp, zero2: 0 or layer buckets (buckets.py)
        abstract = jax.eval_shape(self.make_state)       # the same pytree as every strategy's
        self.dims = split_dims(abstract["params"], self.n, self.stage) if self.stage != "ddp" else None
        self.state_specs = self._state_specs(abstract)
        self.state_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs)
        self.param_shardings = self.state_shardings["params"]
        self.batch_sharding = NamedSharding(mesh, P(AXIS, None))
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)

        replicated = NamedSharding(mesh, P())
        # vma checked, except around CPU-interpreted Pallas kernels (kernel_ops.interpreted_pallas): unchecked,
        # pcast is the identity and the step still differentiates no bare collective, so the gradients are equal
        checked = not interpreted_pallas(config, platform_of(mesh))
        step = jax.shard_map(self._local_step, mesh=mesh, in_specs=(self.state_specs, P(AXIS, None)),
                             out_specs=(self.state_specs, P()), check_vma=checked)
        self.step_fn = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        evaluate = jax.shard_map(self._local_eval, mesh=mesh, in_specs=(self.state_specs["params"], P(AXIS, None)),
                                 out_specs=P(), check_vma=checked)
        self.eval_fn = jax.jit(evaluate, in_shardings=(self.param_shardings, self.batch_sharding),
                               out_shardings=replicated)

    # ---------------------------------------------------------------- layout
    def _state_specs(self, abstract):
        params = abstract["params"]
        if self.stage == "ddp":
            sliced = jax.tree.map(lambda _: P(), params)
        else:
            sliced = jax.tree.map(lambda leaf, dim: P(*[AXIS if d == dim else None for d in range(leaf.ndim)]),
                                  params, self.dims)
        param_specs = sliced if self.stage == "zero3" else jax.tree.map(lambda _: P(), params)
        return self._state_layout(abstract, param_specs, sliced, replicated=P())   # m, v always sliced

    def _dims(self, name: str):
        """Split dims of one top-level entry; a layer inside the scan has lost its leading `layers` axis."""
        dims = self.dims
        assert dims is not None, "ddp splits no dimension"
        return jax.tree.map(lambda d: d - 1, dims[name]) if name in STACKS else dims[name]

    # ---------------------------------------------------------------- weight fetches (Ops.fetch)
    def gather(self, name, shards):
        return jax.tree.map(gather_weight, shards, self._dims(name))

    def local_copy(self, name, pairs):
        return jax.tree.map(lambda pair, dim: use_local_copy(*pair, dim), pairs, self._dims(name),
                            is_leaf=lambda x: isinstance(x, tuple))

    # ---------------------------------------------------------------- per-device building blocks
    def _value_and_grad(self, objective, params, tokens):
        """(metrics, grads) over this device's batch shard, accumulated over microbatches."""
        vary = lambda x: jax.lax.pcast(x, AXIS, to="varying")
        (_, metrics), grads = accumulate(jax.value_and_grad(objective, has_aux=True), params, tokens,
                                         self.microbatches, vary=vary)
        return metrics, grads

    def local_grads(self, params, tokens):
        """DDP, ZeRO-1: the gradient of this device's batch shard w.r.t. the full (replicated) params."""
        # pcast: differentiate w.r.t. a per-device copy, so no implicit psum sneaks into the gradient
        mine = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
        objective = partial(loss, cfg=self.model_cfg, ops=self.ops, remat_policy=self.policy)
        return self._value_and_grad(objective, mine, tokens)

    def sliced_grads(self, params, tokens, fetch):
        """ZeRO-2, ZeRO-3: the mean gradient w.r.t. this device's slices, reduce-scattered layer by layer."""
        ops, policy = self.ops.replace(fetch=fetch), refetch_policy(self.policy)
        if self.stage == "zero3":
            stored = params
            if self.config.parallel.prefetch:   # layer i+1 gathered before layer i (prefetch.py)
                ops = ops.replace(layers=prefetching_layers(self._dims("blocks"), ops.dtype))
            objective = partial(loss, cfg=self.model_cfg, ops=ops, remat_policy=policy)
        else:
            stored = self.my_slice(params)
            if self.buckets:   # the layers' reduce-scatters packed into one per bucket (buckets.py)
                ops = ops.replace(layers=self._bucket_loop())
            def objective(slices, tokens):
                pairs = jax.tree.map(lambda s, full: (s, full), slices, params)
                return loss(pairs, tokens, self.model_cfg, ops, policy)
        metrics, grads = self._value_and_grad(objective, stored, tokens)
        return metrics, jax.tree.map(lambda g: g / self.n, grads)   # the reduce-scatters summed: mean

    def bucketed_grads(self, params, tokens):
        """DDP with buckets: the gradient w.r.t. the replicated params, reduced inside the backward pass: one
        flat psum per bucket of layers (buckets.py), one per other array (the transpose of its varying mark)."""
        ops = self.ops.replace(layers=self._bucket_loop())
        def objective(params, tokens):
            marked = {k: v if k in STACKS else jax.lax.pcast(v, AXIS, to="varying") for k, v in params.items()}
            return loss(marked, tokens, self.model_cfg, ops, self.policy)
        metrics, grads = self._value_and_grad(objective, params, tokens)
        return metrics, jax.tree.map(lambda g: g / self.n, grads)

    def _bucket_loop(self):
        """`Ops.layers` in `self.buckets` buckets (buckets.py). DDP all-reduces the fp32 gradient, as unbucketed
        DDP does; ZeRO-2 reduce-scatters in the compute dtype, as its per-layer fetch does."""
        fetch = lambda stored: jax.tree.map(lambda w: jax.lax.pcast(w.astype(self.ops.dtype), AXIS, to="varying"),
                                            stored)
        if self.stage == "ddp":
            reduce = lambda g: reduce_flat(jax.tree.map(lambda x: x.astype(jnp.float32), g), None, self.n)
            return bucketed_layers(self.buckets, lambda blocks: (blocks, blocks), fetch, reduce)
        dims = tuple(jax.tree.leaves(self.dims["blocks"]))
        pick = lambda pairs, i: jax.tree.map(lambda pair: pair[i], pairs, is_leaf=lambda x: isinstance(x, tuple))
        return bucketed_layers(self.buckets, lambda pairs: (pick(pairs, 0), pick(pairs, 1)), fetch,
                               lambda g: reduce_flat(g, dims, self.n))

    def my_slice(self, tree):
        """This device's 1/N block of replicated arrays (no communication: just an offset)."""
        i = jax.lax.axis_index(AXIS)
        def cut(x, dim):
            size = x.shape[dim] // self.n
            return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=dim)
        return jax.tree.map(cut, tree, self.dims)

    def _stored_part(self, stack, name, full):
        """ZeRO-3: this device's slice of a full-shape array shaped like parameter `stack.name`."""
        dim = self.dims[stack][name]
        size = full.shape[dim] // self.n
        return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(AXIS) * size, size, axis=dim)

    def reduce_scatter(self, grads):
        return jax.tree.map(lambda g, dim: jax.lax.psum_scatter(g, AXIS, scatter_dimension=dim, tiled=True) / self.n,
                            grads, self.dims)

    def all_gather(self, slices):
        return jax.tree.map(lambda x, dim: jax.lax.all_gather(x, AXIS, axis=dim, tiled=True, to="invarying"),
                            slices, self.dims)

    def sharded_norm(self, slices):
        """Global L2 norm of a gradient of which each device holds disjoint slices."""
        local = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(slices))
        return jnp.sqrt(jax.lax.psum(local, AXIS))

    def apply_optimizer(self, grads, norm, opt_state, params):
        """Clip by the true global norm, then the unchanged optimizer on what this device holds."""
        grads = clip_to_norm(grads, norm, self.config.train.grad_clip)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # ---------------------------------------------------------------- the shard_map programs
    def _local_step(self, state, tokens):
        metrics, params, opt_state, norm = STAGES[self.stage](self, state["params"], state["opt_state"], tokens)
        metrics = jax.lax.pmean(metrics, AXIS)
        stored_part = self._stored_part if self.stage == "zero3" else None
        params = apply_outside_gradient(state["params"], params, metrics, self.model_cfg, stored_part)
        metrics = {**metrics, "grad_norm": norm}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def _local_eval(self, params, tokens):
        ops = self.ops.replace(fetch=self.gather) if self.stage == "zero3" else self.ops
        return jax.lax.pmean(cross_entropy_and_aux(params, tokens, self.model_cfg, ops)[0], AXIS)


# ============================================================================ prediction

def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """Bytes each device sends per step over `data` (D devices, ring (D-1)/D; e = `wire_bytes`, m microbatches).

    ddp, zero1  fp32 gradients accumulated locally and reduced once per step: DDP's all-reduce 2·4Ψ; ZeRO-1's
                reduce-scatter + all-gather of the updated fp32 params, 2·4Ψ as well.
    zero2       each layer's gradient reduce-scattered in every microbatch's backward pass, e·m·Ψ, + the fp32
                all-gather 4Ψ.
    zero3       per microbatch, layers gathered forward and backward and reduce-scattered (3Ψ_L), embedding,
                head and final norm gathered once and reduce-scattered (2Ψ_o; a tied embedding twice), x e·m.
    buckets     parallel.grad_buckets = B > 0 (buckets.py): the same bytes per reduction; the layers' gradients
                leave in B flat collectives, the other arrays in one each, in every microbatch's backward pass.
                ZeRO-2 sends what it sends without buckets (B + 3 collectives per microbatch instead of 9L + 3);
                DDP's all-reduce is issued m times (no `no_sync`): m·2·4Ψ, 2·4Ψ at m = 1.
    """
    counts = shape.counts()
    D, m, L = cand.data, cand.microbatches, shape.layers
    stored = stored_params(shape, cand, split_over(cand.data_impl, D))
    if D == 1:
        return Prediction([], stored)
    e, cpu = wire_bytes(cand.precision, platform), platform == "cpu"
    psi_layers, psi_other = counts["blocks"], counts["total"] - counts["blocks"]
    psi = psi_layers + psi_other
    ring, arrays = (D - 1) / D, WEIGHTS_PER_LAYER + OTHER_WEIGHTS
    tied = 2 * counts["embedding"] if shape.tie_embeddings else 0
    stage = cand.data_impl
    buckets = cand.grad_buckets + OTHER_WEIGHTS if cand.grad_buckets and stage in ("ddp", "zero2") else 0
    if stage == "ddp" and buckets:     # reduced in each microbatch's backward pass: hideable behind it
        flows = [Flow("data", "all-reduce", ring * 2 * 4 * m * psi, buckets * m, not cpu)]
    elif stage in ("ddp", "zero1"):
        flows = [Flow("data", "all-reduce" if stage == "ddp" else "reduce-scatter", ring * 2 * 4 * psi, arrays, False)]
    elif stage == "zero2":
        flows = [Flow("data", "reduce-scatter", ring * e * m * psi, (buckets or arrays) * m, not cpu),
                 Flow("data", "all-gather", ring * 4 * psi, arrays, False)]
    else:
        flows = [Flow("data", "all-gather", ring * e * m * (2 * psi_layers + psi_other + tied / 2),
                      (2 * L * WEIGHTS_PER_LAYER + OTHER_WEIGHTS) * m, not cpu),
                 Flow("data", "reduce-scatter", ring * e * m * (psi_layers + psi_other + tied / 2),
                      (L * WEIGHTS_PER_LAYER + OTHER_WEIGHTS) * m, not cpu)]
    return Prediction(flows, stored)

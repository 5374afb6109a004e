"""Course module 2 by hand: DDP and ZeRO-1/2/3 as `shard_map` programs over the mesh axis `data`.

The automatic path (`train/step.py`) states *where arrays live* and lets XLA's
SPMD partitioner insert the collectives. Here every collective is written out:
the step is one per-device program (`jax.shard_map`) that sees only its own
batch shard and its own slices of the state, and talks to the other devices
with `psum`/`pmean` (all-reduce), `psum_scatter` (reduce-scatter) and
`all_gather`. The four stages are four short functions below (`ddp_step`,
`zero1_step`, `zero2_step`, `zero3_step`); put them side by side to see exactly
which collective changes from one stage to the next:

| stage   | params | grads | Adam m,v | gradient reduction             | after the update      | sent/device/step  |
|---------|--------|-------|----------|--------------------------------|-----------------------|-------------------|
| 0 (DDP) | full   | full  | full     | all-reduce (pmean)             | -                     | 2Ψ                |
| 1       | full   | full  | 1/N      | all-reduce (pmean)             | all-gather the params | 2Ψ + Ψ = 3Ψ       |
| 2       | full   | 1/N   | 1/N      | reduce-scatter (psum_scatter)  | all-gather the params | Ψ + Ψ = 2Ψ        |
| 3       | 1/N    | 1/N   | 1/N      | reduce-scatter, layer by layer | - (params stay 1/N)   | Ψ + Ψ + Ψ = 3Ψ    |
|         |        |       |          | in the backward pass           |                       |                   |

Ψ = number of parameters; "sent" counts elements (times 4 bytes in fp32), each
term times (N-1)/N under a ring. Stage 1 as written sends more than DDP,
because it all-reduces the full gradient and then also all-gathers the params;
the ZeRO paper's P_os (and DeepSpeed) already reduce-scatter in stage 1, which
in a functional program makes it identical to stage 2. We keep the all-reduce
so that each stage changes one thing. ZeRO-3 all-gathers every layer's weights
in the forward pass and *again* in the backward pass, then reduce-scatters its
gradient: 3Ψ for the layers. The embedding, final norm and lm_head are
gathered once (see "ZeRO-3 forward"), so the measured total is
3Ψ_layers + 2Ψ_rest.

Memory, in bytes (fp32 params 4Ψ, Adam m+v 8Ψ): the state each device stores
is 12Ψ (DDP), 4Ψ + 8Ψ/N (ZeRO-1/2) and 12Ψ/N (ZeRO-3). Gradients are
temporaries of the step. ZeRO-2's saving is the reduced gradient (4Ψ/N instead
of 4Ψ); the full *local* gradient still exists before the reduce-scatter, since
without bucketing the backward pass finishes before any reduction starts.

Rules and choices (documented here, checked in `split_dims`):

- **Which dimension is split.** Stages 1-3 split every parameter (and its
  Adam moments) along its largest dimension divisible by N = mesh.data,
  excluding the stacked `layers` axis of `blocks` (ZeRO-3 gathers one layer at
  a time, so each layer must itself be split); ties go to the first such
  dimension. Every parameter has a d_model axis, so N dividing d_model always
  works; when some parameter has no divisible dimension we raise a ConfigError
  instead of keeping that leaf replicated: a replicated leaf would need a
  second code path in every stage (and breaks the 1/N memory claim).
- **Clipping.** `make_optimizer`'s chain starts with clip_by_global_norm, which
  inside shard_map would only see this device's slice. We clip first with the
  true global norm (stage 0/1: the full all-reduced gradient, no collective;
  stage 2/3: sqrt of the psum of the squared slice norms); afterwards the
  slice's norm is <= the global norm <= grad_clip, so the chain's own clip
  passes it through unchanged. The optimizer (weight-decay mask, schedule,
  state structure) is therefore exactly the automatic path's `make_optimizer`.
  Adam and weight decay are elementwise, so applying them to a slice with the
  matching slice of m and v is the same as applying them to the whole.
- **check_vma stays on.** JAX tracks which values vary across devices. A
  gradient taken w.r.t. a *replicated* (invariant) input is implicitly summed
  over devices, because the transpose of "broadcast to every device" is psum.
  To keep every collective explicit, stages 0-2 first `pcast` the replicated
  params to "varying": each device then gets the gradient of its own batch
  shard, and the reduction is the psum/psum_scatter written below.
- **ZeRO-3 forward.** Each layer's weights are all-gathered inside the scan
  body, just before use, so only one layer's full weights are alive at a time.
  `gather_weight` is a custom_vjp whose backward is the reduce-scatter of the
  weight's gradient. The scan body is wrapped in `jax.checkpoint` with a policy
  that refuses to save all-gather outputs as residuals: otherwise the backward
  pass would keep all L layers' gathered weights alive from the forward pass,
  i.e. the full model on every device. With the policy, the backward pass
  recomputes the body's gather (a second all-gather per layer), which is the
  "ZeRO-3 moves 3Ψ" of the course; `tests/test_zero.py` checks in the compiled
  HLO that all-gathers run L times in the forward loop and L times in the
  backward loop. Other activations are saved per `train.remat` as usual.
  (Values computed from gathered weights alone may still be saved when the
  policy allows it: in bfloat16 the fp32 upcast of the two [D] norm scales.)
  The embedding, final norm and lm_head are gathered at use outside the layer
  loop, once per step: the embedding's backward needs no weights, and the
  head's backward comes right after its forward (PyTorch FSDP likewise does
  not reshard the root module after forward).
  Weights are cast to the compute dtype *before* the gather, so a bfloat16 run
  gathers and reduce-scatters bfloat16 (PyTorch FSDP's default MixedPrecision).
  A float8 run gathers bfloat16 too and quantizes after the gather (current
  scaling needs the whole weight's amax). Quantizing each shard with a pmax'd
  amax and gathering fp8 would halve the bytes again: not done here, though
  the automatic FSDP path's partitioner does it by itself (its compiled step
  all-gathers the dots' fp8 operands; XLA:CPU carries them as f16).
  `fp8_einsum` keeps the gathered weight, not its fp8 copy, for the backward
  pass, so the re-gather above still happens. In manual mode each device
  scales its activations and gradients by their local amax (model/fp8.py).
- **Microbatches.** Stages 0-2 accumulate the local gradient over microbatches
  and reduce once (DDP's `no_sync`); stage 3 reduce-scatters in every
  microbatch's backward pass, as FSDP does.
- Not done (yet): bucketing and prefetching. XLA decides how collectives are
  combined and scheduled; on GPU it overlaps the next layer's all-gather with
  the current layer's compute by itself (latency-hiding scheduler).

Only mesh.data may be > 1 in manual mode; the other axes belong to the
automatic path (ConfigError otherwise).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.transformer import ModelConfig, block, embed_lookup, precision, rms_norm, rope_tables
from jaxpar.train.step import DTYPES, TrainerBase, donate_state, loss_fn, make_optimizer, remat_policy

AXIS = "data"
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


# ============================================================================ the four stages
# Each runs on one device inside shard_map: `params`/`opt_state` are what this
# device stores, `tokens` its batch shard. Returns (local loss, params, opt_state, grad norm).

def ddp_step(t: "ZeroTrainer", params, opt_state, tokens):
    """Stage 0, DDP: everything replicated; the gradient is all-reduced."""
    loss, grads = t.local_grads(params, tokens)           # gradient of this device's batch shard
    grads = jax.lax.pmean(grads, AXIS)                    # ALL-REDUCE: every device holds the mean gradient
    norm = optax.tree.norm(grads)                         # full gradient here: no collective needed
    params, opt_state = t.apply_optimizer(grads, norm, opt_state, params)  # same update on every device
    return loss, params, opt_state, norm


def zero1_step(t: "ZeroTrainer", params, opt_state, tokens):
    """Stage 1: Adam m, v sharded; each device updates its slice; the slices are all-gathered."""
    loss, grads = t.local_grads(params, tokens)
    grads = jax.lax.pmean(grads, AXIS)                    # ALL-REDUCE (as DDP)
    norm = optax.tree.norm(grads)
    my_grads, my_params = t.my_slice(grads), t.my_slice(params)   # keep the 1/N this device's m, v cover
    my_params, opt_state = t.apply_optimizer(my_grads, norm, opt_state, my_params)
    params = t.all_gather(my_params)                      # ALL-GATHER: every device gets the full new params
    return loss, params, opt_state, norm


def zero2_step(t: "ZeroTrainer", params, opt_state, tokens):
    """Stage 2: as stage 1, but the gradient is reduce-scattered: each device keeps only its slice."""
    loss, grads = t.local_grads(params, tokens)
    my_grads = t.reduce_scatter(grads)                    # REDUCE-SCATTER: this device's 1/N of the mean gradient
    norm = t.sharded_norm(my_grads)                       # ALL-REDUCE of one scalar: psum of squared slice norms
    my_params = t.my_slice(params)
    my_params, opt_state = t.apply_optimizer(my_grads, norm, opt_state, my_params)
    params = t.all_gather(my_params)                      # ALL-GATHER the updated slices
    return loss, params, opt_state, norm


def zero3_step(t: "ZeroTrainer", params, opt_state, tokens):
    """Stage 3: params stored sliced too; gathered layer by layer in forward and backward."""
    # forward: ALL-GATHER each layer before use; backward: ALL-GATHER again, REDUCE-SCATTER its gradient
    loss, my_grads = t.local_grads_zero3(params, tokens)
    my_grads = jax.tree.map(lambda g: g / t.n, my_grads)  # the reduce-scatter summed the devices' grads: mean
    norm = t.sharded_norm(my_grads)                       # ALL-REDUCE of one scalar
    params, opt_state = t.apply_optimizer(my_grads, norm, opt_state, params)  # params are already my slice
    return loss, params, opt_state, norm                  # nothing to gather: params stay sliced


STAGES = {0: ddp_step, 1: zero1_step, 2: zero2_step, 3: zero3_step}


# ============================================================================ ZeRO-3 forward

@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_weight(shard, dim):
    """ZeRO-3's pair of collectives: forward all-gathers the weight, backward reduce-scatters its gradient."""
    return jax.lax.all_gather(shard, AXIS, axis=dim, tiled=True)


def _gather_fwd(shard, dim):
    return gather_weight(shard, dim), None                # save nothing: the shard is an input anyway


def _gather_bwd(dim, _, full_grad):
    return (jax.lax.psum_scatter(full_grad, AXIS, scatter_dimension=dim, tiled=True),)


gather_weight.defvjp(_gather_fwd, _gather_bwd)


def _is_gather(prim, params) -> bool:
    """An all-gather, or a custom_vjp call (`gather_weight`) whose forward is one: partial eval sees the latter."""
    if prim.name.startswith("all_gather"):
        return True
    jaxpr = params.get("call_jaxpr")
    return jaxpr is not None and any(_is_gather(e.primitive, e.params) for e in jaxpr.eqns)


def regather_policy(policy):
    """The remat policy for ZeRO-3's layer body: `policy` (None: save everything), but never a gathered weight.

    An unsaved gathered weight is recomputed in the backward pass: that is the backward re-gather.
    Broadcasts are never saved either: they are free to recompute and bigger than their input (else
    the norm scales' [B, S, D] broadcasts would be saved instead of re-gathering the [D] scales).
    """
    def saveable(prim, *args, **params):
        if _is_gather(prim, params) or prim.name == "broadcast_in_dim":
            return False
        return True if policy is None else policy(prim, *args, **params)
    return saveable


def zero3_loss(shards, tokens, dims, cfg: ModelConfig, compute_dtype, policy):
    """`train.step.loss_fn` on sliced params: `transformer.forward` with each weight gathered at use."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    dtype, matmul = precision(compute_dtype)              # float8: bfloat16 weights, FP8 matmuls
    cast = lambda a: a.astype(dtype)
    cos, sin = rope_tables(inputs.shape[1], cfg.head_dim, cfg.rope_theta)
    embed = gather_weight(cast(shards["embed"]), dims["embed"])
    x = embed_lookup(inputs, embed)

    def layer(x, layer_shards):                           # one layer: its slices [no layers axis] in, x out
        weights = jax.tree.map(lambda s, d: gather_weight(cast(s), d - 1), layer_shards, dims["blocks"])
        return block(x, weights, cos, sin, cfg, matmul), None

    layer = jax.checkpoint(layer, policy=regather_policy(policy), prevent_cse=False)
    x, _ = jax.lax.scan(layer, x, shards["blocks"])
    x = rms_norm(x, gather_weight(shards["final_norm"], dims["final_norm"]), cfg.norm_eps)
    head = embed.T if cfg.tie_embeddings else gather_weight(cast(shards["lm_head"]), dims["lm_head"])
    logits = matmul("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ============================================================================ checks and the split rule

def split_dims(abstract_params, n: int, stage: int) -> dict:
    """For each parameter, the dimension split over `data`: the largest one divisible by n (not `layers`)."""
    def pick(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        first = 1 if name.startswith("blocks.") else 0    # the stacked layers axis is never split
        dims = [d for d in range(first, leaf.ndim) if leaf.shape[d] % n == 0]
        if not dims:
            unsplittable.append(f"{name} {list(leaf.shape)}")
            return -1
        return max(dims, key=lambda d: (leaf.shape[d], -d))

    unsplittable = []
    dims = jax.tree_util.tree_map_with_path(pick, abstract_params)
    if unsplittable:
        raise ConfigError("mesh.data", f"{STAGE_NAMES[stage]} splits every parameter over mesh.data={n}, but no "
                          f"dimension (layers axis excluded) of {', '.join(unsplittable)} is divisible by {n}; "
                          "use a mesh.data that divides model.d_model, or parallel.zero_stage=0")
    return dims


# ============================================================================ the trainer

class ZeroTrainer(TrainerBase):
    """`Trainer`'s interface and state layout (checkpoints interchange); the step is a shard_map program."""

    def __init__(self, config, model_cfg: ModelConfig, mesh, donate: bool | None = None):
        self.config, self.model_cfg, self.mesh = config, model_cfg, mesh
        self.stage = int(config.parallel.zero_stage)
        self.n = int(mesh.shape[AXIS])
        self.optimizer = make_optimizer(config.train)
        self.compute_dtype = DTYPES[config.train.compute_dtype]
        self.policy = remat_policy(config.train)
        self.microbatches = config.train.microbatches

        abstract = jax.eval_shape(self._init_state)       # the same pytree as Trainer's
        self.dims = split_dims(abstract["params"], self.n, self.stage) if self.stage else None
        self.state_specs = self._state_specs(abstract)
        self.param_specs = self.state_specs["params"]
        to_sharding = lambda spec: NamedSharding(mesh, spec)
        self.state_shardings = jax.tree.map(to_sharding, self.state_specs)
        self.param_shardings = self.state_shardings["params"]
        self.batch_sharding = NamedSharding(mesh, P(AXIS, None))
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_shardings)

        replicated = NamedSharding(mesh, P())
        step = jax.shard_map(self._local_step, mesh=mesh, in_specs=(self.state_specs, P(AXIS, None)),
                             out_specs=(self.state_specs, P()), check_vma=True)
        self.step_fn = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated),
                               donate_argnums=donate_state(mesh, donate))
        evaluate = jax.shard_map(self._local_eval, mesh=mesh, in_specs=(self.param_specs, P(AXIS, None)),
                                 out_specs=P(), check_vma=True)
        self.eval_fn = jax.jit(evaluate, in_shardings=(self.param_shardings, self.batch_sharding),
                               out_shardings=replicated)

    # ---------------------------------------------------------------- layout
    def _split_spec(self, leaf, dim):
        return P(*[AXIS if d == dim else None for d in range(leaf.ndim)])

    def _state_specs(self, abstract):
        params = abstract["params"]
        if self.stage == 0:
            sliced = jax.tree.map(lambda _: P(), params)
        else:
            sliced = jax.tree.map(self._split_spec, params, self.dims)
        param_specs = sliced if self.stage == 3 else jax.tree.map(lambda _: P(), params)
        opt_specs = optax.tree_map_params(                 # m, v follow `sliced`; step counts replicate
            self.optimizer, lambda _, spec: spec, abstract["opt_state"], sliced,
            transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
        return {"params": param_specs, "opt_state": opt_specs, "step": P()}

    # ---------------------------------------------------------------- per-device building blocks
    def _value_and_grad(self, loss, params, tokens):
        """Local loss and gradient, accumulated over microbatches like `train_step`."""
        grad_fn = jax.value_and_grad(loss)
        m = self.microbatches
        if m == 1:
            return grad_fn(params, tokens)
        micro = tokens.reshape(tokens.shape[0] // m, m, -1).swapaxes(0, 1)  # same rows per microbatch as auto

        def accumulate(carry, mb):
            return jax.tree.map(jnp.add, carry, grad_fn(params, mb)), None

        # the carry must vary across devices like what is added to it (params here are per-device)
        zeros = (jax.lax.pcast(jnp.zeros((), jnp.float32), AXIS, to="varying"), jax.tree.map(jnp.zeros_like, params))
        (loss_sum, grads), _ = jax.lax.scan(accumulate, zeros, micro)
        return jax.tree.map(lambda x: x / m, (loss_sum, grads))

    def local_grads(self, params, tokens):
        """Stages 0-2: the gradient of this device's batch shard w.r.t. the full (replicated) params."""
        # pcast: differentiate w.r.t. a per-device copy, so no implicit psum sneaks into the gradient
        mine = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
        loss = partial(loss_fn, model_cfg=self.model_cfg, compute_dtype=self.compute_dtype, policy=self.policy)
        return self._value_and_grad(loss, mine, tokens)

    def local_grads_zero3(self, shards, tokens):
        """Stage 3: the gradient w.r.t. this device's slices, summed over devices by the reduce-scatters."""
        loss = partial(zero3_loss, dims=self.dims, cfg=self.model_cfg, compute_dtype=self.compute_dtype,
                       policy=self.policy)
        return self._value_and_grad(loss, shards, tokens)

    def my_slice(self, tree):
        """This device's 1/N block of replicated arrays (no communication: just an offset)."""
        i = jax.lax.axis_index(AXIS)
        def cut(x, dim):
            size = x.shape[dim] // self.n
            return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=dim)
        return jax.tree.map(cut, tree, self.dims)

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
        """Clip by the true global norm (optax's formula), then the unchanged optimizer on what this device holds."""
        clip = self.config.train.grad_clip
        grads = jax.tree.map(lambda g: jax.lax.select(norm < clip, g, g / norm.astype(g.dtype) * clip), grads)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # ---------------------------------------------------------------- the shard_map programs
    def _local_step(self, state, tokens):
        loss, params, opt_state, norm = STAGES[self.stage](self, state["params"], state["opt_state"], tokens)
        metrics = {"loss": jax.lax.pmean(loss, AXIS), "grad_norm": norm}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def _local_eval(self, params, tokens):
        if self.stage == 3:
            loss = zero3_loss(params, tokens, self.dims, self.model_cfg, self.compute_dtype, None)
        else:
            loss = loss_fn(params, tokens, self.model_cfg, self.compute_dtype, None)
        return jax.lax.pmean(loss, AXIS)

"""The training step: pure functions of (state, batch), jitted once with shardings.

The same step serves every automatic strategy: only the shardings of the state
and the batch change, and XLA's SPMD partitioner inserts the collectives.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.model.transformer import ModelConfig, forward, init_params, param_axes, precision
from jaxpar.parallel.rules import constrain, logical_to_spec, tree_shardings

# train.compute_dtype -> what `forward` takes. "float8" is FP8 matmuls (e4m3 forward, e5m2
# gradients) between bfloat16 activations: see `transformer.precision` and model/fp8.py.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float8": jnp.float8_e4m3fn}


def activation_dtype(compute_dtype: str):
    """The dtype of activations and of cast (gathered) weights for a `train.compute_dtype`: bfloat16 for float8."""
    return precision(DTYPES[compute_dtype])[0]


def remat_policy(train_cfg):
    """The `jax.checkpoint` policy for the block scan, or None to keep every activation."""
    cp = jax.checkpoint_policies
    return {
        "none": None,
        "full": cp.nothing_saveable,
        "dots": cp.dots_with_no_batch_dims_saveable,
        "names": cp.save_only_these_names(*[n.strip() for n in train_cfg.remat_names.split(",") if n.strip()]),
    }[train_cfg.remat]


def learning_rate(train_cfg) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
        decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1),
        end_value=train_cfg.lr * train_cfg.min_lr_ratio)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """AdamW with warmup + cosine, global-norm clipping; no weight decay on norms (1-D params)."""
    return optax.chain(
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.adamw(learning_rate(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps,
                    weight_decay=train_cfg.weight_decay, mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)),
    )


def loss_fn(params, tokens, model_cfg: ModelConfig, compute_dtype, policy):
    """Mean next-token cross-entropy of a [B, S+1] token batch."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = forward(params, inputs, model_cfg, compute_dtype=compute_dtype, remat_policy=policy)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(state, tokens, *, model_cfg, optimizer, compute_dtype, policy, microbatches):
    """One optimizer step; with microbatches > 1 gradients are accumulated over a scan."""
    grad_fn = jax.value_and_grad(loss_fn)
    if microbatches == 1:
        loss, grads = grad_fn(state["params"], tokens, model_cfg, compute_dtype, policy)
    else:
        B = tokens.shape[0]
        # Microbatch i takes rows i, i+k, i+2k, ...: each device keeps its own rows, no data moves.
        micro = tokens.reshape(B // microbatches, microbatches, -1).swapaxes(0, 1)
        micro = constrain(micro, (None, "batch", "length"))

        def accumulate(carry, mb):
            loss, grads = grad_fn(state["params"], mb, model_cfg, compute_dtype, policy)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro)
        loss, grads = jax.tree.map(lambda x: x / microbatches, (loss, grads))
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def eval_step(params, tokens, *, model_cfg, compute_dtype):
    return loss_fn(params, tokens, model_cfg, compute_dtype, None)


class TrainerBase:
    """What every trainer shares: the initial state, and running its jitted functions under its mesh.

    A subclass sets `config, model_cfg, mesh, optimizer, state_shardings, step_fn, eval_fn`.
    """

    def _init_state(self):
        params = init_params(self.model_cfg, self.config.seed)
        return {"params": params, "opt_state": self.optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    def init_state(self):
        """Initialise directly into the sharded layout: no device ever holds more than its part."""
        with jax.set_mesh(self.mesh):
            return jax.jit(self._init_state, out_shardings=self.state_shardings)()

    def step(self, state, batch):
        with jax.set_mesh(self.mesh):
            return self.step_fn(state, batch)

    def evaluate(self, params, batch):
        with jax.set_mesh(self.mesh):
            return self.eval_fn(params, batch)


def donate_state(mesh, donate: bool | None) -> tuple[int, ...]:
    """donate_argnums for the step. Donating lets XLA update the state in place: one copy of
    params and Adam state instead of two on an accelerator. XLA:CPU runs the donated step
    ~15% slower (measured: 571 vs 490 ms, default config) and host memory is not the limit,
    so `None` donates except on CPU; dry runs pass True to see accelerator memory."""
    if donate is None:
        donate = mesh.devices.flat[0].platform != "cpu"
    return (0,) if donate else ()


class Trainer(TrainerBase):
    """Builds the sharded state and the jitted step functions for one config on one mesh."""

    def __init__(self, config, model_cfg: ModelConfig, mesh, donate: bool | None = None):
        self.config, self.model_cfg, self.mesh = config, model_cfg, mesh
        self.optimizer = make_optimizer(config.train)
        self.compute_dtype = DTYPES[config.train.compute_dtype]
        self.batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", "length"), mesh.axis_names))
        self.param_shardings = tree_shardings(param_axes(model_cfg), mesh)
        abstract = jax.eval_shape(self._init_state)
        self.state_shardings = self._state_shardings(abstract)
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_shardings)
        step = partial(train_step, model_cfg=model_cfg, optimizer=self.optimizer, compute_dtype=self.compute_dtype,
                       policy=remat_policy(config.train), microbatches=config.train.microbatches)
        replicated = NamedSharding(mesh, P())
        self.step_fn = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=donate_state(mesh, donate))
        self.eval_fn = jax.jit(partial(eval_step, model_cfg=model_cfg, compute_dtype=self.compute_dtype),
                               in_shardings=(self.param_shardings, self.batch_sharding), out_shardings=replicated)

    def _state_shardings(self, abstract):
        """Optimizer moments follow their parameter's sharding (ZeRO-style under FSDP); scalars replicate."""
        replicated = NamedSharding(self.mesh, P())
        opt_shardings = optax.tree_map_params(
            self.optimizer, lambda _, sharding: sharding, abstract["opt_state"], self.param_shardings,
            transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, NamedSharding))
        return {"params": self.param_shardings, "opt_state": opt_shardings, "step": replicated}


def make_trainer(config, model_cfg: ModelConfig, mesh, donate: bool | None = None):
    """The trainer for `parallel.mode`: compiler-driven (auto) or hand-written shard_map (manual)."""
    if config.parallel.mode == "manual":
        from jaxpar.parallel.zero import ZeroTrainer
        return ZeroTrainer(config, model_cfg, mesh, donate=donate)
    return Trainer(config, model_cfg, mesh, donate=donate)

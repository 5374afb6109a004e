"""The strategy contract: what every strategy provides, so the loop, dry runs, labs and tests never
need to know which strategy runs.

A strategy is a subclass of `Strategy` in one file under jaxpar/parallel/ plus one
line in `jaxpar/strategies.py` (`NewAxis` there when it runs a mesh axis of its own). Beside its
builder the file holds its theory,
`predict` (parallel/theory.py says what a prediction is): the dry run, the planner and the
labs all read it. Its constructor calls `Strategy.__init__` (config,
model, mesh, optimizer, logical-axis rules, ops bundle, remat policy, donation) and then
sets:

  param_shardings   pytree of NamedSharding shaped like the params dict
  state_shardings   the same for the whole state {"params", "opt_state", "step"}
  abstract_state    ShapeDtypeStructs carrying those shardings (restore targets, dry runs)
  batch_sharding    NamedSharding of one [batch, seq_len + 1] int32 token batch
  step_fn           jitted (state, tokens) -> (state, metrics): a dict of replicated arrays
                    with at least `loss` and `grad_norm`; the loop logs every key
  eval_fn           jitted (params, tokens) -> the mean cross-entropy (replicated scalar)

Every strategy stores the same state pytree with the same global shapes (only the
shardings differ), so a checkpoint written by one restores into any other.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.kernels.kernel_ops import kernel_ops, platform_of
from jaxpar.model.axes import named_arrays
from jaxpar.model.ops import make_ops
from jaxpar.model.transformer import ModelConfig, init_params
from jaxpar.parallel.memory import accumulated_gradients
from jaxpar.parallel.rules import AxisRules
from jaxpar.parallel.step import donate_state, make_optimizer, remat_policy


class Strategy:
    """Base of every strategy: shared construction, initial state, and running under the mesh."""

    #: mesh axis -> the `parallel.<axis>` implementations this strategy runs (the registry matches on it)
    RUNS: dict[str, tuple[str, ...]] = {}
    #: the part of RUNS the planner ranks (None: all of it)
    PLANNED: dict[str, tuple[str, ...]] | None = None

    # set by every subclass's constructor (the module docstring says what each holds)
    param_shardings: Any
    state_shardings: Any
    abstract_state: Any
    batch_sharding: jax.sharding.NamedSharding
    step_fn: jax.stages.Wrapped
    eval_fn: jax.stages.Wrapped

    @staticmethod
    def predict(shape, cand, global_batch: int, seq_len: int, platform: str):
        """One step's `parallel.theory.Prediction` for `cand` (a model `shape`, `global_batch` sequences of
        `seq_len` tokens, on `platform`): every strategy owns its own."""
        raise NotImplementedError("a strategy predicts its own collectives: define `predict`")

    @staticmethod
    def held_memory(shape, cand, prediction, global_batch: int, seq_len: int):
        """What one step holds beside the stored state and one microbatch slot of activations
        (`parallel.memory.Held`); the default: the stored part's gradients and the accumulation buffer."""
        return accumulated_gradients(shape, cand, prediction, global_batch, seq_len)

    def __init__(self, config, model_cfg: ModelConfig, mesh, donate: bool | None = None):
        self.config, self.model_cfg, self.mesh = config, model_cfg, mesh
        self.optimizer = make_optimizer(config.train)
        self.rules = AxisRules.from_config(config)
        self.rules.check(named_arrays(model_cfg.tie_embeddings), dict(mesh.shape))
        self.ops = kernel_ops(make_ops(config.train.compute_dtype, self.rules), config, platform_of(mesh), self.rules)
        self.policy = remat_policy(config.train)
        self.microbatches = config.train.microbatches
        self.donate_argnums = donate_state(mesh, donate)

    @classmethod
    def check(cls, config, sizes: dict[str, int]) -> None:
        """Raise ConfigError when this strategy cannot run `config` on a mesh of `sizes` (before building)."""

    # ---------------------------------------------------------------- provided to every strategy
    def make_state(self):
        """The initial state from the seed, unsharded (traced by `init_state`; `eval_shape` gives its shapes)."""
        params = init_params(self.model_cfg, self.config.seed)
        return {"params": params, "opt_state": self.optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    def _state_layout(self, abstract, params_layout, moments_layout=None, *, replicated):
        """The whole state's layout (PartitionSpecs or NamedShardings) from the params': Adam's moments
        follow `moments_layout` (default: their parameter's), counters and the step are `replicated`."""
        moments = optax.tree_map_params(
            self.optimizer, lambda _, layout: layout, abstract["opt_state"],
            params_layout if moments_layout is None else moments_layout,
            transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, type(replicated)))
        return {"params": params_layout, "opt_state": moments, "step": replicated}

    def _with_shardings(self, abstract, shardings):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def init_state(self):
        """Initialise directly into the sharded layout: no device ever holds more than its part."""
        with jax.set_mesh(self.mesh):
            return jax.jit(self.make_state, out_shardings=self.state_shardings)()

    def step(self, state, batch):
        with jax.set_mesh(self.mesh):
            return self.step_fn(state, batch)

    def evaluate(self, params, batch):
        with jax.set_mesh(self.mesh):
            return self.eval_fn(params, batch)

    def abstract_batch(self, batch_size: int | None = None) -> jax.ShapeDtypeStruct:
        size = batch_size or self.config.train.batch_size
        return jax.ShapeDtypeStruct((size, self.config.data.seq_len + 1), jnp.int32, sharding=self.batch_sharding)

    def lower_step(self):
        """The step lowered for abstract inputs (nothing allocated): `.compile()` it for memory, HLO, FLOPs."""
        with jax.set_mesh(self.mesh):
            return self.step_fn.lower(self.abstract_state, self.abstract_batch())

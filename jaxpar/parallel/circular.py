"""The compiler-driven pipeline (MaxText's "pipelined scan stages", circular when v > 1).

No schedule table and no hand-written backward. The blocks are viewed as [v, p, Lc, ...]
with the p axis sharded over `pipe`; each iteration of a `lax.scan` runs all p stages at
once with `vmap` (stage s on its own input: XLA gives each pipe device its own stage)
and rolls the outputs one stage on (`jnp.roll` over the pipe-sharded axis: XLA writes
a collective-permute). Stage 0 takes a fresh microbatch for the first m iterations, then
what left the last stage m iterations earlier: with v > 1 ("circular repeats") a
microbatch loops over the stages v times, stage s running model stage c*p + s on loop c,
the interleaved assignment. v*m + p - 1 iterations in all.

`jax.grad` differentiates through the scan: every forward iteration, then every
backward iteration in reverse, which is GPipe's order with GPipe's memory (every
iteration's activations are kept). The rest of the model (embedding, head, data /
fsdp / tensor splits) is the automatic trainer's: the logical-axis rules place it.
`predict` (end of file): the pipe axis's rolls; the rest is not predicted.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.model.transformer import embed, head_loss, run_blocks
from jaxpar.parallel.auto import rules_embedding
from jaxpar.parallel.pipeline import check_pipeline, pipe_microbatches, pipe_virtual
from jaxpar.parallel.rules import AxisRules, parse_rules
from jaxpar.parallel.schedules import bubble_fraction
from jaxpar.parallel.strategy import Strategy
from jaxpar.parallel.theory import Candidate, Flow, Prediction, stored_params, wire_bytes

AXIS = "pipe"


def pipelined_blocks(staged, x, *, cfg, ops, policy, constrain):
    """staged: blocks [v, p, Lc, ...]; x: embedded microbatches [m, b, S, D] -> after all layers, same shape."""
    v, p = jax.tree.leaves(staged)[0].shape[:2]
    m = x.shape[0]
    stages = jnp.arange(p)
    on_stages = lambda a: constrain(a, ("layers", *ACTIVATION_AXES["residual"]))   # layers -> pipe

    def stage_weights(i):
        """Each stage's chunk at iteration i: loop c = (i - s) // m of the microbatch it holds."""
        if v == 1:
            return jax.tree.map(lambda w: w[0], staged)
        loop = jnp.clip((i - stages) // m, 0, v - 1)
        chosen = jax.vmap(lambda w, c: jax.tree.map(lambda a: a[c], w), in_axes=(1, 0))(staged, loop)
        return checkpoint_name(chosen, "circular_weights")

    def run_stage(weights, h):
        return run_blocks(weights, h, cfg, ops, policy)[0]

    def iteration(carry, i):
        # previous [p, b, S, D]: what each stage received last; queue [p, m, b, S, D]: each stage's copy of the
        # microbatches waiting to enter stage 0 (only stage 0's copy is read; all stay on their own device)
        previous, queue = carry
        slot = jnp.full((p,), i % m)
        waiting = jax.vmap(lambda q, j: q[j])(queue, slot)
        inputs = on_stages(jnp.where((stages == 0)[:, None, None, None], waiting, previous))
        outputs = jax.vmap(run_stage, spmd_axis_name=AXIS)(stage_weights(i), inputs)
        sent = on_stages(jnp.roll(outputs, 1, axis=0))   # stage s -> s+1; the last stage -> stage 0's queue
        back = jnp.full((p,), (i - (p - 1)) % m)          # the microbatch leaving the last stage now
        file = lambda q, j, out: q.at[j].set(jnp.where(i >= p - 1, out, q[j]))
        return (sent, jax.vmap(file)(queue, back, sent)), None

    if v > 1:   # recompute the per-iteration weight pick in backward instead of keeping v*m + p - 1 copies
        iteration = jax.checkpoint(iteration, prevent_cse=False,
                                   policy=jax.checkpoint_policies.save_anything_except_these_names("circular_weights"))
    queue = constrain(jnp.broadcast_to(x, (p, *x.shape)), ("layers", None, *ACTIVATION_AXES["residual"]))
    start = (on_stages(jnp.zeros((p, *x.shape[1:]), x.dtype)), queue)
    (_, queue), _ = jax.lax.scan(iteration, start, jnp.arange(v * m + p - 1))
    # stage 0's queue now holds every microbatch's output: share it with the other stages (one all-reduce)
    return jnp.sum(jnp.where((stages == 0)[:, None, None, None, None], queue, 0), axis=0)


def circular_loss(params, tokens, *, cfg, ops, outer_ops, policy, p, v, m):
    """The mean next-token cross-entropy of a [B, S+1] batch through the pipelined layers. `outer_ops` run the head
    (batch split over `pipe` too, so the pipe devices share it), `ops` the embedding and the stages."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    B, S = inputs.shape
    constrain = ops.constrain
    x = embed(params, inputs, ops)
    # microbatch i takes rows i, i+m, ...: every microbatch spans every data shard
    x = x.reshape(B // m, m, S, -1).swapaxes(0, 1)
    x = constrain(x, (None, *ACTIVATION_AXES["residual"]))
    layers = lambda w: w.reshape(v, p, -1, *w.shape[1:])
    out = pipelined_blocks(jax.tree.map(layers, params["blocks"]), x, cfg=cfg, ops=ops, policy=policy,
                           constrain=constrain)
    y = outer_ops.constrain(out.swapaxes(0, 1).reshape(B, S, -1), ACTIVATION_AXES["residual"])
    loss = head_loss(params, y, targets, cfg, outer_ops)
    return loss, {"loss": loss}


class CircularTrainer(Strategy):
    """parallel.pipe=circular: the pipelined scan, differentiated by JAX; everything else automatic."""

    RUNS = {"pipe": ("circular",)}
    PLANNED: dict = {}   # its memory (GPipe's, every iteration kept) is not in the planner's memory model

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

    @classmethod
    def check(cls, config, sizes):
        v = pipe_virtual(config)
        check_pipeline(config, sizes, "circular", virtual_ok=True, min_microbatches=sizes[AXIS] if v > 1 else 1)

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        self.p, self.v = int(mesh.shape[AXIS]), pipe_virtual(config)
        self.m = pipe_microbatches(config, self.p)
        overrides = parse_rules(config.parallel.rules)
        self.rules = AxisRules({**overrides, "layers": (AXIS,)})
        self.ops = self.ops.replace(embed=rules_embedding(self.rules), constrain=self.rules.constrain)
        batch = config.train.batch_size % (int(mesh.shape["data"]) * int(mesh.shape["fsdp"]) * self.p) == 0
        outer_rules = AxisRules({**overrides, "layers": (AXIS,), **({"batch": ("data", "fsdp", AXIS)} if batch else {})})
        outer_ops = self.ops.replace(embed=rules_embedding(outer_rules), constrain=outer_rules.constrain)
        self.batch_sharding = NamedSharding(mesh, self.rules.spec(ACTIVATION_AXES["tokens"], mesh.axis_names))
        self.param_shardings = self.rules.tree_shardings(model_cfg.param_axes(), mesh)
        abstract = jax.eval_shape(self.make_state)
        replicated = NamedSharding(mesh, P())
        self.state_shardings = self._state_layout(abstract, self.param_shardings, replicated=replicated)
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)
        self.objective = partial(circular_loss, cfg=model_cfg, ops=self.ops, outer_ops=outer_ops, policy=self.policy,
                                 p=self.p, v=self.v, m=self.m)
        self.step_fn = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        self.eval_fn = jax.jit(lambda params, tokens: self.objective(params, tokens)[0],
                               in_shardings=(self.param_shardings, self.batch_sharding), out_shardings=replicated)

    def _step(self, state, tokens):
        (_, metrics), grads = jax.value_and_grad(self.objective, has_aux=True)(state["params"], tokens)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


# ============================================================================ prediction

def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """v·m + p - 1 scan iterations, each rolling one activation a = b·s·h·e forward and one gradient back:
    pipe 2·(v·m + p - 1)·a per device. What XLA sends for data, fsdp or tensor around it is not predicted."""
    p, m, v = cand.pipe, cand.microbatches, cand.virtual
    a = global_batch // (cand.data * cand.fsdp) // m * seq_len * shape.d_model * wire_bytes(cand.precision, platform)
    iterations = v * m + p - 1
    return Prediction([Flow("pipe", "permute", 2 * iterations * a, 2 * iterations, False)], stored_params(shape, cand),
                      bubble=bubble_fraction("circular", p, m, v), stash=float(iterations),
                      note="circular: only the pipe axis is predicted")

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
fsdp / tensor splits) is the automatic strategy's: the logical-axis rules place it.

With parallel.expert=manual the routed experts exchange their tokens by hand (parallel/expert.py's shard_map
of all_to_alls over `expert`, manual over the whole mesh): `vmap` over the stages batches that shard_map, so
each pipe device runs its own stage's exchange, the experts split over `expert` as the automatic layout does.
The dropless exchange is the padded one (`EXCHANGE`): batched by vmap, the overflow round's `lax.cond` of the
other two would be a select that runs both rounds every step, and JAX cannot batch it inside the shard_map.

MoE models pipeline their `moe_blocks` (the dense leading layers run before, with the
embedding). Each iteration's per-layer auxiliary outputs of the stages that hold a real
microbatch are summed into a [v, p, Lc] buffer (/ m); the weighted losses in it join the
objective, so jax.grad carries them too: one device accumulating over the same m strided
microbatches, to rounding. Gradient accumulation (train.microbatches) wraps the whole
pipelined step, as in the automatic strategy.
`predict` (end of file): the pipe axis (rolls, the queue, the head's gradients, v > 1's chunk picks) and the
manual experts' all_to_alls; the rest is not predicted.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.model.counting import block_params
from jaxpar.model.moe import noise_seeds, with_routed_experts
from jaxpar.model.transformer import embed, head_loss, run_blocks, split_aux
from jaxpar.parallel.auto import rules_embedding
from jaxpar.parallel.expert import ExpertStrategy, manual_routed_experts
from jaxpar.parallel.pipeline import check_pipeline, pipe_microbatches, pipe_virtual
from jaxpar.parallel.pipeline_predict import stack_bytes
from jaxpar.parallel.rules import AxisRules, parse_rules
from jaxpar.parallel.schedules import bubble_fraction
from jaxpar.parallel.stage_memory import stage_memory
from jaxpar.parallel.step import accumulate, apply_outside_gradient
from jaxpar.parallel.strategy import Strategy
from jaxpar.parallel.theory import Candidate, Flow, Prediction, moe_all_to_all_bytes, stored_params, wire_bytes

AXIS = "pipe"
EXCHANGE = "padded"      # parallel.expert_exchange under vmap (the module docstring says why)


def pipelined_blocks(staged, x, *, cfg, ops, policy, constrain, seeds=None):
    """staged: blocks [v, p, Lc, ...]; x: embedded microbatches [m, b, S, D] -> (after all layers, same shape;
    the blocks' aux per layer [v, p, Lc, ...] summed over microbatches / m). seeds [m, b]: the noisy router's."""
    v, p, Lc = jax.tree.leaves(staged)[0].shape[:3]
    m = x.shape[0]
    stages = jnp.arange(p)
    on_stages = lambda a: constrain(a, ("layers", *ACTIVATION_AXES["residual"]))   # layers -> pipe

    def stage_loop(i):
        """Loop c = (i - s) // m of the microbatch each stage holds at iteration i, and whether it holds one."""
        return jnp.clip((i - stages) // m, 0, v - 1), (i >= stages) & (i - stages < v * m)

    def stage_weights(i):
        """Each stage's chunk at iteration i."""
        if v == 1:
            return jax.tree.map(lambda w: w[0], staged)
        chosen = jax.vmap(lambda w, c: jax.tree.map(lambda a: a[c], w), in_axes=(1, 0))(staged, stage_loop(i)[0])
        return checkpoint_name(chosen, "circular_weights")

    def run_stage(weights, h, seed, first_layer):
        return run_blocks(weights, h, cfg, ops, policy, seed, first_layer)

    def iteration(carry, i):
        # previous [p, b, S, D]: what each stage received last; queue [p, m, b, S, D]: each stage's copy of the
        # microbatches waiting to enter stage 0 (only stage 0's copy is read; all stay on their own device)
        previous, queue, aux = carry
        slot = jnp.full((p,), i % m)
        waiting = jax.vmap(lambda q, j: q[j])(queue, slot)
        inputs = on_stages(jnp.where((stages == 0)[:, None, None, None], waiting, previous))
        loop, holds = stage_loop(i)
        held = None if seeds is None else seeds[(i - stages) % m]
        outputs, stats = jax.vmap(run_stage, spmd_axis_name=AXIS)(stage_weights(i), inputs, held,
                                                                  (loop * p + stages) * Lc)
        place = (jnp.arange(v)[:, None] == loop[None, :]) & holds[None, :]           # [v, p]: this chunk, real
        add = lambda total, a: total + jnp.where(place.reshape(v, p, *[1] * (a.ndim - 1)), a[None] / m, 0)
        aux = jax.tree.map(add, aux, stats)
        sent = on_stages(jnp.roll(outputs, 1, axis=0))   # stage s -> s+1; the last stage -> stage 0's queue
        back = jnp.full((p,), (i - (p - 1)) % m)          # the microbatch leaving the last stage now
        file = lambda q, j, out: q.at[j].set(jnp.where(i >= p - 1, out, q[j]))
        return (sent, jax.vmap(file)(queue, back, sent), aux), None

    if v > 1:   # recompute the per-iteration weight pick in backward instead of keeping v*m + p - 1 copies
        iteration = jax.checkpoint(iteration, prevent_cse=False,
                                   policy=jax.checkpoint_policies.save_anything_except_these_names("circular_weights"))
    queue = constrain(jnp.broadcast_to(x, (p, *x.shape)), ("layers", None, *ACTIVATION_AXES["residual"]))
    one = jax.eval_shape(lambda: run_blocks(jax.tree.map(lambda w: w[0, 0], staged), x[0], cfg, ops)[1])
    aux = jax.tree.map(lambda a: jnp.zeros((v, p, *a.shape), jnp.float32), one)
    start = (on_stages(jnp.zeros((p, *x.shape[1:]), x.dtype)), queue, aux)
    (_, queue, aux), _ = jax.lax.scan(iteration, start, jnp.arange(v * m + p - 1))
    # stage 0's queue now holds every microbatch's output: share it with the other stages (one all-reduce)
    return jnp.sum(jnp.where((stages == 0)[:, None, None, None, None], queue, 0), axis=0), aux


def circular_loss(params, tokens, *, cfg, ops, outer_ops, policy, p, v, m, training=True):
    """The training objective of a [B, S+1] batch through the pipelined layers -> (loss, metrics), as
    `transformer.loss` reports them. `outer_ops` run the head (batch split over `pipe` too, so the pipe
    devices share it), `ops` the embedding, the dense stack of an MoE model and the stages. `training`: draw
    the noisy router's noise (as `transformer.loss` does; evaluation does not)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    B, S = inputs.shape
    constrain = ops.constrain
    stack = "moe_blocks" if cfg.moe else "blocks"
    x = embed(params, inputs, ops)
    if stack != "blocks" and "blocks" in params:
        x = run_blocks(params["blocks"], x, cfg, ops, policy)[0]
    # microbatch i takes rows i, i+m, ...: every microbatch spans every data shard
    micro = lambda a: a.reshape(B // m, m, *a.shape[1:]).swapaxes(0, 1)
    x = constrain(micro(x), (None, *ACTIVATION_AXES["residual"]))
    seeds = micro(noise_seeds(inputs)) if training and cfg.moe and cfg.moe.router == "noisy" else None
    layers = lambda w: w.reshape(v, p, -1, *w.shape[1:])
    out, aux = pipelined_blocks(jax.tree.map(layers, params[stack]), x, cfg=cfg, ops=ops, policy=policy,
                                constrain=constrain, seeds=seeds)
    y = outer_ops.constrain(out.swapaxes(0, 1).reshape(B, S, -1), ACTIVATION_AXES["residual"])
    ce = head_loss(params, y, targets, cfg, outer_ops)
    if not aux:
        return ce, {"loss": ce}
    losses, stats = split_aux(jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), aux))   # [L, ...], layer order
    loss = ce + sum(losses.values())
    return loss, {"loss": loss, "ce_loss": ce, **losses, **stats}


class CircularStrategy(Strategy):
    """parallel.pipe=circular: the pipelined scan, differentiated by JAX; everything else automatic, but the
    experts' exchange with parallel.expert=manual."""

    RUNS = {"pipe": ("circular",), "expert": ("manual",)}   # expert: manual_routed_experts inside the stages
    PLANNED: dict = {}   # its memory (GPipe's, every iteration kept) is not in the planner's memory model

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

    held_memory = staticmethod(stage_memory)    # gradients, stage weights, extra slots, taps (stage_memory.py)

    @classmethod
    def check(cls, config, sizes):
        v = pipe_virtual(config)
        check_pipeline(config, sizes, "circular", virtual_ok=True, min_microbatches=sizes[AXIS] if v > 1 else 1)
        if config.parallel.expert == "manual":
            ExpertStrategy.check(config, sizes)
            if config.parallel.expert_exchange not in ("auto", EXCHANGE):
                raise ConfigError("parallel.expert_exchange", f"the circular pipeline's stages exchange tokens "
                                  f"padded (vmap runs both rounds of the others); use auto or {EXCHANGE}")

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        self.p, self.v = int(mesh.shape[AXIS]), pipe_virtual(config)
        self.m = pipe_microbatches(config, self.p)
        overrides = parse_rules(config.parallel.rules)
        self.rules = AxisRules({**overrides, "layers": (AXIS,)})
        self.ops = self.ops.replace(embed=rules_embedding(self.rules), constrain=self.rules.constrain)
        if config.parallel.expert == "manual":   # the exchange's shard_map, vmapped over the stages (pipe)
            batch = self.rules.spec(("batch",))[0]
            self.ops = with_routed_experts(self.ops, partial(
                manual_routed_experts, mesh=mesh, batch_axes=batch if isinstance(batch, tuple) else (batch,),
                exchange=EXCHANGE))
        batch = (config.train.batch_size // self.microbatches) % (int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
                                                                  * self.p) == 0
        batch_rule = {"batch": ("data", "fsdp", AXIS)} if batch else {}
        outer_rules = AxisRules({**overrides, "layers": (AXIS,), **batch_rule})
        outer_ops = self.ops.replace(embed=rules_embedding(outer_rules), constrain=outer_rules.constrain)
        self.batch_sharding = NamedSharding(mesh, self.rules.spec(ACTIVATION_AXES["tokens"], mesh.axis_names))
        specs = self.rules.tree_specs(model_cfg.param_axes(), mesh.axis_names)
        if model_cfg.moe and "blocks" in specs:      # an MoE model's dense stack runs before the pipeline: not staged
            specs["blocks"] = jax.tree.map(lambda s: P(None, *s[1:]), specs["blocks"],
                                           is_leaf=lambda x: isinstance(x, P))
        self.param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        abstract = jax.eval_shape(self.make_state)
        replicated = NamedSharding(mesh, P())
        self.state_shardings = self._state_layout(abstract, self.param_shardings, replicated=replicated)
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)
        self.objective = partial(circular_loss, cfg=model_cfg, ops=self.ops, outer_ops=outer_ops, policy=self.policy,
                                 p=self.p, v=self.v, m=self.m)
        self.step_fn = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        self.eval_fn = jax.jit(self._evaluate, in_shardings=(self.param_shardings, self.batch_sharding),
                               out_shardings=replicated)

    def _evaluate(self, params, tokens):
        """The mean cross-entropy (auxiliary losses left out, no router noise)."""
        loss, metrics = self.objective(params, tokens, training=False)
        return metrics.get("ce_loss", loss)

    def _step(self, state, tokens):
        split = lambda t, a: self.ops.constrain(t.reshape(t.shape[0] // a, a, -1).swapaxes(0, 1), (None, "batch", None))
        (_, metrics), grads = accumulate(jax.value_and_grad(self.objective, has_aux=True), state["params"], tokens,
                                         self.microbatches, split=split)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        params = apply_outside_gradient(state["params"], params, metrics, self.model_cfg)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


# ============================================================================ prediction

def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """I = v·m + p - 1 scan iterations, r = train.microbatches runs per step; a = b·s·h·e one microbatch's
    activation (b: rows per batch shard, data x fsdp, x expert for MoE). Bytes as the compiled program lists them:
      pipe     `pipe_flows`.
      expert   parallel.expert=manual: every iteration each device runs its stage's L/(p·v) MoE layers on a
               microbatch (a bubble's too), `moe_all_to_all_bytes` per layer and microbatch.
    What XLA sends for data, fsdp, tensor or expert around them is not predicted."""
    p, m, v, r = cand.pipe, cand.microbatches, cand.virtual, cand.accumulate
    shards = cand.data * cand.fsdp * (cand.expert if shape.moe else 1)
    a = global_batch // shards // (m * r) * seq_len * shape.d_model * wire_bytes(cand.precision, platform)
    iterations = v * m + p - 1
    flows = pipe_flows(shape, cand, global_batch, a, iterations)
    if shape.moe and cand.expert > 1 and cand.expert_impl == "manual":
        padded = dataclasses.replace(cand, expert_exchange=EXCHANGE)
        per_microbatch = moe_all_to_all_bytes(shape, padded, global_batch, seq_len, platform, microbatches=m * r,
                                              layers=shape.moe_layers // (p * v))   # m·r microbatches' worth
        flows.append(Flow("expert", "all-to-all", per_microbatch["predicted"] * iterations / m,
                          per_microbatch["runs"] * iterations / m, False))
    return Prediction(flows, stored_params(shape, cand),
                      bubble=bubble_fraction("circular", p, m, v), stash=float(iterations),
                      note="circular: only the pipe axis and the manual experts' all_to_alls are predicted")


def pipe_flows(shape, cand: Candidate, global_batch: int, a: float, iterations: int) -> list[Flow]:
    """What the compiled step sends over `pipe` (I iterations, a one microbatch's activation, ring 2(p-1)/p):
      rolls    forward I·a; XLA splits the backward's roll into the shift s -> s-1 and the wrap 0 -> p-1, one
               permute each: every device sends one of them, but the count charges both to every device (the
               wrap, a permute over one pair of `pipe`, I·a more).
      queue    stage 0's finished microbatches shared with the others (all-reduce of m·a), and in the backward the
               cotangents of the p copies of the input queue summed (the same); with pipe the only split axis and
               v > 1, XLA also all-gathers the queue's cotangent ((p-1)/p·m·a).
      head     its batch split over pipe alone (data = fsdp = 1, expert = 1): the head's and final norm's
               gradients all-reduced over pipe once per step (fp32). With data or fsdp XLA folds them into a
               group over both: not predicted.
      chunks   v > 1, p = 2: each iteration picks every stage's chunk by a dynamic index into the pipe-sharded
               [v, p, ...] stack: forward, with pipe the only split axis, an all-reduce of the picked [p, Lc]
               chunks (2(p-1)·C, C = one chunk's fp32 params on this device, `stack_bytes` / v); backward, its
               scatter-add, an all_to_all ((p-1)·C; measured with data, expert, tensor, not fsdp). At p > 2, or
               with other axes, XLA moves the forward's over pairs of stages: not predicted. With tensor, XLA
               also sends the embedding's and head's pieces over pipe: not predicted."""
    p, m, v, r = cand.pipe, cand.microbatches, cand.virtual, cand.accumulate
    ring = 2 * (p - 1) / p
    alone = cand.data * cand.fsdp * cand.tensor * (cand.expert if shape.moe else 1) == 1
    rolls = 3 * iterations
    flows = [Flow("pipe", "permute", rolls * a * r, rolls * r, False),
             Flow("pipe", "all-reduce", 2 * ring * m * a * r, 2 * r, False)]
    if alone and v > 1:
        flows.append(Flow("pipe", "all-gather", ring / 2 * m * a * r, r, False))
    counts = shape.counts()
    if alone and global_batch // r % p == 0:
        head = (counts["lm_head"] or counts["embedding"]) + counts["final_norm"]
        flows.append(Flow("pipe", "all-reduce", ring * 4 * head, 2, False))
    if v > 1 and p == 2 and cand.fsdp == 1:
        stack = counts["blocks"] - (shape.dense_layers * block_params(shape.model) if shape.moe else 0)
        chunk = stack_bytes(shape, cand, stack, counts["experts"]) / v
        if alone:
            flows.append(Flow("pipe", "all-reduce", iterations * 2 * (p - 1) * chunk * r, iterations * r, False))
        flows.append(Flow("pipe", "all-to-all", iterations * (p - 1) * chunk * r, iterations * r, False))
    return flows

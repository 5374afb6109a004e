"""Pipeline parallelism by hand: one SPMD program runs any schedule table over the mesh axis `pipe`.

The stacked layers are cut into p·v chunks (stage s of `pipe` holds chunks s, s+p, ...; DualPipeV's V
holds s and 2p-1-s). A schedule (parallel/schedules.py) is a table tick x stage -> F/B/W;
`compile_program` (pipeline_program.py) turns it into integer tables and pipeline_executor.py runs them as
a `lax.scan` over ticks inside one `shard_map` (`lax.switch` per cell; per direction a `ppermute` over just
the pairs the table sends on that tick, none in a bubble), so the stash holds exactly the microbatches the
schedule keeps alive and each stage sends what the schedule sends. The embedding lives on the first stage, the
head and final norm on the last (parallel/stage_owned.py: a slot axis over `pipe`; checkpoints converted to the
one canonical layout), so nothing of theirs is summed over `pipe`. Around it: `data` (gradients averaged once
per step), `fsdp` (stage weights gathered once per step, gradients reduce-scattered once), `tensor`
(Megatron's f/g, or SP, with its collective matmuls too, inside every stage), `expert` (parallel/expert.py's
exchange inside the stages), gradient accumulation (the whole pipeline a times on strided slices). MoE models
pipeline `moe_blocks`; aux losses join the objective where they are made and per-layer statistics come back
in the model's layer order, so every layout equals one device accumulating over the same microbatches. `predict`
(pipeline_predict.py): the busiest stage's sends from the same table, its bubble and stash. How and why:
experiments/04_pipeline/README.md, "How jaxpar pipelines".
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.moe import with_moe_ops
from jaxpar.model.transformer import split_aux
from jaxpar.parallel.collective_matmul import collective_matmul_ops, ring_policy
from jaxpar.parallel.expert import exchange_for
from jaxpar.parallel.megatron import sequence_parallel_ops, sequence_parallel_policy, tensor_parallel_ops
from jaxpar.parallel.pipedream import delayed_gradient
from jaxpar.parallel.pipeline_executor import AXIS, StageFunctions, run_program
from jaxpar.parallel.pipeline_predict import predict
from jaxpar.parallel.pipeline_program import (  # noqa: F401  (the table's cell codes, re-exported for the lab)
    B_FIRST,
    B_MID,
    F_FIRST,
    F_LAST,
    F_MID,
    IDLE,
    W,
    compile_program,
    forward_only,
    part_ticks,
    program_for,
)
from jaxpar.parallel.rules import AxisRules, parse_rules
from jaxpar.parallel.schedules import NAMES, build, chunks_per_stage, pipeline_microbatches, placement, validate
from jaxpar.parallel.stage_memory import stage_memory
from jaxpar.parallel.stage_owned import StageOwned
from jaxpar.parallel.step import accumulate, apply_outside_gradient, clip_to_norm, make_optimizer
from jaxpar.parallel.strategy import Strategy
from jaxpar.parallel.tensor_moe import SequenceShards

BATCH_AXES = ("expert", "data", "fsdp")          # `expert` splits the batch only for MoE models


# ============================================================================ config -> schedule

def pipe_microbatches(config, p: int) -> int:
    """parallel.pipe_microbatches, 0 meaning 2 x mesh.pipe."""
    return pipeline_microbatches(p, config.parallel.pipe_microbatches)


def pipe_virtual(config) -> int:
    """parallel.pipe_virtual, 0 meaning 2 for the interleaved and DualPipeV schedules and 1 otherwise."""
    return chunks_per_stage(config.parallel.pipe, config.parallel.pipe_virtual)


def pipelined_stack(model) -> tuple[str, int]:
    """The layer stack a pipeline cuts into stages and its depth: `moe_blocks` for an MoE model (its leading
    dense layers ride with the embedding on the first stage), else `blocks`. `model`: config.model."""
    if model.moe.experts:
        return "moe_blocks", model.layers - model.moe.dense_layers
    return "blocks", model.layers


def check_pipeline(config, sizes: dict[str, int], name: str, virtual_ok: bool, min_microbatches: int) -> None:
    """What every pipeline strategy needs of a config (ConfigError, one line, before anything is built)."""
    p, v, a = sizes["pipe"], pipe_virtual(config), config.train.microbatches
    stack, layers = pipelined_stack(config.model)
    field = "model.layers" if stack == "blocks" else "model.moe.dense_layers"
    m = pipe_microbatches(config, p)
    if p < 2:
        raise ConfigError("parallel.pipe", f"is '{name}' but mesh.pipe={p}; a pipeline needs mesh.pipe >= 2 "
                          "(or parallel.pipe=auto without one)")
    if v > 1 and not virtual_ok:
        raise ConfigError("parallel.pipe_virtual", f"is {v}; only interleaved and circular run several chunks "
                          "per stage, use 1 (or 0)")
    if layers % p:
        raise ConfigError(field, f"the {layers} pipelined layers ({stack}) do not split into mesh.pipe={p} stages")
    if (layers // p) % v:
        raise ConfigError("parallel.pipe_virtual", f"v={v} chunks per stage do not divide the {layers // p} "
                          f"layers ({stack}) of each of the {p} stages")
    if m < min_microbatches:
        raise ConfigError("parallel.pipe_microbatches", f"is {m}; {name} needs at least mesh.pipe={p} "
                          "microbatches (m >= p)")
    shards = sizes["data"] * sizes["fsdp"] * (sizes["expert"] if stack == "moe_blocks" else 1)
    rows = config.train.batch_size // shards
    if rows % (m * a):
        raise ConfigError("parallel.pipe_microbatches", f"{m} microbatches x train.microbatches={a} do not divide "
                          f"the {rows} sequences of each batch shard (train.batch_size / (data x fsdp x expert))")
    if stack == "moe_blocks" and config.model.moe.dispatch == "capacity" and (rows // (m * a)) % \
            config.model.moe.group_sequences:
        raise ConfigError("model.moe.group_sequences", f"is {config.model.moe.group_sequences}; capacity groups "
                          f"must divide the {rows // (m * a)} sequences of a device's pipeline microbatch")


def check_manual_placement(config, sizes: dict[str, int]) -> None:
    """The hand-written pipeline places activations itself and runs Megatron's split over `tensor` and the
    experts' exchange over `expert`: `parallel.rules` may only choose which parameter dims `fsdp` slices."""
    fixed = {"layers"} | {n for n in ("vocab", "heads", "kv_heads", "mlp") if sizes["tensor"] > 1} | \
            ({"experts"} if sizes["expert"] > 1 else set())
    params = {"vocab", "embed", "heads", "kv_heads", "mlp", "head_dim", "norm", "experts"} - fixed
    for name, axes in parse_rules(config.parallel.rules).items():
        if name not in params or set(axes) - {"fsdp"}:
            raise ConfigError("parallel.rules", f"'{name}={'+'.join(axes)}': under parallel.pipe="
                              f"{config.parallel.pipe} a rule may only map {', '.join(sorted(params))} to fsdp "
                              "or to nothing (replicated)")


# ============================================================================ the strategy

def _dim_of(spec: P, axis: str):
    return next((d for d, entry in enumerate(spec) if entry == axis), None)


class PipelineStrategy(Strategy):
    """GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV and PipeDream-2BW over `pipe`, with data / fsdp / tensor
    (+ sequence) around them, and for MoE models the experts split over `expert` (parallel.expert=manual) and
    over `tensor` inside the stages."""

    RUNS = {"pipe": NAMES, "tensor": ("manual",), "expert": ("manual",)}   # tensor: Megatron's f/g in every stage
    PLANNED = {"pipe": ("gpipe", "1f1b", "interleaved", "zb-h1")}   # the schedules the planner's memory model fits

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

    held_memory = staticmethod(stage_memory)    # gradients, stage weights, extra slots, taps (stage_memory.py)

    @classmethod
    def check(cls, config, sizes):
        name = config.parallel.pipe
        check_pipeline(config, sizes, name, virtual_ok=name in ("interleaved", "dualpipev"),
                       min_microbatches=1 if name == "gpipe" else sizes["pipe"])
        check_manual_placement(config, sizes)
        m, p = pipe_microbatches(config, sizes["pipe"]), sizes["pipe"]
        if config.parallel.tensor_overlap != "none" and sizes["tensor"] > 2:
            raise ConfigError("parallel.tensor_overlap", f"inside a pipeline stage a ring step is an all-to-all swap, "
                              f"which is a ring for mesh.tensor=2 only (here {sizes['tensor']}; a ppermute under one "
                              "stage's branch deadlocks XLA:CPU); use mesh.tensor=2 or 'none'")
        if name == "dualpipev":
            if pipe_virtual(config) != 2:
                raise ConfigError("parallel.pipe_virtual", f"is {pipe_virtual(config)}; dualpipev holds exactly 2 "
                                  "chunks per stage (a V): use 2 (or 0)")
            if m < 2 * p:
                raise ConfigError("parallel.pipe_microbatches", f"is {m}; dualpipev needs at least 2 x mesh.pipe = "
                                  f"{2 * p} microbatches")
        if name == "interleaved":
            if pipe_virtual(config) < 2:
                raise ConfigError("parallel.pipe_virtual", "is 1; interleaved needs v >= 2 chunks per stage")
            if m % p:
                raise ConfigError("parallel.pipe_microbatches", f"is {m}; interleaved 1F1B runs microbatches in "
                                  f"groups of mesh.pipe={p}: use a multiple of {p}")
        if sizes["expert"] > 1 and config.parallel.expert != "manual":
            raise ConfigError("parallel.expert", f"is '{config.parallel.expert}' with mesh.expert={sizes['expert']}; "
                              "inside a hand-written pipeline the experts' exchange is manual: "
                              "set parallel.expert=manual")

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        sizes = {axis: int(size) for axis, size in mesh.shape.items()}
        self.p, self.v = sizes[AXIS], pipe_virtual(config)
        self.m = pipe_microbatches(config, self.p)
        self.schedule = build(config.parallel.pipe, self.p, self.m, self.v)
        validate(self.schedule)                           # before anything compiles
        self.stack, layers = pipelined_stack(config.model)
        device_of = lambda k: placement(k, self.p, self.schedule.shape)[0]
        self.owned = StageOwned(self.p, device_of(0), device_of(self.p * self.v - 1), model_cfg.tie_embeddings,
                                dense_blocks=self.stack != "blocks" and "blocks" in model_cfg.param_axes())
        # the executor reads the head from the `embed` slot when it rides there (StageOwned)
        self.loop_cfg = dataclasses.replace(model_cfg, tie_embeddings=self.owned.head_in_embed)
        self.optimizer = make_optimizer(config.train, mask=self.owned.decays, clip=False)   # clipped in `_step`
        if config.parallel.pipe == "pipedream-2bw":      # asynchronous: one step of weight staleness
            self.optimizer = delayed_gradient(self.optimizer)
        self.program = compile_program(self.schedule)
        self.eval_program = compile_program(forward_only(self.schedule))
        self.chunk_layers = layers // (self.p * self.v)
        self.live = tuple(a for a in mesh.axis_names if sizes[a] > 1)
        self.batch_axes = tuple(a for a in BATCH_AXES if a in self.live and (a != "expert" or model_cfg.moe))
        self.rules = AxisRules({**parse_rules(config.parallel.rules), "layers": (AXIS,)})
        self.sequence = bool(config.parallel.sequence)
        self.overlap = config.parallel.tensor_overlap if self.sequence else "none"
        if self.sequence:   # Megatron-LM keeps the s/t input of a column-parallel matmul and gathers it again in B
            self.policy = sequence_parallel_policy(self.policy)
        if self.overlap != "none":   # SP's collective matmuls, each ring step an all-to-all swap over tensor
            self.policy = ring_policy(self.policy, swap_axis="tensor")
        self.stage_ops = self._stage_ops(sizes)

        canonical = self.rules.tree_specs(model_cfg.param_axes(), self.live)
        if self.stack != "blocks" and "blocks" in canonical:     # the dense stack: whole in the first stage's slot
            canonical["blocks"] = jax.tree.map(lambda s: P(None, *s[1:]), canonical["blocks"],
                                               is_leaf=lambda x: isinstance(x, P))
        self.param_specs = self.owned.specs(canonical)
        self.param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.param_specs)
        replicated = NamedSharding(mesh, P())
        abstract = jax.eval_shape(self.make_state)
        self.state_shardings = self._state_layout(abstract, self.param_shardings, replicated=replicated)
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)
        self._checkpoint_layout(canonical, replicated)
        self.batch_spec = P(self.batch_axes or None, None)
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)

        # the step's view: stack [L, ...] -> [v, p, Lc, ...], model stage c*p + s on pipe device s
        staged = lambda s: P(None, AXIS, None, *s[1:])
        self.staged_specs = {**self.param_specs, self.stack: jax.tree.map(
            staged, self.param_specs[self.stack], is_leaf=lambda x: isinstance(x, P))}
        self.staged_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.staged_specs)
        aux_specs = P(None, AXIS) if model_cfg.moe else P()
        grads = jax.shard_map(self._local_grads, mesh=mesh, in_specs=(self.staged_specs, self.batch_spec),
                              out_specs=(P(), aux_specs, self.staged_specs), check_vma=False)
        self._grads = grads
        self.step_fn = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        evaluate = jax.shard_map(self._local_eval, mesh=mesh, in_specs=(self.staged_specs, self.batch_spec),
                                 out_specs=P(), check_vma=False)
        self.eval_fn = jax.jit(lambda params, tokens: evaluate(self._staged(params), tokens),
                               in_shardings=(self.param_shardings, self.batch_sharding), out_shardings=replicated)

    def _stage_ops(self, sizes):
        """The ops inside a stage: Megatron's f/g over `tensor` (with parallel.sequence its all-gathers and
        reduce-scatters, the stages then pass [b, s/t, h] on); for MoE the balance statistics over the batch
        shards, and with `expert` > 1 the routed experts' all_to_all exchange (parallel/expert.py). Under TP
        each expert's hidden dimension is split over `tensor` too (model/moe.py: f before, g after); under SP
        the router sees this rank's s/t tokens (parallel/tensor_moe.py's `SequenceShards`)."""
        if self.sequence:
            ops = sequence_parallel_ops(self.ops)
        else:
            ops = tensor_parallel_ops(self.ops) if sizes["tensor"] > 1 else self.ops
        if self.model_cfg.moe:
            changes = {"batch_mean": self._mean_over_batch}
            if sizes["expert"] > 1:
                changes["routed_experts"] = exchange_for(self.model_cfg.moe, sizes["expert"],
                                                         exchange=self.config.parallel.expert_exchange)
            if self.sequence:
                changes["sequence"] = SequenceShards("tensor", sizes["tensor"])
            ops = with_moe_ops(ops, **changes)
        if self.overlap != "none":   # the MoE blocks' feed-forward keeps SP's collectives
            ops = collective_matmul_ops(ops, "tensor", self.overlap, swap=True)
        return ops

    # ---------------------------------------------------------------- layout
    def make_state(self):
        """The initial state in the stage-owned layout (parallel/stage_owned.py)."""
        params = self.owned.to_owned(super().make_state()["params"])
        return {"params": params, "opt_state": self.optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    def _checkpoint_layout(self, canonical_specs, replicated):
        """Checkpoints hold the canonical layout: the converters to and from it, jitted into their shardings."""
        mesh, owned = self.mesh, self.owned
        abstract = jax.eval_shape(lambda: Strategy.make_state(self))
        shardings = self._state_layout(abstract, jax.tree.map(lambda s: NamedSharding(mesh, s), canonical_specs),
                                       replicated=replicated)
        self._canonical_abstract = self._with_shardings(abstract, shardings)
        keys = set(self.param_specs), set(canonical_specs)
        self._to_canonical = jax.jit(lambda st: owned.state(st, owned.to_canonical, keys[0]), out_shardings=shardings)
        self._from_canonical = jax.jit(lambda st: owned.state(st, owned.to_owned, keys[1]),
                                       out_shardings=self.state_shardings)

    @property
    def canonical_abstract_state(self):
        return self._canonical_abstract

    def to_canonical(self, state):
        with jax.set_mesh(self.mesh):
            return self._to_canonical(state)

    def from_canonical(self, state):
        with jax.set_mesh(self.mesh):
            return self._from_canonical(state)

    def _staged(self, params):
        """[L, ...] -> [v, p, Lc, ...]: model stage c*p + s goes to pipe device s (a re-deal of chunks when v > 1);
        under DualPipeV's V chunk 1 of device s is model stage 2p-1-s (the second half reversed)."""
        to = lambda w: self._v_order(w.reshape(self.v, self.p, self.chunk_layers, *w.shape[1:]))
        staged = {**params, self.stack: jax.tree.map(to, params[self.stack])}
        return jax.lax.with_sharding_constraint(staged, self.staged_shardings)

    def _v_order(self, w):
        """[v, p, ...] in model-stage order <-> the V's placement (its own inverse); the loop: as it is."""
        return w if self.schedule.shape != "v" else jnp.concatenate([w[:1], w[1:, ::-1]])

    def _unstaged(self, grads):
        back = lambda g: self._v_order(g).reshape(-1, *g.shape[3:])
        grads = {**grads, self.stack: jax.tree.map(back, grads[self.stack])}
        return jax.lax.with_sharding_constraint(grads, self.param_shardings)

    # ---------------------------------------------------------------- the step (global view)
    def _step(self, state, tokens):
        ce, aux, grads = self._grads(self._staged(state["params"]), tokens)
        grads = self._unstaged(grads)
        norm = self.owned.norm(grads)                 # the canonical gradient's (a tied copy counted once)
        clipped = clip_to_norm(grads, norm, self.config.train.grad_clip)
        updates, opt_state = self.optimizer.update(clipped, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = self._metrics(ce, aux)
        params = apply_outside_gradient(state["params"], params, metrics, self.model_cfg)
        metrics = {**metrics, "grad_norm": norm}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def _metrics(self, ce, aux):
        """The single device's metrics: loss = cross-entropy + the aux losses summed over layers, and each
        statistic per layer ([v, p, Lc, ...] -> [L, ...], the model's layer order)."""
        if not self.model_cfg.moe:
            return {"loss": ce}
        per_layer = jax.tree.map(lambda a: self._v_order(a).reshape(-1, *a.shape[3:]), aux)   # the V: in order
        losses, stats = split_aux(per_layer)
        return {"loss": ce + sum(losses.values()), "ce_loss": ce, **losses, **stats}

    # ---------------------------------------------------------------- per device (inside shard_map)
    def _gather_fsdp(self, params):
        """fsdp: this stage's weights were sliced at rest; all-gather them once for the step."""
        if "fsdp" not in self.live:
            return params
        def gather(w, spec):
            dim = _dim_of(spec, "fsdp")
            return w if dim is None else jax.lax.all_gather(w, "fsdp", axis=dim, tiled=True)
        return jax.tree.map(gather, params, self.staged_specs, is_leaf=lambda x: isinstance(x, P))

    def _split(self, params):
        chunks = jax.tree.map(lambda w: w[:, 0].astype(self.ops.dtype), params[self.stack])   # [v, Lc, ...]
        outer = self.owned.local({k: w for k, w in params.items() if k != self.stack})   # this stage's slots
        return chunks, outer

    def _local_grads(self, params, tokens):
        """(cross-entropy, aux [v, 1, Lc, ...], grads) of this device's stage and batch shard, accumulated over
        train.microbatches runs of the whole pipeline (rows i, i+a, ... each)."""
        stage = StageFunctions(self.model_cfg, self.stage_ops, self.policy, self.schedule.split_backward,
                               self.chunk_layers, self.m)
        self.stage_functions = stage            # the residual layout, for the lab's memory prediction

        def one_run(params, tokens):
            chunks, outer = self._split(params)
            ce, grads, aux = run_program(self.program, stage, chunks, outer, tokens, cfg=self.loop_cfg,
                                         ops=self.stage_ops, train=True)
            return (ce, {"loss": ce, "aux": aux}), {**jax.tree.map(lambda g: g[None], grads["outer"]),   # its slot
                                                    self.stack: jax.tree.map(lambda g: g[:, None], grads["chunks"])}

        (ce, out), grads = accumulate(one_run, self._gather_fsdp(params), tokens, self.microbatches)
        aux = out["aux"]      # the embedding's, head's and final norm's gradients: their owner's alone (no psum)
        if self.sequence:   # SP: a weight not split over tensor saw this device's s/t tokens only
            grads = jax.tree.map(lambda g, spec: g if "tensor" in jax.tree.leaves(tuple(spec)) else
                                 jax.lax.psum(g, "tensor"), grads, self.staged_specs,
                                 is_leaf=lambda x: isinstance(x, P))
        aux = jax.tree.map(lambda a: self._mean_over_batch(a)[:, None], aux)
        grads = self.owned.exchange_tied(self._reduce_grads(grads))
        return self._mean_over_batch(jax.lax.psum(ce, AXIS)), aux, grads

    def _local_eval(self, params, tokens):
        chunks, outer = self._split(self._gather_fsdp(params))
        stage = StageFunctions(self.model_cfg, self.stage_ops, None, False, self.chunk_layers)
        loss, _, _ = run_program(self.eval_program, stage, chunks, outer, tokens, cfg=self.loop_cfg,
                                 ops=self.stage_ops, train=False)
        return self._mean_over_batch(jax.lax.psum(loss, AXIS))

    def _mean_over_batch(self, x):
        for axis in self.batch_axes:
            x = jax.lax.pmean(x, axis)
        return x

    def _reduce_grads(self, grads):
        """Mean over the batch shards: all-reduce over data, reduce-scatter over fsdp where the weight is sliced;
        over `expert`, the experts' own gradients already hold every shard's tokens (the exchange's transpose)."""
        shards = 1
        for axis in self.batch_axes:
            def reduce(g, spec, axis=axis):
                dim = _dim_of(spec, axis)
                if dim is None:
                    return jax.lax.psum(g, axis)
                if axis == "expert":
                    return g
                return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
            grads = jax.tree.map(reduce, grads, self.staged_specs, is_leaf=lambda x: isinstance(x, P))
            shards *= self.mesh.shape[axis]
        return jax.tree.map(lambda g: g / shards, grads)

"""Pipeline parallelism by hand: one SPMD program runs any schedule table over the mesh axis `pipe`.

The model's stacked `layers` axis is cut into p·v contiguous chunks (model stages);
stage s of the `pipe` axis holds chunks s, s+p, ... (v = 1: one contiguous slice). The
embedding runs on the first model stage, the head and the loss on the last, all with
the model's own pieces (`embed`, `run_blocks` on a chunk, `head_loss`).

A schedule (`parallel/schedules.py`) is a table tick x stage -> F/B/W. `compile_program`
turns it into integer tables: which branch each stage runs at each tick, on which
microbatch and chunk, and which buffer slot it reads and writes. The step is a
`lax.scan` over ticks inside one `shard_map`; each tick every device

  1. runs its cell with `lax.switch` (idle, F, B or W; the first and last model stages
     have their own F and B, which embed or take the loss),
  2. sends its forward output to the next stage and its input gradient to the previous
     one (two `ppermute`s over `pipe`),
  3. files what arrived into the slot the table names.

F is `jax.vjp` of the chunk: the output goes on, the residuals (activations) are kept
in the stash slot until B applies them to the gradient that came back. So the stash
holds exactly the microbatches the schedule keeps alive: m slots for GPipe, p for
1F1B, which is what the compiled memory shows. The last model stage differentiates
the loss as soon as its F is done (the loss is the end of the graph) and keeps dy for
its B. Under zb-h1 B returns the input gradient and the matmuls' (x, dy) "taps"
(`parallel/deferred.py`), and W turns the taps into weight gradients later.

Around the pipeline: data parallel (`data`) splits the batch and averages gradients
once per step; `fsdp` keeps parameters and Adam state sliced at rest, all-gathers each
stage's weights once per step and reduce-scatters its gradients once (Megatron's
distributed optimizer with pipelining); `tensor` runs Megatron's f/g inside every
stage (`parallel/megatron.py`). The embedding and head are replicated over `pipe`;
their gradients (non-zero on the first and last stage only) are summed over `pipe`,
Megatron's embedding all-reduce. Pipeline microbatches are the pipeline's own:
gradient accumulation (train.microbatches > 1) does not combine with them. `predict` (end of
file) counts the busiest stage's sends from the same table, with its bubble and stash.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.transformer import embed, head_loss, run_blocks
from jaxpar.parallel import deferred
from jaxpar.parallel.megatron import tensor_parallel_ops
from jaxpar.parallel.rules import AxisRules, parse_rules
from jaxpar.parallel.schedules import NAMES, Schedule, bubble_fraction, build, run_orders, validate
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

AXIS = "pipe"
BATCH_AXES = ("data", "fsdp")
# a table cell: F and B on the first / a middle / the last model stage differ in what they do around the chunk
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, W = range(7)


# ============================================================================ config -> schedule

def pipe_microbatches(config, p: int) -> int:
    """parallel.pipe_microbatches, 0 meaning 2 x mesh.pipe."""
    return config.parallel.pipe_microbatches or 2 * p


def pipe_virtual(config) -> int:
    """parallel.pipe_virtual, 0 meaning 2 for the interleaved schedule and 1 otherwise."""
    return config.parallel.pipe_virtual or (2 if config.parallel.pipe == "interleaved" else 1)


def check_pipeline(config, sizes: dict[str, int], name: str, virtual_ok: bool, min_microbatches: int) -> None:
    """What every pipeline trainer needs of a config (ConfigError, one line, before anything is built)."""
    p, v, layers = sizes["pipe"], pipe_virtual(config), config.model.layers
    m = pipe_microbatches(config, p)
    if p < 2:
        raise ConfigError("parallel.pipe", f"is '{name}' but mesh.pipe={p}; a pipeline needs mesh.pipe >= 2 "
                          "(or parallel.pipe=auto without one)")
    if config.train.microbatches != 1:
        raise ConfigError("train.microbatches", f"is {config.train.microbatches}; under a pipeline the microbatches "
                          "are the pipeline's own: set train.microbatches=1 and parallel.pipe_microbatches")
    if config.parallel.rules:
        raise ConfigError("parallel.rules", "the pipeline trainers place parameters themselves; leave it empty")
    if v > 1 and not virtual_ok:
        raise ConfigError("parallel.pipe_virtual", f"is {v}; only interleaved and circular run several chunks "
                          "per stage, use 1 (or 0)")
    if layers % p:
        raise ConfigError("model.layers", f"{layers} layers do not split into mesh.pipe={p} stages")
    if (layers // p) % v:
        raise ConfigError("parallel.pipe_virtual", f"v={v} chunks per stage do not divide the {layers // p} "
                          f"layers of each of the {p} stages (model.layers={layers})")
    if m < min_microbatches:
        raise ConfigError("parallel.pipe_microbatches", f"is {m}; {name} needs at least mesh.pipe={p} "
                          "microbatches (m >= p)")
    rows = config.train.batch_size // (sizes["data"] * sizes["fsdp"])
    if rows % m:
        raise ConfigError("parallel.pipe_microbatches", f"{m} microbatches do not divide the {rows} sequences "
                          "of each data-parallel shard (train.batch_size / (data x fsdp))")


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a schedule, in each stage's order, run as early as they can (evaluation)."""
    orders = [[row[s] for row in schedule.grid if row[s] is not None and row[s].kind == "F"]
              for s in range(schedule.stages)]
    return dataclasses.replace(schedule, name=f"{schedule.name} forward", split_backward=False,
                               grid=run_orders(orders, schedule.virtual, False))


# ============================================================================ table -> program

class _Slots:
    """The slots of one stage's buffer: a new item takes the lowest free slot; `size` is the most used."""

    def __init__(self):
        self.held: dict = {}
        self.size = 0

    def take(self, key) -> int:
        used = set(self.held.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.held[key] = slot
        self.size = max(self.size, slot + 1)
        return slot

    def free(self, key) -> int:
        return self.held.pop(key)


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule as integer tables [ticks, stages], and the buffer sizes its slots need.

    branch, microbatch, chunk: what the stage runs. act / grad: the slot of the activation
    F reads / the gradient B reads (F on the last model stage writes its dy there). stash:
    where F keeps its residuals and B finds them; wstash: where B keeps the taps for W.
    act_in / grad_in: the slot an arriving activation / gradient is filed into (the extra
    last slot of the buffer takes what arrives when nothing was sent).
    """

    schedule: Schedule
    table: dict
    slots: dict

    @property
    def ticks(self) -> int:
        return self.schedule.ticks


FIELDS = ("branch", "microbatch", "chunk", "act", "grad", "stash", "wstash", "act_in", "grad_in")


def compile_program(schedule: Schedule) -> Program:
    p, K, T = schedule.stages, schedule.model_stages, schedule.ticks
    table = {f: np.zeros((T, p), np.int32) for f in FIELDS}
    table["act_in"][:] = table["grad_in"][:] = -1
    pools = [{b: _Slots() for b in ("act", "grad", "stash", "wstash")} for _ in range(p)]
    for t, row in enumerate(schedule.grid):
        arrivals = []
        for s, action in enumerate(row):
            if action is None:
                continue
            k, key, pool = schedule.model_stage(s, action.chunk), (action.microbatch, action.chunk), pools[s]
            table["microbatch"][t, s], table["chunk"][t, s] = action.microbatch, action.chunk
            if action.kind == "F":
                table["branch"][t, s] = F_FIRST if k == 0 else F_LAST if k == K - 1 else F_MID
                if k > 0:
                    table["act"][t, s] = pool["act"].free(key)
                table["stash"][t, s] = pool["stash"].take(key)
                if k == K - 1:
                    table["grad"][t, s] = pool["grad"].take(key)
                else:
                    arrivals.append(("act", (s + 1) % p, (action.microbatch, (k + 1) // p)))
            elif action.kind == "B":
                table["branch"][t, s] = B_FIRST if k == 0 else B_MID
                table["grad"][t, s] = pool["grad"].free(key)
                table["stash"][t, s] = pool["stash"].free(key)
                if schedule.split_backward:
                    table["wstash"][t, s] = pool["wstash"].take(key)
                if k > 0:
                    arrivals.append(("grad", (s - 1) % p, (action.microbatch, (k - 1) // p)))
            else:
                table["branch"][t, s] = W
                table["wstash"][t, s] = pool["wstash"].free(key)
        for buffer, s, key in arrivals:
            table[f"{buffer}_in"][t, s] = pools[s][buffer].take(key)
    slots = {b: max(pool[b].size for pool in pools) for b in ("act", "grad", "stash", "wstash")}
    for buffer in ("act", "grad"):
        table[f"{buffer}_in"][table[f"{buffer}_in"] < 0] = slots[buffer]     # nothing sent: the spare slot
    return Program(schedule, table, slots)


# ============================================================================ one stage's chunk

class StageFunctions:
    """One chunk of layers as a stage runs it: a forward that keeps jax.vjp's residuals (without the
    weights, which stay where they are), the backward that applies them, and under the split
    backward (zb-h1) the deferred weight step. `plan` traces the chunk once, before the tick loop,
    to learn the residuals' layout; F and B are traced in different branches and meet through it."""

    def __init__(self, cfg, ops, policy, split: bool, chunk_layers: int):
        self.cfg, self.policy, self.split, self.chunk_layers = cfg, policy, split, chunk_layers
        self.sites: dict = {}
        self.base_matmul = ops.matmul
        self.ops = deferred.deferred_ops(ops, self.sites) if split else ops

    def run(self, weights, x, taps=None):
        blocks = weights if taps is None else {**weights, "taps": taps}
        y, aux = run_blocks(blocks, x, self.cfg, self.ops, self.policy)
        if any(name.endswith("_loss") for name in aux):
            raise NotImplementedError("the pipeline trainers do not carry the blocks' auxiliary losses yet")
        return y

    def _vjp(self, weights, x):
        if self.split:
            taps = deferred.zero_taps(self.sites, self.chunk_layers)
            return jax.vjp(lambda w, t, x: self.run(w, x, t), weights, taps, x)
        return jax.vjp(self.run, weights, x)

    def plan(self, weights, x) -> None:
        if self.split:
            self.run(weights, x, deferred.recording_taps(deferred.deferred_names(weights)))
        _, pullback = self._vjp(weights, x)
        leaves, self.treedef = jax.tree.flatten(pullback)
        params = jax.tree.leaves(weights)
        self.sources = [next((i for i, w in enumerate(params) if w is leaf), None) for leaf in leaves]
        self.kept = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf, src in zip(leaves, self.sources)
                     if src is None]

    def forward(self, weights, x):
        """F: (output, residuals to keep)."""
        y, pullback = self._vjp(weights, x)
        leaves, params = jax.tree.leaves(pullback), jax.tree.leaves(weights)
        assert len(leaves) == len(self.sources) and all(
            leaf is params[src] for leaf, src in zip(leaves, self.sources) if src is not None), "residual layout changed"
        return y, [leaf for leaf, src in zip(leaves, self.sources) if src is None]

    def backward(self, weights, kept, dy):
        """B: (weight gradients computed now, taps for W or None, input gradient)."""
        stored, params = iter(kept), jax.tree.leaves(weights)
        pullback = jax.tree.unflatten(self.treedef, [next(stored) if src is None else params[src]
                                                     for src in self.sources])
        if not self.split:
            dw, dx = pullback(dy)
            return dw, None, dx
        dw, taps, dx = pullback(dy)
        return {k: g for k, g in dw.items() if k not in taps}, taps, dx

    def weight(self, weights, taps):
        """W: the deferred weight gradients from their taps."""
        return deferred.weight_grads(self.base_matmul, self.sites, weights, taps)


# ============================================================================ the executor

def _put(buffer, slot, value):
    return jax.tree.map(lambda b, v: b.at[slot].set(v.astype(b.dtype)), buffer, value)


def _get(buffer, slot):
    return jax.tree.map(lambda b: b[slot], buffer)


def scoped(part: str):
    """Run under the named scope `pipeline_<part>`: the compiled HLO's metadata then says which part of a
    tick each instruction belongs to (measure/executed.py, the lab's timeline)."""
    def wrap(fn):
        def run(*args):
            with jax.named_scope(f"pipeline_{part}"):
                return fn(*args)
        return run
    return wrap


PARTS = {"F": (F_FIRST, F_MID, F_LAST), "embed": (F_FIRST,), "head": (F_LAST,), "B": (B_FIRST, B_MID),
         "embed_grad": (B_FIRST,), "W": (W,)}


def part_ticks(program: Program) -> dict[str, np.ndarray]:
    """Per part of a tick (PARTS): on how many ticks each stage runs it."""
    return {part: np.isin(program.table["branch"], codes).sum(axis=0) for part, codes in PARTS.items()}


def run_program(program: Program, stage: StageFunctions, chunks, outer, tokens, *, cfg, ops, train: bool):
    """Run the tick loop on this device: chunks [v, Lc, ...] (compute dtype), outer = embed / final_norm /
    lm_head, tokens [rows, S+1] this data shard's. Returns (sum of microbatch losses / m, grads or None).

    The big buffers (stash, gradient accumulators, received activations) never pass through the tick's
    `lax.switch`: each tick slices out the one slot its cell uses, the branch returns that slot's new
    value, and the slot is written back after. (Threaded through the switch, XLA copies every buffer
    on every tick.)"""
    sched = program.schedule
    p, v, m = sched.stages, sched.virtual, sched.microbatches
    me = jax.lax.axis_index(AXIS)
    micro = tokens.reshape(m, tokens.shape[0] // m, tokens.shape[1])
    inputs, targets = micro[:, :, :-1], micro[:, :, 1:]
    head_names = ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")
    dtype = ops.dtype

    def embed_of(microbatch):
        return embed(outer, inputs[microbatch], ops)

    act_shape = jax.eval_shape(embed_of, 0)
    zeros_act = jnp.zeros(act_shape.shape, act_shape.dtype)
    zeros_outer = lambda: jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), outer)
    if train:
        stage.plan(jax.tree.map(lambda w: w[0], chunks), zeros_act)

    # ---- the branches: (this tick's slots, row) -> the slots' new values and what leaves the device
    def idle(io, row):
        return {**io, "send_act": zeros_act, "send_grad": zeros_act, "d_outer": zeros_outer(),
                "loss": jnp.zeros((), jnp.float32)}

    @scoped("head")
    def head(y, row):
        """The last model stage: the loss, and at once its gradient (the loss ends the graph)."""
        head = {k: outer[k] for k in head_names}
        objective = lambda head, y: head_loss(head, y, targets[row["microbatch"]], cfg, ops) / m
        if not train:
            return objective(head, y), zeros_outer(), zeros_act
        loss, (d_head, dy) = jax.value_and_grad(objective, argnums=(0, 1))(head, y)
        return loss, {**zeros_outer(), **d_head}, dy.astype(dtype)

    @scoped("F")
    def forward(io, row):
        out = idle(io, row)
        x = jax.lax.cond(row["branch"] == F_FIRST, scoped("embed")(lambda: embed_of(row["microbatch"])),
                         lambda: io["x"])
        weights = jax.tree.map(lambda w: w[row["chunk"]], chunks)
        if train:
            y, out["kept"] = stage.forward(weights, x)
        else:
            y = stage.run(weights, x)
        no_head = lambda y, row: (jnp.zeros((), jnp.float32), zeros_outer(), io["dy"] if train else zeros_act)
        loss, d_outer, dy = jax.lax.cond(row["branch"] == F_LAST, head, no_head, y, row)
        out.update(loss=loss, d_outer=d_outer, send_act=y.astype(dtype))
        if train:
            out["dy"] = dy
        return out

    @scoped("embed_grad")
    def embed_grad(dx, row):
        """The first model stage: the input gradient becomes the embedding's."""
        tokens_in = inputs[row["microbatch"]]
        (d_embed,) = jax.vjp(lambda table: embed({"embed": table}, tokens_in, ops), outer["embed"])[1](dx)
        return {**zeros_outer(), "embed": d_embed}

    @scoped("B")
    def backward(io, row):
        out = idle(io, row)
        weights = jax.tree.map(lambda w: w[row["chunk"]], chunks)
        dw, taps, dx = stage.backward(weights, io["kept"], io["dy"])
        out["acc"] = {k: a + dw[k].astype(a.dtype) if k in dw else a for k, a in io["acc"].items()}
        if taps is not None:
            out["taps"] = taps
        out["d_outer"] = jax.lax.cond(row["branch"] == B_FIRST, embed_grad, lambda dx, row: zeros_outer(), dx, row)
        out["send_grad"] = dx.astype(dtype)
        return out

    @scoped("W")
    def weight(io, row):
        out = idle(io, row)
        dw = stage.weight(jax.tree.map(lambda w: w[row["chunk"]], chunks), io["taps"])
        out["acc"] = {k: a + dw[k].astype(a.dtype) if k in dw else a for k, a in io["acc"].items()}
        return out

    # the switch runs one of these per tick; the table's F/B variants pick their first/last parts inside
    kinds = jnp.asarray(np.array([0, 1, 1, 1, 2, 2, 3], np.int32))   # cell -> idle, forward, backward, weight
    branches = [idle, forward, backward, weight][:(4 if sched.split_backward else 3) if train else 2]

    # ---- the buffers
    slots = program.slots
    carry = {"acts": jnp.zeros((slots["act"] + 1, *act_shape.shape), dtype), "loss": jnp.zeros((), jnp.float32)}
    if train:
        carry["grads_in"] = jnp.zeros((slots["grad"] + 1, *act_shape.shape), dtype)
        carry["stash"] = [jnp.zeros((max(slots["stash"], 1), *a.shape), a.dtype) for a in stage.kept]
        carry["chunk_grads"] = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), chunks)
        carry["outer_grads"] = zeros_outer()
        if sched.split_backward:
            carry["wstash"] = {k: tuple(jnp.zeros((slots["wstash"], stage.chunk_layers, *s.shape), s.dtype)
                                        for s in (site.x, site.y)) for k, site in stage.sites.items()}
    forward_pairs = [(s, (s + 1) % p) for s in range(p if v > 1 else p - 1)]     # v > 1: a ring
    backward_pairs = [(b, a) for a, b in forward_pairs]
    table = {k: jnp.asarray(t) for k, t in program.table.items()}

    def tick(carry, t):
        row = {k: column[t, me] for k, column in table.items()}
        io = {"x": carry["acts"][row["act"]]}
        if train:
            io.update(dy=carry["grads_in"][row["grad"]], kept=_get(carry["stash"], row["stash"]),
                      acc=_get(carry["chunk_grads"], row["chunk"]))
            if sched.split_backward:
                io["taps"] = _get(carry["wstash"], row["wstash"])
        out = jax.lax.switch(kinds[row["branch"]], branches, io, row)
        carry = {**carry, "loss": carry["loss"] + out["loss"]}
        if train:
            carry["grads_in"] = carry["grads_in"].at[row["grad"]].set(out["dy"])
            carry["stash"] = _put(carry["stash"], row["stash"], out["kept"])
            carry["chunk_grads"] = _put(carry["chunk_grads"], row["chunk"], out["acc"])
            carry["outer_grads"] = jax.tree.map(jnp.add, carry["outer_grads"], out["d_outer"])
            if sched.split_backward:
                carry["wstash"] = _put(carry["wstash"], row["wstash"], out["taps"])
            carry["grads_in"] = carry["grads_in"].at[row["grad_in"]].set(
                jax.lax.ppermute(out["send_grad"], AXIS, backward_pairs))
        carry["acts"] = carry["acts"].at[row["act_in"]].set(jax.lax.ppermute(out["send_act"], AXIS, forward_pairs))
        return carry, None

    carry, _ = jax.lax.scan(tick, carry, jnp.arange(program.ticks))
    grads = {"chunks": carry["chunk_grads"], "outer": carry["outer_grads"]} if train else None
    return carry["loss"], grads


# ============================================================================ the trainer

def _dim_of(spec: P, axis: str):
    return next((d for d, entry in enumerate(spec) if entry == axis), None)


class PipelineTrainer(Strategy):
    """GPipe, 1F1B, interleaved 1F1B and ZB-H1 over `pipe`, with data / fsdp / tensor around them."""

    RUNS = {"pipe": NAMES}
    PLANNED = {"pipe": ("gpipe", "1f1b", "interleaved", "zb-h1")}   # the schedules the planner's memory model fits

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)

    @classmethod
    def check(cls, config, sizes):
        name = config.parallel.pipe
        check_pipeline(config, sizes, name, virtual_ok=name == "interleaved",
                       min_microbatches=1 if name == "gpipe" else sizes["pipe"])
        m, p = pipe_microbatches(config, sizes["pipe"]), sizes["pipe"]
        if name == "interleaved":
            if pipe_virtual(config) < 2:
                raise ConfigError("parallel.pipe_virtual", "is 1; interleaved needs v >= 2 chunks per stage")
            if m % p:
                raise ConfigError("parallel.pipe_microbatches", f"is {m}; interleaved 1F1B runs microbatches in "
                                  f"groups of mesh.pipe={p}: use a multiple of {p}")

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        sizes = {axis: int(size) for axis, size in mesh.shape.items()}
        self.p, self.v = sizes[AXIS], pipe_virtual(config)
        self.m = pipe_microbatches(config, self.p)
        self.schedule = build(config.parallel.pipe, self.p, self.m, self.v)
        validate(self.schedule)                           # before anything compiles
        self.program = compile_program(self.schedule)
        self.eval_program = compile_program(forward_only(self.schedule))
        self.chunk_layers = model_cfg.layers // (self.p * self.v)
        self.live = tuple(a for a in mesh.axis_names if sizes[a] > 1)
        self.rules = AxisRules({**parse_rules(config.parallel.rules), "layers": (AXIS,)})
        self.stage_ops = tensor_parallel_ops(self.ops) if sizes["tensor"] > 1 else self.ops

        abstract = jax.eval_shape(self.make_state)
        self.param_specs = self.rules.tree_specs(model_cfg.param_axes(), self.live)
        self.param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.param_specs)
        replicated = NamedSharding(mesh, P())
        self.state_shardings = self._state_layout(abstract, self.param_shardings, replicated=replicated)
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)
        batch_axes = tuple(a for a in BATCH_AXES if a in self.live) or None
        self.batch_spec = P(batch_axes, None)
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)

        # the step's view: blocks [L, ...] -> [v, p, Lc, ...], model stage c*p + s on pipe device s
        self.staged_specs = {**self.param_specs,
                             "blocks": jax.tree.map(lambda s: P(None, AXIS, None, *s[1:]), self.param_specs["blocks"],
                                                    is_leaf=lambda x: isinstance(x, P))}
        self.staged_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.staged_specs)
        grads = jax.shard_map(self._local_grads, mesh=mesh, in_specs=(self.staged_specs, self.batch_spec),
                              out_specs=(P(), self.staged_specs), check_vma=False)
        self._grads = grads
        self.step_fn = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        evaluate = jax.shard_map(self._local_eval, mesh=mesh, in_specs=(self.staged_specs, self.batch_spec),
                                 out_specs=P(), check_vma=False)
        self.eval_fn = jax.jit(lambda params, tokens: evaluate(self._staged(params), tokens),
                               in_shardings=(self.param_shardings, self.batch_sharding), out_shardings=replicated)

    # ---------------------------------------------------------------- layout
    def _staged(self, params):
        """[L, ...] -> [v, p, Lc, ...]: model stage c*p + s goes to pipe device s (a re-deal of chunks when v > 1)."""
        to = lambda w: w.reshape(self.v, self.p, self.chunk_layers, *w.shape[1:])
        staged = {**params, "blocks": jax.tree.map(to, params["blocks"])}
        return jax.lax.with_sharding_constraint(staged, self.staged_shardings)

    def _unstaged(self, grads):
        back = lambda g: g.reshape(-1, *g.shape[3:])
        grads = {**grads, "blocks": jax.tree.map(back, grads["blocks"])}
        return jax.lax.with_sharding_constraint(grads, self.param_shardings)

    # ---------------------------------------------------------------- the step (global view)
    def _step(self, state, tokens):
        loss, grads = self._grads(self._staged(state["params"]), tokens)
        grads = self._unstaged(grads)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

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
        chunks = jax.tree.map(lambda w: w[:, 0].astype(self.ops.dtype), params["blocks"])   # [v, Lc, ...]
        outer = {k: w for k, w in params.items() if k != "blocks"}
        return chunks, outer

    def _local_grads(self, params, tokens):
        chunks, outer = self._split(self._gather_fsdp(params))
        stage = StageFunctions(self.model_cfg, self.stage_ops, self.policy, self.schedule.split_backward,
                               self.chunk_layers)
        self.stage_functions = stage            # the residual layout, for the lab's memory prediction
        loss, grads = run_program(self.program, stage, chunks, outer, tokens, cfg=self.model_cfg,
                                  ops=self.stage_ops, train=True)
        grads = {**grads["outer"], "blocks": jax.tree.map(lambda g: g[:, None], grads["chunks"])}
        grads = {**grads, **{k: jax.lax.psum(grads[k], AXIS) for k in outer}}   # first / last stage's
        return self._mean_over_batch(jax.lax.psum(loss, AXIS)), self._reduce_grads(grads)

    def _local_eval(self, params, tokens):
        chunks, outer = self._split(self._gather_fsdp(params))
        stage = StageFunctions(self.model_cfg, self.stage_ops, None, False, self.chunk_layers)
        loss, _ = run_program(self.eval_program, stage, chunks, outer, tokens, cfg=self.model_cfg,
                              ops=self.stage_ops, train=False)
        return self._mean_over_batch(jax.lax.psum(loss, AXIS))

    def _mean_over_batch(self, x):
        for axis in BATCH_AXES:
            if axis in self.live:
                x = jax.lax.pmean(x, axis)
        return x

    def _reduce_grads(self, grads):
        """Mean over the batch shards: all-reduce over data, reduce-scatter over fsdp where the weight is sliced."""
        shards = 1
        if "data" in self.live:
            grads = jax.lax.psum(grads, "data")
            shards *= self.mesh.shape["data"]
        if "fsdp" in self.live:
            def reduce(g, spec):
                dim = _dim_of(spec, "fsdp")
                if dim is None:
                    return jax.lax.psum(g, "fsdp")
                return jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)
            grads = jax.tree.map(reduce, grads, self.staged_specs, is_leaf=lambda x: isinstance(x, P))
            shards *= self.mesh.shape["fsdp"]
        return jax.tree.map(lambda g: g / shards, grads)


# ============================================================================ prediction

@functools.lru_cache(maxsize=256)
def program_for(name: str, p: int, m: int, v: int) -> Program:
    """The compiled table of a schedule (cached: the planner asks for the same few many times)."""
    return compile_program(build(name, p, m, v))


def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """Bytes per device per step on the busiest stage, from the schedule's own table (T ticks).

    a = b·s·h·e, one microbatch's activation (b rows per data shard, e = `wire_bytes`).
      pipe    2·T·a: every tick each stage sends one activation forward and one gradient backward (lock-step
              SPMD: a buffer moves even in a bubble; the textbook 2(p-1)·m·a counts only the useful ones,
              `schedules.p2p_bytes`), + the embedding/head gradients summed over pipe, 2(p-1)/p·4·Ψ_o/T.
      tensor  Megatron, 2(T-1)/T·a each: 2 per layer per F, 2 per layer per B (zb-h1's W has none), +1 per
              layer per B with remat full, + 1 per embedding lookup and 1 per head.
      data    the stage's gradients all-reduced once, 2(D-1)/D·4·(Ψ_L/p + Ψ_o)/T.
      fsdp    the stage's fp32 weights all-gathered once and gradients reduce-scattered once, (F-1)/F·4·(..) each.
    """
    p, D, F, T, m, v = cand.pipe, cand.data, cand.fsdp, cand.tensor, cand.microbatches, cand.virtual
    e = wire_bytes(cand.precision, platform)
    a = global_batch // (D * F) // m * seq_len * shape.d_model * e
    counts = shape.counts()
    psi_layers, psi_other = counts["blocks"], counts["total"] - counts["blocks"]
    stage = (psi_layers / p + psi_other) / T
    program = program_for(cand.schedule, p, m, v)
    ticks = part_ticks(program)
    out = [Flow("pipe", "permute", 2 * program.ticks * a, 2 * program.ticks, False),
           Flow("pipe", "all-reduce", 2 * (p - 1) / p * 4 * psi_other / T, OTHER_WEIGHTS, False)]
    if T > 1:
        chunk = shape.layers // (p * v)
        per_backward = 2 + (1 if cand.remat == "full" else 0)
        reductions = float(((2 * ticks["F"] + per_backward * ticks["B"]) * chunk + ticks["embed"]
                            + ticks["head"]).max())
        out.append(Flow("tensor", "all-reduce", reductions * 2 * (T - 1) / T * a, reductions, False))
    arrays = WEIGHTS_PER_LAYER + OTHER_WEIGHTS
    if D > 1:
        out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * 4 * stage, arrays, False))
    if F > 1:
        out.append(Flow("fsdp", "all-gather", (F - 1) / F * 4 * stage, arrays, False))
        out.append(Flow("fsdp", "reduce-scatter", (F - 1) / F * 4 * stage, arrays, False))
    return Prediction(out, stored_params(shape, cand), bubble=bubble_fraction(cand.schedule, p, m, v), stash=program.slots["stash"])

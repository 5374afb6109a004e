"""The pipeline executor: one SPMD program that runs a compiled schedule table (pipeline_program.py) on each
device of the `pipe` axis, as a `lax.scan` over ticks (how a tick works: pipeline.py's docstring).

`StageFunctions` is one chunk of layers as a stage runs it (F keeps jax.vjp's residuals, B applies them, W
takes the deferred weight gradients); `run_program` is the tick loop; `_TickLoop` holds what one device's
loop needs (its branches, buffers and sends). Split out of pipeline.py, which builds the strategy around it.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model.moe import noise_seeds
from jaxpar.model.transformer import embed, head_loss, run_blocks, split_aux
from jaxpar.parallel import deferred
from jaxpar.parallel.pipeline_program import ARRIVALS, B_FIRST, F_FIRST, F_LAST, ROUTES, Program
from jaxpar.parallel.step import microbatch_rows

AXIS = "pipe"


class StageFunctions:
    """One chunk of layers as a stage runs it: a forward that keeps jax.vjp's residuals (without the
    weights, which stay where they are), the backward that applies them, and under the split
    backward (zb-h1) the deferred weight step. `plan` traces the chunk once, before the tick loop,
    to learn the residuals' layout; F and B are traced in different branches and meet through it.
    The chunk's output is (y, its summed weighted auxiliary losses); its statistics ride along."""

    def __init__(self, cfg, ops, policy, split: bool, chunk_layers: int, microbatches: int = 1):
        self.cfg, self.policy, self.split, self.chunk_layers = cfg, policy, split, chunk_layers
        self.sites: dict = {}
        self.base_matmul = ops.matmul
        self.ops = deferred.deferred_ops(ops, self.sites) if split else ops
        self.aux_cotangent = 1.0 / microbatches          # each microbatch's aux losses enter the mean

    def run(self, weights, x, taps=None, seeds=None, first_layer=0):
        """(y, aux per layer) of the chunk; `seeds`, `first_layer`: the noisy router's keys."""
        blocks = weights if taps is None else {**weights, "taps": taps}
        return run_blocks(blocks, x, self.cfg, self.ops, self.policy, seeds, first_layer)

    def _objective(self, weights, x, taps=None, **keys):
        y, aux = self.run(weights, x, taps, **keys)
        losses, _ = split_aux(aux)
        return (y, sum(losses.values(), jnp.zeros((), jnp.float32))), aux

    def _vjp(self, weights, x, **keys):
        if self.split:
            taps = deferred.zero_taps(self.sites, self.chunk_layers)
            return jax.vjp(lambda w, t, x: self._objective(w, x, t, **keys), weights, taps, x, has_aux=True)
        return jax.vjp(lambda w, x: self._objective(w, x, **keys), weights, x, has_aux=True)

    def plan(self, weights, x, **keys) -> None:
        if self.split:
            self.run(weights, x, deferred.recording_taps(deferred.deferred_names(weights)), **keys)
        _, pullback, _ = self._vjp(weights, x, **keys)
        leaves, self.treedef = jax.tree.flatten(pullback)
        params = jax.tree.leaves(weights)
        self.sources = [next((i for i, w in enumerate(params) if w is leaf), None) for leaf in leaves]
        self.kept = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf, src in zip(leaves, self.sources)
                     if src is None]

    def forward(self, weights, x, **keys):
        """F: (output, the chunk's weighted aux losses summed, aux per layer, residuals to keep)."""
        (y, aux_loss), pullback, aux = self._vjp(weights, x, **keys)
        leaves, params = jax.tree.leaves(pullback), jax.tree.leaves(weights)
        assert len(leaves) == len(self.sources) and all(
            leaf is params[src] for leaf, src in zip(leaves, self.sources) if src is not None), \
            "residual layout changed"
        return y, aux_loss, aux, [leaf for leaf, src in zip(leaves, self.sources) if src is None]

    def backward(self, weights, kept, dy):
        """B: (weight gradients computed now, taps for W or None, input gradient)."""
        stored, params = iter(kept), jax.tree.leaves(weights)
        pullback = jax.tree.unflatten(self.treedef, [next(stored) if src is None else params[src]
                                                     for src in self.sources])
        cotangent = (dy, jnp.asarray(self.aux_cotangent, jnp.float32))
        if not self.split:
            dw, dx = pullback(cotangent)
            return dw, None, dx
        dw, taps, dx = pullback(cotangent)
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


def send(program: Program, route: str, x, t):
    """One route's send on tick t (inside the shard_map): a `ppermute` over the table's set of pairs for that tick
    (`Program.sends`), chosen by a switch whose index is the same on every device, zeros where nothing arrives;
    each set under its own scope, `pipeline_send_<route>_<k>`, for the executed-bytes count."""
    patterns = program.sends[route]
    if len(patterns) == 1:
        return jnp.zeros_like(x)

    def permute(k):
        return scoped(f"send_{route}_{k}")(lambda x: jax.lax.ppermute(x, AXIS, list(patterns[k])))
    index = jnp.asarray(program.table[f"send_{route}"][:, 0])
    return jax.lax.switch(index[t], [jnp.zeros_like] + [permute(k) for k in range(1, len(patterns))], x)


def run_program(program: Program, stage: StageFunctions, chunks, outer, tokens, *, cfg, ops, train: bool):
    """Run the tick loop on this device: chunks [v, Lc, ...] (compute dtype), outer = everything but the
    pipelined stack (embed, final_norm, lm_head; an MoE model's dense `blocks`), tokens [rows, S+1] this
    shard's. Returns (sum of microbatch cross-entropies / m, grads or None, per-chunk aux [v, Lc, ...] / m).

    The big buffers (stash, gradient accumulators, received activations) never pass through the tick's
    `lax.switch`: each tick slices out the one slot its cell uses, the branch returns that slot's new
    value, and the slot is written back after. (Threaded through the switch, XLA copies every buffer
    on every tick.)"""
    loop = _TickLoop(program, stage, chunks, outer, tokens, cfg, ops, train)
    carry, _ = jax.lax.scan(loop.tick, loop.initial_carry(), jnp.arange(program.ticks))
    if not train:
        return carry["loss"], None, None
    return carry["loss"], {"chunks": carry["chunk_grads"], "outer": carry["outer_grads"]}, carry["aux"]


class _TickLoop:
    """One device's run of a program, built inside the shard_map: the cells a tick can run (idle, F, B, W), the
    buffers they read and write, and the sends between ticks. `run_program` scans `tick` over the ticks."""

    def __init__(self, program: Program, stage: StageFunctions, chunks, outer, tokens, cfg, ops, train: bool):
        sched = program.schedule
        self.program, self.stage, self.chunks, self.outer = program, stage, chunks, outer
        self.cfg, self.ops, self.train, self.dtype = cfg, ops, train, ops.dtype
        self.p, self.v, self.m, self.split = sched.stages, sched.virtual, sched.microbatches, sched.split_backward
        self.me = jax.lax.axis_index(AXIS)
        micro = microbatch_rows(tokens, self.m)                  # microbatch i: rows i, i+m, ... of this shard
        self.inputs, self.targets = micro[:, :, :-1], micro[:, :, 1:]
        self.head_names = ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")
        self.first_names = ("embed", "blocks") if "blocks" in outer else ("embed",)
        self.noisy = train and cfg.moe is not None and cfg.moe.router == "noisy"
        self.act_shape = jax.eval_shape(lambda: self.first_part(outer, 0))
        self.zeros_act = jnp.zeros(self.act_shape.shape, self.act_shape.dtype)
        first_chunk = jax.tree.map(lambda w: w[0], chunks)
        self.aux_shape = jax.eval_shape(lambda: stage.run(first_chunk, self.zeros_act)[1])
        if train:
            stage.plan(first_chunk, self.zeros_act, **self.keys({"microbatch": 0, "chunk": 0}))
        # the switch runs one of these per tick; the table's F/B variants pick their first/last parts inside
        self.kinds = jnp.asarray(np.array([0, 1, 1, 1, 2, 2, 3], np.int32))   # cell -> idle, forward, backward, W
        self.branches = [self.idle, self.forward, self.backward, self.weight][
            :(4 if self.split else 3) if train else 2]
        slots = program.slots
        self.used = [f for f in ARRIVALS if (program.table[f] != slots[f.split("_")[1]]).any()]   # routes in use
        self.flips = bool(program.table["flip"].any())
        self.table = {k: jnp.asarray(t) for k, t in program.table.items() if not k.startswith("send_")}

    def first_part(self, weights, microbatch):
        """The first model stage's own layers: the embedding (and an MoE model's dense stack)."""
        x = embed(weights, self.inputs[microbatch], self.ops)
        return run_blocks(weights["blocks"], x, self.cfg, self.ops)[0] if "blocks" in weights else x

    def keys(self, row):
        """The noisy router's noise keys of this cell: the microbatch's seeds, the chunk's first layer."""
        seeds = noise_seeds(self.inputs[row["microbatch"]]) if self.noisy else None
        stage = row["chunk"] * self.p + self.me
        if self.program.schedule.shape == "v":      # the V: chunk 1 of device s is model stage 2p-1-s
            stage = jnp.where(row["chunk"] == 1, 2 * self.p - 1 - self.me, stage)
        return {"seeds": seeds, "first_layer": stage * self.stage.chunk_layers}

    def zeros_outer(self):
        return jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), self.outer)

    def zeros_aux(self):
        return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), self.aux_shape)

    def chunk(self, row):
        return jax.tree.map(lambda w: w[row["chunk"]], self.chunks)

    # ---- the branches: (this tick's slots, row) -> the slots' new values and what leaves the device
    def idle(self, io, row):
        out = {**io, "send_act": self.zeros_act, "send_grad": self.zeros_act, "d_outer": self.zeros_outer(),
               "loss": jnp.zeros((), jnp.float32)}
        return {**out, "aux": self.zeros_aux()} if self.train else out

    @scoped("head")
    def head(self, y, row):
        """The last model stage: the loss, and at once its gradient (the loss ends the graph)."""
        head = {k: self.outer[k] for k in self.head_names}
        objective = lambda head, y: head_loss(head, y, self.targets[row["microbatch"]], self.cfg, self.ops) / self.m
        if not self.train:
            return objective(head, y), self.zeros_outer(), self.zeros_act
        loss, (d_head, dy) = jax.value_and_grad(objective, argnums=(0, 1))(head, y)
        return loss, {**self.zeros_outer(), **d_head}, dy.astype(self.dtype)

    @scoped("F")
    def forward(self, io, row):
        out, train = self.idle(io, row), self.train
        x = jax.lax.cond(row["branch"] == F_FIRST,
                         scoped("embed")(lambda: self.first_part(self.outer, row["microbatch"])), lambda: io["x"])
        weights = self.chunk(row)
        if train:
            y, _, aux, out["kept"] = self.stage.forward(weights, x, **self.keys(row))
            out["aux"] = jax.tree.map(lambda a: a.astype(jnp.float32) / self.m, aux)
        else:
            y = self.stage.run(weights, x)[0]
        no_head = lambda y, row: (jnp.zeros((), jnp.float32), self.zeros_outer(),
                                  io["dy"] if train else self.zeros_act)
        loss, d_outer, dy = jax.lax.cond(row["branch"] == F_LAST, self.head, no_head, y, row)
        out.update(loss=loss, d_outer=d_outer, send_act=y.astype(self.dtype))
        if train:
            out["dy"] = dy
        return out

    @scoped("embed_grad")
    def embed_grad(self, dx, row):
        """The first model stage: the input gradient becomes the embedding's (and the dense stack's)."""
        own = {k: self.outer[k] for k in self.first_names}
        (d_first,) = jax.vjp(lambda w: self.first_part(w, row["microbatch"]), own)[1](dx)
        return {**self.zeros_outer(), **d_first}

    @scoped("B")
    def backward(self, io, row):
        out = self.idle(io, row)
        dw, taps, dx = self.stage.backward(self.chunk(row), io["kept"], io["dy"])
        out["acc"] = {k: a + dw[k].astype(a.dtype) if k in dw else a for k, a in io["acc"].items()}
        if taps is not None:
            out["taps"] = taps
        out["d_outer"] = jax.lax.cond(row["branch"] == B_FIRST, self.embed_grad,
                                      lambda dx, row: self.zeros_outer(), dx, row)
        out["send_grad"] = dx.astype(self.dtype)
        return out

    @scoped("W")
    def weight(self, io, row):
        out = self.idle(io, row)
        dw = self.stage.weight(self.chunk(row), io["taps"])
        out["acc"] = {k: a + dw[k].astype(a.dtype) if k in dw else a for k, a in io["acc"].items()}
        return out

    # ---- the buffers and the tick
    def initial_carry(self) -> dict:
        """The scan's carry: received activations (and, training, gradients, stash, accumulators, aux)."""
        slots, stage, shape, dtype = self.program.slots, self.stage, self.act_shape.shape, self.dtype
        carry: dict[str, Any] = {"acts": jnp.zeros((slots["act"] + 1, *shape), dtype),
                                 "loss": jnp.zeros((), jnp.float32)}
        if self.train:
            carry["grads_in"] = jnp.zeros((slots["grad"] + 1, *shape), dtype)
            carry["stash"] = [jnp.zeros((max(slots["stash"], 1), *a.shape), a.dtype) for a in stage.kept]
            carry["chunk_grads"] = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), self.chunks)
            carry["outer_grads"] = self.zeros_outer()
            carry["aux"] = jax.tree.map(lambda a: jnp.zeros((self.v, *a.shape), jnp.float32), self.aux_shape)
            if self.split:
                carry["wstash"] = {k: tuple(jnp.zeros((slots["wstash"], stage.chunk_layers, *s.shape), s.dtype)
                                            for s in (site.x, site.y)) for k, site in stage.sites.items()}
        return carry

    def deliver(self, carry, row, out, t):
        """The tick's sends: down the stages and up, each a `ppermute` over just the pairs the table sends on this
        tick (none on a tick where nobody sends that way), and the V's hand-over to itself."""
        down, up = out["send_act"], out["send_grad"]
        if self.flips:
            down, up = jnp.where(row["flip"], up, down), jnp.where(row["flip"], down, up)
        outgoing = {"down": down, "up": up}
        arrived = {route: functools.partial(send, self.program, route, outgoing[route], t) for route in ("down", "up")}
        arrived["local"] = lambda: down
        received = {route: arrived[route]() for route in ROUTES if any(f.startswith(route) for f in self.used)}
        for field in self.used:
            route, buffer = field.split("_")[:2]
            name = "acts" if buffer == "act" else "grads_in"
            carry[name] = carry[name].at[row[field]].set(received[route])
        return carry

    def tick(self, carry, t):
        row = {k: column[t, self.me] for k, column in self.table.items()}
        io = {"x": carry["acts"][row["act"]]}
        if self.train:
            io.update(dy=carry["grads_in"][row["grad"]], kept=_get(carry["stash"], row["stash"]),
                      acc=_get(carry["chunk_grads"], row["chunk"]))
            if self.split:
                io["taps"] = _get(carry["wstash"], row["wstash"])
        out = jax.lax.switch(self.kinds[row["branch"]], self.branches, io, row)
        carry = {**carry, "loss": carry["loss"] + out["loss"]}
        if self.train:
            carry["grads_in"] = carry["grads_in"].at[row["grad"]].set(out["dy"])
            carry["stash"] = _put(carry["stash"], row["stash"], out["kept"])
            carry["chunk_grads"] = _put(carry["chunk_grads"], row["chunk"], out["acc"])
            carry["outer_grads"] = jax.tree.map(jnp.add, carry["outer_grads"], out["d_outer"])
            carry["aux"] = jax.tree.map(lambda a, new: a.at[row["chunk"]].add(new), carry["aux"], out["aux"])
            if self.split:
                carry["wstash"] = _put(carry["wstash"], row["wstash"], out["taps"])
        return self.deliver(carry, row, out, t), None

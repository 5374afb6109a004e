"""The automatic strategies: say where arrays live, and XLA's SPMD partitioner writes the collectives.

Data parallel, FSDP, Megatron tensor parallelism and their products are one strategy:
the logical-axis rules (`parallel/rules.py`) turn the mesh sizes into shardings of the
params, the Adam state and the batch, and the step is the plain single-device step,
jitted with those shardings. `predict` (end of file) is what XLA's partitioner sends for it,
per mesh axis, as the compiled programs of lab 00 and 02 show.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.model.ops import gather_embedding
from jaxpar.model.transformer import cross_entropy_and_aux, loss
from jaxpar.parallel.step import accumulate, apply_outside_gradient
from jaxpar.parallel.strategy import Strategy
from jaxpar.parallel.theory import (
    OTHER_WEIGHTS,
    WEIGHTS_PER_LAYER,
    Candidate,
    Flow,
    Prediction,
    moe_all_to_all_bytes,
    rows_per_microbatch,
    stored_params,
    wire_bytes,
)


def auto_step(state, tokens, *, model_cfg, ops, optimizer, policy, microbatches):
    """One optimizer step of the single-device program; with microbatches > 1 gradients accumulate in a scan."""
    value_and_grad = jax.value_and_grad(partial(loss, cfg=model_cfg, ops=ops, remat_policy=policy), has_aux=True)
    split = lambda t, m: ops.constrain(t.reshape(t.shape[0] // m, m, -1).swapaxes(0, 1), (None, "batch", None))
    (_, metrics), grads = accumulate(value_and_grad, state["params"], tokens, microbatches, split=split)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    params = apply_outside_gradient(state["params"], params, metrics, model_cfg)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def cross_entropy_of(params, tokens, *, model_cfg, ops):
    """The evaluation loss: mean next-token cross-entropy (auxiliary losses left out)."""
    return cross_entropy_and_aux(params, tokens, model_cfg, ops)[0]


def rules_embedding(rules):
    """The embedding lookup as a gather, with one hint for the partitioner: a table split by embed (over
    `fsdp`) and also by vocab (over `tensor`), or whose tokens are split over more than its embed axes
    (data x fsdp, expert x fsdp), is gathered over its embed split first. XLA lowers a lookup from a
    vocab-split table as Megatron's masked lookup + all-reduce, and from an embed-split one whose tokens
    are split the same way by moving activations (all-to-all); in the other cases it replicates the
    activations' gradient in the backward pass (measured: "involuntary full rematerialization")."""
    def embed(tokens, table):
        mesh = jax.sharding.get_abstract_mesh()
        live = () if mesh.empty else tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
        if embed_lookup_gathers(rules, live):
            table = rules.constrain(table, ("vocab", None))
        return gather_embedding(tokens, table)
    return embed


def embed_lookup_gathers(rules, live_axes) -> bool:
    """Whether `rules_embedding` gathers the table over its embed split (see there); live_axes: mesh axes > 1."""
    def axes(name):
        entry = rules.spec((name,), live_axes)[0]
        return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)
    embed = axes("embed")
    return bool(embed) and bool(axes("vocab") or axes("batch") - embed)


COPIES = ("batch", "inner_length", "heads", "act_embed")   # the copies' logical names: t split like the heads


@dataclasses.dataclass(frozen=True)
class Copies:
    """A column-parallel input held once per shard of the weights' output axis: `copies` [b, s, t, d], its t axis
    split like the weights' heads / hidden units; `whole` the [b, s, d] it repeats (for the output head)."""
    whole: Any
    copies: Any


def column_copies(rules, ops):
    """`ops` whose column-parallel matmuls take one copy of their input per tensor shard (see `Copies`).

    In the partitioner's global view a matmul whose contraction is split must hand on a reduced result: the
    input gradients of q, k, v (of gate, up) are each all-reduced and then summed, 3 + 2 all-reduces per layer
    where Megatron's f sums first and reduces once (XLA's all-reduce reassociation pass would merge them;
    XLA:CPU does not run it).
    With the input broadcast to [b, s, t, d] (t split like the weights' outputs: no data moves) and each
    weight viewed as [d, t, n/t, ...], every device multiplies its own copy; the copies' gradients add up
    where they are split and the broadcast's transpose, a sum over t, is the one all-reduce (measured:
    4 per layer, as Megatron)."""
    def column_in(x):
        t = _copies(rules)
        if not t:
            return x
        copies = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], t, x.shape[-1]))
        return Copies(x, rules.constrain(copies, COPIES))

    def matmul(spec, x, w):
        t = x.copies.shape[2] if isinstance(x, Copies) else 0
        if not t or w.shape[1] % t:
            return ops.matmul(spec, x.whole if isinstance(x, Copies) else x, w)
        (lhs, rhs), out = spec.split("->")[0].split(","), spec.split("->")[1]
        c = next(letter for letter in "tcnmpqruvwxyz" if letter not in spec)
        y = ops.matmul(f"{lhs[:-1]}{c}{lhs[-1]},{rhs[0]}{c}{rhs[1:]}->{out[:2]}{c}{out[2:]}", x.copies,
                       w.reshape(w.shape[0], t, w.shape[1] // t, *w.shape[2:]))
        return y.reshape(*y.shape[:2], t * y.shape[3], *y.shape[4:])

    def cross_entropy(x, head, targets, inner_ops):
        return ops.cross_entropy(x.whole if isinstance(x, Copies) else x, head, targets, inner_ops)

    return ops.replace(column_in=column_in, matmul=matmul, cross_entropy=cross_entropy)


def _copies(rules) -> int:
    """How many copies: the size of the live mesh axes that heads, kv_heads and mlp are all split over (0 when
    they differ, none is live, or those axes also split the batch, sequence or d_model: then no copies)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 0
    live = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)
    specs = {rules.spec((name,), live)[0] for name in ("heads", "kv_heads", "mlp")}
    try:
        rules.spec(COPIES, live)
    except ValueError:
        return 0
    if len(specs) != 1 or None in specs:
        return 0
    entry = specs.pop()
    size = 1
    for axis in (entry,) if isinstance(entry, str) else entry:
        size *= mesh.shape[axis]
    return size


class AutoStrategy(Strategy):
    """Every `parallel.<axis>` is `auto`: shardings from the rules, collectives from the compiler."""

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        ops = self.ops.replace(embed=rules_embedding(self.rules))
        self.ops = self.with_ops(ops if model_cfg.moe else column_copies(self.rules, ops))
        self.batch_sharding = NamedSharding(mesh, self.rules.spec(ACTIVATION_AXES["tokens"], mesh.axis_names))
        self.param_shardings = self.rules.tree_shardings(model_cfg.param_axes(), mesh)
        abstract = jax.eval_shape(self.make_state)
        self.state_shardings = self._state_layout(abstract, self.param_shardings, replicated=NamedSharding(mesh, P()))
        self.abstract_state = self._with_shardings(abstract, self.state_shardings)
        step = partial(auto_step, model_cfg=model_cfg, ops=self.ops, optimizer=self.optimizer, policy=self.policy,
                       microbatches=self.microbatches)
        replicated = NamedSharding(mesh, P())
        self.step_fn = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated), donate_argnums=self.donate_argnums)
        self.eval_fn = jax.jit(partial(cross_entropy_of, model_cfg=model_cfg, ops=self.ops),
                               in_shardings=(self.param_shardings, self.batch_sharding), out_shardings=replicated)

    def with_ops(self, ops):
        """The ops the step and evaluation run with: a subclass swaps pieces here (parallel/expert.py)."""
        return ops

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return predict(shape, cand, global_batch, seq_len, platform)


# ============================================================================ prediction

def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """Bytes each device sends per step, per mesh axis and collective kind (Ψ = parameters, Ψ_L = the scanned
    blocks' share, Ψ_o = embedding, head, final norm; e = `wire_bytes`; m microbatches of b rows).

    fsdp (F)   all-gathers (F-1)/F·e·(2·m·Ψ_L + Ψ_o')/T: each scanned layer once in the forward and once in the
               backward loop of every microbatch, the head and final norm once per step (hoisted). An untied
               embedding alone over fsdp is looked up, not gathered: tokens (F-1)/F·4·b·F·s and activations
               (F-1)/F·e·b·s·h/T both ways per microbatch (see `embed_lookup_gathers`). Gradients reduced per
               microbatch: reduce-scatter (F-1)/F·e on GPU, all-reduce + slice 2(F-1)/F·4 on CPU.
    data (D)   gradient all-reduce 2(D-1)/D·e·Ψ/(F·T) per microbatch (fp8 reduces in fp32 on GPU).
    tensor (T) Megatron all-reduces of b·s·h, 2(T-1)/T·e each: 4 per layer (`tensor_all_reduces`: 7 on
               XLA:CPU for MoE models, which take no `Copies`), +1 with remat full, +2 per microbatch.
    expert (X) the MoE exchanges (`moe_all_to_all_bytes`); with fsdp = 1 the gradients of what every expert
               device holds all-reduce over data x expert, the routed experts' Ψ_x/X over data.
    """
    counts = shape.counts()
    D, F, T, X, m = cand.data, cand.fsdp, cand.tensor, cand.expert, cand.microbatches
    e, cpu = wire_bytes(cand.precision, platform), platform == "cpu"
    b = rows_per_microbatch(cand, global_batch)
    s, h, L = seq_len, shape.d_model, shape.layers
    psi_x = counts["experts"]
    psi_layers = counts["blocks"] - psi_x * (X - 1) // X     # this device's share of the layers (experts split)
    psi_other = counts["total"] - counts["blocks"]
    psi = psi_layers + psi_other
    out: list[Flow] = []
    if F > 1:
        out += _fsdp_flows(cand, counts, e, b, s, h, L, psi_layers, psi_other, cpu)
    if X > 1:
        out += _expert_flows(shape, cand, global_batch, seq_len, platform, psi, psi_x)
    elif D > 1:
        grad_e = 4 if cand.precision == "float8" and not cpu else e
        out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * grad_e * psi / (F * T) * m,
                        m * (WEIGHTS_PER_LAYER + OTHER_WEIGHTS), False))
    if T > 1:
        count = (tensor_all_reduces(shape, cand.remat, cpu) * L + 2) * m
        out.append(Flow("tensor", "all-reduce", count * 2 * (T - 1) / T * e * b * s * h, count, False))
    return Prediction(out, stored_params(shape, cand))


def tensor_all_reduces(shape, remat: str, cpu: bool) -> int:
    """All-reduces of b·s·h over `tensor` per layer: g after wo and w_down forward, f's two before q/k/v and
    gate/up backward (one each: the weights take `Copies`), +1 with remat full (the attention g recomputed).
    An MoE model takes no `Copies`: XLA:CPU then reduces the input gradients of q, k, v and of gate, up one by
    one (7); on GPU the prediction assumes XLA's all-reduce reassociation merges them (not measured)."""
    backward = 5 if cpu and shape.moe else 2
    return 2 + backward + (1 if remat == "full" else 0)


def _fsdp_flows(cand, counts, e, b, s, h, L, psi_layers, psi_other, cpu) -> list[Flow]:
    D, F, T, X, m = cand.data, cand.fsdp, cand.tensor, cand.expert, cand.microbatches
    ring = (F - 1) / F
    looked_up = counts["embedding"] if not (counts["lm_head"] == 0 or T > 1 or D > 1 or X > 1) else 0
    out = [Flow("fsdp", "all-gather", ring * e * 2 * m * psi_layers / T, 2 * m * L * WEIGHTS_PER_LAYER, not cpu),
           Flow("fsdp", "all-gather", ring * e * (psi_other - looked_up) / T, OTHER_WEIGHTS - (1 if looked_up else 0),
                False)]
    if looked_up:   # the partitioner moves tokens and activations instead of gathering the table
        out.append(Flow("fsdp", "all-to-all", ring * m * (4 * b * F * s + 2 * e * b * s * h / T), 3 * m, False))
    reduce_op, reduce_e = ("all-reduce", 2 * 4) if cpu else ("reduce-scatter", e)
    out.append(Flow("fsdp", reduce_op, ring * psi_layers / T * reduce_e * m, m * L * WEIGHTS_PER_LAYER, not cpu))
    out.append(Flow("fsdp", reduce_op, ring * (psi_other - looked_up) / T * reduce_e * m, m * OTHER_WEIGHTS, False))
    return out


def _expert_flows(shape, cand, global_batch, seq_len, platform, psi, psi_x) -> list[Flow]:
    D, F, T, X, m = cand.data, cand.fsdp, cand.tensor, cand.expert, cand.microbatches
    e = wire_bytes(cand.precision, platform)
    exchange = moe_all_to_all_bytes(shape, cand, global_batch, seq_len, platform)
    out = [Flow("expert", "all-to-all", exchange["predicted"], exchange["runs"], False)]
    if F == 1:
        label = "expert" if D == 1 else "data+expert"
        out.append(Flow(label, "all-reduce", 2 * (D * X - 1) / (D * X) * e * (psi - psi_x / X) / T * m,
                        m * (WEIGHTS_PER_LAYER + OTHER_WEIGHTS), False))
        if D > 1:
            out.append(Flow("data", "all-reduce", 2 * (D - 1) / D * e * psi_x / X / T * m, m * 3, False))
    return out

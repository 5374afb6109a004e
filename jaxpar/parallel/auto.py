"""The automatic strategies: say where arrays live, and XLA's SPMD partitioner writes the collectives.

Data parallel, FSDP, Megatron tensor parallelism and their products are one trainer:
the logical-axis rules (`parallel/rules.py`) turn the mesh sizes into shardings of the
params, the Adam state and the batch, and the step is the plain single-device step,
jitted with those shardings.
"""
from __future__ import annotations

from functools import partial

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.model.axes import ACTIVATION_AXES
from jaxpar.model.ops import gather_embedding
from jaxpar.model.transformer import cross_entropy_and_aux, loss
from jaxpar.train.step import accumulate, apply_outside_gradient
from jaxpar.train.strategy import Strategy


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


class AutoTrainer(Strategy):
    """Every `parallel.<axis>` is `auto`: shardings from the rules, collectives from the compiler."""

    def __init__(self, config, model_cfg, mesh, donate: bool | None = None):
        super().__init__(config, model_cfg, mesh, donate)
        self.ops = self.with_ops(self.ops.replace(embed=rules_embedding(self.rules)))
        self.batch_sharding = NamedSharding(mesh, self.rules.spec(ACTIVATION_AXES["tokens"], mesh.axis_names))
        self.param_shardings = self.rules.tree_shardings(model_cfg.param_axes(), mesh)
        abstract = jax.eval_shape(self._init_state)
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

"""The pieces of a training step that every strategy shares: optimizer, schedule, remat, donation,
gradient accumulation. The strategies (jaxpar/parallel/) sit above this module and the
model below it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.model.ops import DTYPES, precision
from jaxpar.model.transformer import outside_gradient


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


def produced_by(primitives: tuple[str, ...]):
    """A predicate on (primitive, params): one of `primitives` (by name prefix), or a custom_vjp call whose
    forward contains one (a remat policy sees the call, not what is inside it)."""
    def test(prim, params) -> bool:
        if prim.name.startswith(primitives):
            return True
        jaxpr = params.get("call_jaxpr")
        return jaxpr is not None and any(test(e.primitive, e.params) for e in jaxpr.eqns)
    return test


def never_saving(recompute, policy=None):
    """The remat policy `policy` (None: save everything) except values `recompute(prim, params)` picks,
    which the backward pass computes again: a gathered weight (ZeRO-3), a gathered sequence (SP)."""
    def saveable(prim, *args, **params):
        if recompute(prim, params):
            return False
        return True if policy is None else policy(prim, *args, **params)
    return saveable


def learning_rate(train_cfg) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
        decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1),
        end_value=train_cfg.lr * train_cfg.min_lr_ratio)


def decay_mask(params):
    """AdamW's weight-decay mask: True for arrays with more than one axis. The final norm (1-D) is not
    decayed; the per-layer norms are stacked on `layers` ([L, D]) and are."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(train_cfg, mask=decay_mask, clip: bool = True) -> optax.GradientTransformation:
    """AdamW with warmup + cosine, global-norm clipping; weight decay where `mask` says. `clip=False`: the
    strategy clips by the norm it computes itself (`clip_to_norm`), its gradient's layout not the canonical one."""
    adamw = optax.adamw(learning_rate(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps,
                        weight_decay=train_cfg.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip) if clip else optax.identity(), adamw)


def clip_to_norm(grads, norm, max_norm: float):
    """optax.clip_by_global_norm's formula with the global `norm` given: a shard_map program computes it
    over every device's part (optax inside it would see only this device's). The optimizer chain's own
    clip then sees a norm <= max_norm and leaves the gradient alone."""
    return jax.tree.map(lambda g: jax.lax.select(norm < max_norm, g, g / norm.astype(g.dtype) * max_norm), grads)


def donate_state(mesh, donate: bool | None) -> tuple[int, ...]:
    """donate_argnums for the step. Donating lets XLA update the state in place: one copy of
    params and Adam state instead of two on an accelerator. XLA:CPU runs the donated step
    ~15% slower (measured: 571 vs 490 ms, default config) and host memory is not the limit,
    so `None` donates except on CPU; dry runs pass True to see accelerator memory."""
    if donate is None:
        donate = mesh.devices.flat[0].platform != "cpu"
    return (0,) if donate else ()


def microbatch_rows(tokens, microbatches: int):
    """[B, T] -> [m, B/m, T]: microbatch i takes rows i, i+m, i+2m, ... so each device keeps its own rows."""
    return tokens.reshape(tokens.shape[0] // microbatches, microbatches, -1).swapaxes(0, 1)


def accumulate(value_and_grad, params, tokens, microbatches: int, *, split=microbatch_rows, vary=lambda x: x):
    """((loss, metrics), grads) of `value_and_grad(params, tokens)`, averaged over microbatches.

    With microbatches > 1 the batch is cut by `split` and the sum runs in a scan, so one
    microbatch's activations are alive at a time (gradient accumulation). `vary` is applied
    to the zero loss and metrics the sum starts from (shard_map programs mark them as
    varying across devices, like what is added to them).
    """
    if microbatches == 1:
        return value_and_grad(params, tokens)
    micro = split(tokens, microbatches)
    (_, metrics_shape), _ = jax.eval_shape(value_and_grad, params, micro[0])

    def add(carry, mb):
        return jax.tree.map(jnp.add, carry, value_and_grad(params, mb)), None

    zeros = jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype)), (metrics_shape["loss"], metrics_shape))
    start = (zeros, jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(add, start, micro)
    return jax.tree.map(lambda x: x / microbatches, total)


def apply_outside_gradient(before, after, metrics, model_cfg, stored_part=None):
    """Every strategy calls this after its optimizer update, with the step's (device-averaged) metrics.

    Parameters the model updates from observed statistics rather than the gradient (the MoE
    router's aux-free bias, `transformer.outside_gradient`) become `before + delta`: whatever the
    optimizer did to them (weight decay) is dropped. `stored_part(stack, name, delta)`: the part of
    a full-shape delta this device stores, for strategies that slice parameters (ZeRO-3).
    """
    deltas = outside_gradient(metrics, model_cfg)
    if not deltas:
        return after
    out = dict(after)
    for stack, changes in deltas.items():
        out[stack] = dict(after[stack])
        for name, delta in changes.items():
            part = stored_part(stack, name, delta) if stored_part else delta
            out[stack][name] = before[stack][name] + part.astype(before[stack][name].dtype)
    return out

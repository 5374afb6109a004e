"""Pallas calls inside `shard_map(check_vma=True)` (the manual ZeRO strategies): say how outputs vary.

Under check_vma JAX tracks over which manual mesh axes each value varies. A `pallas_call`
cannot infer that for its outputs, so each output's ShapeDtypeStruct must carry it, and all
inputs must vary over the same axes (an invariant weight is cast to varying first, which
moves no data). Outside shard_map both are no-ops. This types the traced call; JAX's CPU
interpreter then re-runs the kernel body with varying blocks, which the check refuses, so the
manual strategies turn the check off around interpreted kernels (kernel_ops.interpreted_pallas).
"""
from __future__ import annotations

import jax


def _varying(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)         # jax 0.10: ManualAxisType(varying=...)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))    # earlier releases spelled it `vma`


def match(*xs):
    """The inputs cast to vary over the union of their manual axes; returns (inputs, that union)."""
    axes = frozenset().union(*(_varying(x) for x in xs))
    out = tuple(x if _varying(x) == axes else jax.lax.pcast(x, tuple(sorted(axes - _varying(x))), to="varying")
                for x in xs)
    return out, axes


def struct(shape, dtype, axes: frozenset) -> jax.ShapeDtypeStruct:
    """An output's ShapeDtypeStruct varying over `axes` (what every input varies over)."""
    manual_axis_type = getattr(jax.sharding, "ManualAxisType", None)
    if manual_axis_type is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual_axis_type(varying=axes))
    try:
        return jax.ShapeDtypeStruct(shape, dtype, vma=axes)  # type: ignore[call-arg]  # the older jax spelling
    except TypeError:
        return jax.ShapeDtypeStruct(shape, dtype)

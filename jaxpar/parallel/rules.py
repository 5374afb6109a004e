"""Logical axis names -> mesh axes: the automatic (compiler-driven) strategies.

Every parameter and main activation is annotated with logical names (`embed`,
`heads`, `mlp`, ...). These rules map each name to mesh axes. Because an axis of
size 1 shards nothing, the mesh sizes alone select the strategy:

- data=N              pure data parallel: params replicated, batch split, XLA all-reduces grads
- fsdp=N              FSDP / ZeRO-3: params, grads and Adam state split on `embed`; batch split;
                      XLA all-gathers weights before use and reduce-scatters grads
- tensor=N            Megatron tensor parallel: heads and the MLP hidden dim split, so
                      q/k/v and gate/up are column-parallel, wo and down row-parallel
- any product of them 2D/3D combinations (e.g. data x fsdp x tensor)
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

RULES: dict[str, tuple[str, ...] | None] = {
    # parameters
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": None,
    "norm": None,
    "layers": None,
    # activations
    "batch": ("data", "fsdp"),
    "length": None,
    "act_embed": None,
}


def logical_to_spec(names: tuple[str | None, ...], mesh_axes=None) -> P:
    """PartitionSpec for one array from its logical axis names.

    Mesh axes not in `mesh_axes` (when given) are dropped, so the same names work
    on a mesh that lacks some axes.
    """
    spec = []
    used = set()
    for name in names:
        axes = RULES.get(name) if name is not None else None
        if name is not None and name not in RULES:
            raise KeyError(f"logical axis '{name}' has no rule in jaxpar.parallel.rules.RULES")
        if axes is not None and mesh_axes is not None:
            axes = tuple(a for a in axes if a in mesh_axes)
        if axes:
            if used & set(axes):
                raise ValueError(f"mesh axes {axes} used twice in logical names {names}")
            used |= set(axes)
            spec.append(axes[0] if len(axes) == 1 else axes)
        else:
            spec.append(None)
    return P(*spec)


def tree_specs(logical_tree, mesh_axes=None):
    """Map a pytree whose leaves are tuples of logical names to PartitionSpecs."""
    return jax.tree.map(lambda names: logical_to_spec(names, mesh_axes), logical_tree,
                        is_leaf=lambda x: isinstance(x, tuple))


def tree_shardings(logical_tree, mesh):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree_specs(logical_tree, mesh.axis_names),
                        is_leaf=lambda x: isinstance(x, P))


def constrain(x, names: tuple[str | None, ...]):
    """Pin an activation's sharding from its logical names, over the mesh's Auto axes.

    A no-op outside a mesh, and inside `shard_map` for the axes it made Manual (the
    manual strategies place data themselves).
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)
    if mesh.empty or not auto:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, auto)))

"""Logical axis names -> mesh axes: the automatic (compiler-driven) strategies.

Every parameter and main activation is annotated with logical names (`embed`,
`heads`, `mlp`, ...). The rules map each name to mesh axes. Because an axis of
size 1 shards nothing, the mesh sizes alone select the strategy:

- data=N              pure data parallel: params replicated, batch split, XLA all-reduces grads
- fsdp=N              FSDP / ZeRO-3: params, grads and Adam state split on `embed`; batch split;
                      XLA all-gathers weights before use and reduce-scatters grads
- tensor=N            Megatron tensor parallel: heads and the MLP hidden dim split, so
                      q/k/v and gate/up are column-parallel, wo and down row-parallel
- expert=N            expert parallelism (MoE models): each device holds E/N experts; the batch is
                      split over `expert` too (as DeepSpeed-MoE and MaxText do), so the tokens of one
                      device travel to the experts' devices and back: XLA chooses how (all_to_all when
                      it can). `parallel.expert=manual` writes those all_to_alls by hand (parallel/expert.py)
- context=N           context parallelism: the sequence split (`length`, `inner_length`); attention crosses
                      the split by hand (parallel/context.py: a ring of key/value blocks, or all_to_all)
- any product of them 2D/3D combinations (e.g. data x fsdp x tensor, expert x data)

`parallel.rules` in the config overrides single names, e.g. `length=tensor`
(sequence parallelism of the residual stream) or `embed=fsdp+data`; the
overrides reach the parameter shardings and every activation constraint alike.
"""
from __future__ import annotations

from collections.abc import Iterable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, mesh_axes

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # parameters
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": (),
    "norm": (),
    "layers": (),
    "experts": ("expert",),
    # activations
    "batch": ("expert", "data", "fsdp"),   # split over `expert` too; parallel/expert.py's shard_map reads this spec
    "expert_batch": ("data", "fsdp"),      # the batch of tokens already sent to their experts (capacity dispatch)
    "length": ("context",),        # the residual stream's sequence axis (norms, residual adds)
    "inner_length": ("context",),  # the sequence axis inside attention, the MLP and the head
    "act_embed": (),
}


def parse_rules(text: str) -> dict[str, tuple[str, ...]]:
    """'length=tensor,embed=fsdp+data,vocab=' -> overrides; an empty right side replicates."""
    overrides = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, sep, axes = item.partition("=")
        name = name.strip()
        if not sep or name not in DEFAULT_RULES:
            raise ConfigError("parallel.rules", f"'{item}' is not NAME=AXIS[+AXIS...] with NAME one of "
                              f"{', '.join(DEFAULT_RULES)}")
        chosen = tuple(a.strip() for a in axes.split("+") if a.strip())
        unknown = [a for a in chosen if a not in mesh_axes()]
        if unknown:
            raise ConfigError("parallel.rules", f"'{item}': {unknown[0]} is not a mesh axis; valid: "
                              f"{', '.join(mesh_axes())}")
        overrides[name] = chosen
    return overrides


class AxisRules:
    """A rule table (defaults + overrides) and what it does to specs, shardings and activations."""

    def __init__(self, overrides: dict[str, tuple[str, ...]] | None = None):
        self.table = {**DEFAULT_RULES, **(overrides or {})}

    @classmethod
    def from_config(cls, config) -> AxisRules:
        return cls(parse_rules(config.parallel.rules))

    def spec(self, names: tuple[str | None, ...], mesh_axes: Iterable[str] | None = None) -> P:
        """PartitionSpec of one array from its logical names; mesh axes not in `mesh_axes` are dropped."""
        spec, used = [], set[str]()
        for name in names:
            if name is not None and name not in self.table:
                raise KeyError(f"logical axis '{name}' has no rule in jaxpar.parallel.rules.DEFAULT_RULES")
            axes = self.table[name] if name is not None else ()
            if mesh_axes is not None:
                axes = tuple(a for a in axes if a in mesh_axes)
            if used & set(axes):
                raise ValueError(f"mesh axes {axes} used twice in logical names {names}")
            used |= set(axes)
            spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*spec)

    def tree_specs(self, logical_tree, mesh_axes=None):
        """A pytree whose leaves are tuples of logical names -> PartitionSpecs."""
        return jax.tree.map(lambda names: self.spec(names, mesh_axes), logical_tree,
                            is_leaf=lambda x: isinstance(x, tuple))

    def tree_shardings(self, logical_tree, mesh):
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.tree_specs(logical_tree, mesh.axis_names),
                            is_leaf=lambda x: isinstance(x, P))

    def check(self, named_arrays: dict[str, tuple[str | None, ...]], sizes: dict[str, int]) -> None:
        """Refuse (ConfigError) a table that puts one mesh axis (of `sizes` > 1) twice on the same array."""
        live = [a for a, size in sizes.items() if size > 1]
        for what, names in named_arrays.items():
            try:
                self.spec(names, live)
            except ValueError:
                raise ConfigError("parallel.rules", f"{what} {names} would use one mesh axis twice with "
                                  f"these rules; map those logical names to different axes") from None

    def constrain(self, x, names: tuple[str | None, ...]):
        """Pin an activation's sharding from its logical names, over the mesh's Auto axes.

        A no-op outside a mesh, and inside `shard_map` for the axes it made Manual (the
        manual strategies place data themselves).
        """
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return x
        auto = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)
        if not auto:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, self.spec(names, auto)))


DEFAULT = AxisRules()

"""The strategy registry's lines: which strategies jaxpar has, and the mesh axes they add.

Plain data, no JAX, at the bottom of the package: the config reads the mesh axes from here
(`mesh.<axis>`, `parallel.<axis>`) before anything is imported, and jaxpar/parallel/registry.py
loads the strategies and matches configs to them. A line is "module:Class" (or the class itself);
a strategy that runs a mesh axis of its own is written `NewAxis("<axis>", "module:Class")`: the
axis then exists everywhere (config fields at size 1 and `auto`, the mesh, the candidate, the
planner's space, `jaxpar plan --strategy`) with no other edit.
"""
from __future__ import annotations

from typing import NamedTuple

BUILT_IN_AXES = ("data", "fsdp", "pipe", "expert", "context", "tensor")   # mesh order: tensor innermost


class NewAxis(NamedTuple):
    """A registry line whose strategy adds the mesh axis `axis` (outside the built-in ones in mesh order)."""

    axis: str
    strategy: str | type   # "module:Class", or the class itself


STRATEGIES: tuple[str | type | NewAxis, ...] = (
    "jaxpar.parallel.zero:ZeroStrategy",        # data: ddp | zero1 | zero2 | zero3
    "jaxpar.parallel.expert:ExpertStrategy",    # expert: manual (all_to_all in shard_map)
    "jaxpar.parallel.tensor:TensorStrategy",    # tensor: manual (+ parallel.sequence, expert: manual), data: ddp
    "jaxpar.parallel.pipeline:PipelineStrategy",  # pipe: gpipe | 1f1b | interleaved | zb-h1 | dualpipev | pipedream-2bw
                                                 # (+ tensor: manual, expert: manual)
    "jaxpar.parallel.circular:CircularStrategy",  # pipe: circular (the compiler-driven pipeline)
    "jaxpar.parallel.context:ContextStrategy",    # context: ring | all_to_all (+ data, fsdp, tensor: auto)
)


def added_axes() -> tuple[str, ...]:
    """The mesh axes registered strategies add, in registry order."""
    return tuple(line.axis for line in STRATEGIES if isinstance(line, NewAxis))


def mesh_axes() -> tuple[str, ...]:
    """Every mesh axis in mesh order: the added ones outermost, then the built-in ones."""
    return (*added_axes(), *BUILT_IN_AXES)

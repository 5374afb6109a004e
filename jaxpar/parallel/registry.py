"""Which trainer runs a config: `parallel.<axis>` names the implementation of each mesh axis.

`auto` everywhere is the compiler-driven trainer. Anything else is looked up in
STRATEGIES: each line names a trainer and the axis implementations it runs (the
trainer's `RUNS`); the first line whose trainer runs every non-auto axis of the config
wins. A combination no line covers is refused with one line, before anything is built.
Adding a strategy = a new file with a `Strategy` subclass + one line here.
"""
from __future__ import annotations

import importlib

from jaxpar.config import MESH_AXES, ConfigError
from jaxpar.model.axes import named_arrays
from jaxpar.parallel.rules import AxisRules, parse_rules

AUTO = "jaxpar.parallel.auto:AutoTrainer"
STRATEGIES = (
    "jaxpar.parallel.zero:ZeroTrainer",        # data: ddp | zero1 | zero2 | zero3
    "jaxpar.parallel.tensor:TensorTrainer",    # tensor: manual (+ parallel.sequence), data: ddp
    "jaxpar.parallel.expert:ExpertTrainer",    # expert: manual (all_to_all in shard_map)
    "jaxpar.parallel.pipeline:PipelineTrainer",  # pipe: gpipe | 1f1b | interleaved | zb-h1 | dualpipev | pipedream-2bw
                                                 # (+ tensor: manual, expert: manual)
    "jaxpar.parallel.circular:CircularTrainer",  # pipe: circular (the compiler-driven pipeline)
)


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def implementations() -> dict[str, tuple[str, ...]]:
    """Valid values of each `parallel.<axis>`: auto, plus what the registered trainers run."""
    valid = {axis: ["auto"] for axis in MESH_AXES}
    for target in STRATEGIES:
        for axis, names in _load(target).RUNS.items():
            valid[axis] += [n for n in names if n not in valid[axis]]
    return {axis: tuple(names) for axis, names in valid.items()}


def select(config, sizes: dict[str, int]):
    """The trainer class for `config` on a mesh of `sizes`, checked (ConfigError if none fits)."""
    valid = implementations()
    chosen = {}
    for axis in MESH_AXES:
        value = config.parallel[axis]
        if value not in valid[axis]:
            raise ConfigError(f"parallel.{axis}", f"is '{value}'; valid: {', '.join(valid[axis])}")
        if value != "auto":
            chosen[axis] = value
    if not chosen:
        cls = _load(AUTO)
    else:
        fits = [cls for cls in map(_load, STRATEGIES)
                if all(value in cls.RUNS.get(axis, ()) for axis, value in chosen.items())]
        if not fits:
            asked = " with ".join(f"parallel.{a}={v}" for a, v in chosen.items())
            raise ConfigError(f"parallel.{next(iter(chosen))}", f"{asked} is not built (no trainer runs that "
                              "combination); set the other axes to auto")
        cls = fits[0]
    AxisRules(parse_rules(config.parallel.rules)).check(named_arrays(config.model.tie_embeddings), sizes)
    cls.check(config, sizes)
    return cls


def make_trainer(config, model_cfg, mesh, donate: bool | None = None):
    """Build the trainer `select` picks for `config` on `mesh`."""
    sizes = {axis: int(size) for axis, size in mesh.shape.items()}
    return select(config, sizes)(config, model_cfg, mesh, donate=donate)

"""Which strategy runs a config: `parallel.<axis>` names the implementation of each mesh axis.

`auto` everywhere is the compiler-driven strategy. Anything else is looked up in the registry's
lines (jaxpar/strategies.py, plain data the config reads too): each names a strategy, whose `RUNS`
says which axis implementations it runs; the first whose strategy runs every non-auto axis of the
config wins. A combination no line covers is refused with one line, before anything is built.
Adding a strategy = a new file with a `Strategy` subclass and its `predict` (and, if it holds more than
its stored gradients, its `held_memory`) + one line there (`NewAxis("<axis>", ...)` when it runs a mesh
axis of its own): `predict` then answers for it in the dry run, and the planner enumerates its `PLANNED`
values.
"""
from __future__ import annotations

import importlib

from jaxpar import strategies
from jaxpar.config import ConfigError, mesh_axes
from jaxpar.model.axes import named_arrays
from jaxpar.model.counting import ModelShape
from jaxpar.parallel.rules import AxisRules, parse_rules
from jaxpar.parallel.theory import Candidate, Prediction, candidate_from_config

AUTO = "jaxpar.parallel.auto:AutoStrategy"


def _load(target):
    """A registry line: "module:Class", the class itself, or a `NewAxis` naming either."""
    if isinstance(target, strategies.NewAxis):
        target = target.strategy
    if not isinstance(target, str):
        return target
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def registered():
    """Every registered strategy class, in registry order."""
    return [_load(line) for line in strategies.STRATEGIES]


def implementations() -> dict[str, tuple[str, ...]]:
    """Valid values of each `parallel.<axis>`: auto, plus what the registered strategies run."""
    valid: dict[str, list[str]] = {axis: ["auto"] for axis in mesh_axes()}
    for cls in registered():
        for axis, names in cls.RUNS.items():
            valid[axis] += [n for n in names if n not in valid[axis]]
    return {axis: tuple(names) for axis, names in valid.items()}


def planned() -> dict[str, tuple[str, ...]]:
    """The `parallel.<axis>` values the planner's space enumerates: auto, plus each strategy's PLANNED."""
    valid: dict[str, list[str]] = {axis: ["auto"] for axis in mesh_axes()}
    for cls in registered():
        for axis, names in (cls.RUNS if cls.PLANNED is None else cls.PLANNED).items():
            valid[axis] += [n for n in names if n not in valid[axis]]
    return {axis: tuple(names) for axis, names in valid.items()}


def strategy_for(impls: dict[str, str]):
    """The strategy class that runs these `parallel.<axis>` values (ConfigError naming the axis if none)."""
    chosen = {axis: value for axis, value in impls.items() if value != "auto"}
    if not chosen:
        return _load(AUTO)
    fits = [cls for cls in registered()
            if all(value in cls.RUNS.get(axis, ()) for axis, value in chosen.items())]
    if not fits:
        asked = " with ".join(f"parallel.{a}={v}" for a, v in chosen.items())
        raise ConfigError(f"parallel.{next(iter(chosen))}", f"{asked} is not built (no strategy runs that "
                          "combination); set the other axes to auto")
    return fits[0]


def runs(impls: dict[str, str]) -> bool:
    """Whether a registered strategy (or the automatic one) runs these `parallel.<axis>` values."""
    try:
        strategy_for(impls)
    except ConfigError:
        return False
    return True


def added_implementations() -> dict[str, tuple[str, ...]]:
    """Each added axis' implementations (auto aside), in the order of its strategy's `RUNS`: the first is the one
    `<axis>=N` means in `jaxpar plan --strategy`."""
    valid = implementations()
    return {axis: tuple(name for name in valid[axis] if name != "auto") for axis in strategies.added_axes()}


def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    """The prediction of the strategy that runs `cand`."""
    return strategy_for(cand.impls).predict(shape, cand, global_batch, seq_len, platform)


def held_memory(shape, cand: Candidate, prediction: Prediction, global_batch: int, seq_len: int):
    """What the strategy that runs `cand` holds beside its stored state (parallel/memory.py's `Held`)."""
    return strategy_for(cand.impls).held_memory(shape, cand, prediction, global_batch, seq_len)


def workload(config, model_cfg, sizes: dict[str, int], platform: str) -> tuple[ModelShape, Candidate, int, int, str]:
    """A config on a mesh of `sizes` as every `predict` takes it: (shape, candidate, global batch, seq_len,
    platform)."""
    return (ModelShape(model_cfg), candidate_from_config(config, sizes, platform), config.train.batch_size,
            config.data.seq_len, platform)


def predict_config(config, model_cfg, sizes: dict[str, int], platform: str) -> Prediction:
    """The prediction of the strategy that runs `config` on a mesh of `sizes` (the dry run's theory)."""
    return predict(*workload(config, model_cfg, sizes, platform))


def predicted_collective_bytes(config, model_cfg, sizes: dict[str, int], platform: str) -> dict[str, float]:
    """Bytes each device sends per step, by mesh axis, as the config's strategy predicts them."""
    return predict_config(config, model_cfg, sizes, platform).bytes_by_axis()


def select(config, sizes: dict[str, int]):
    """The strategy class for `config` on a mesh of `sizes`, checked (ConfigError if none fits)."""
    valid = implementations()
    for axis in mesh_axes():
        value = config.parallel[axis]
        if value not in valid[axis]:
            raise ConfigError(f"parallel.{axis}", f"is '{value}'; valid: {', '.join(valid[axis])}")
    for axis in strategies.added_axes():
        if sizes.get(axis, 1) > 1 and config.parallel[axis] == "auto":   # no rule of the compiler's names it
            raise ConfigError(f"parallel.{axis}", f"is 'auto' but mesh.{axis}={sizes[axis]}; choose one of "
                              f"{', '.join(valid[axis][1:])}, or mesh.{axis}=1")
    cls = strategy_for({axis: config.parallel[axis] for axis in mesh_axes()})
    AxisRules(parse_rules(config.parallel.rules)).check(named_arrays(config.model.tie_embeddings), sizes)
    cls.check(config, sizes)
    return cls


def build_strategy(config, devices=None, vocab: int | None = None, donate: bool | None = None):
    """The run chain in one call: the mesh over `devices` (default: every device), the model with vocabulary
    `vocab` (default: the config's), and the strategy `select` picks."""
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    model_cfg = ModelConfig.from_config(config.model, vocab)
    return make_strategy(config, model_cfg, make_mesh(config, devices), donate=donate)


def make_strategy(config, model_cfg, mesh, donate: bool | None = None):
    """Build the strategy `select` picks for `config` on `mesh`."""
    sizes = {axis: int(size) for axis, size in mesh.shape.items()}
    return select(config, sizes)(config, model_cfg, mesh, donate=donate)

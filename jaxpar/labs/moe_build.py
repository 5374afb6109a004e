"""Lab 04 (MoE)'s workbench: one layout configured, compiled once and cached, then run and read by every part."""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxpar.config import apply_overrides, model_vocab_size

if TYPE_CHECKING:
    from ml_collections import ConfigDict

    from jaxpar.parallel.strategy import Strategy


@dataclasses.dataclass
class Built:
    """One configuration's strategy and its compiled step (compiled once: run, timed and inspected)."""

    label: str
    config: ConfigDict
    strategy: Strategy
    compiled: jax.stages.Compiled
    compile_s: float

    @property
    def sizes(self) -> dict:
        return {name: int(size) for name, size in self.strategy.mesh.shape.items()}


class Lab:
    def __init__(self, config, devices, log=print) -> None:
        from jaxpar.data.pipeline import build_token_data, train_dataset, val_batches

        self.base, self.devices, self.n, self.log = config, devices, len(devices), log
        self.data = build_token_data(config.data)
        self.vocab = model_vocab_size(config, self.data.stats["vocab_size"], 1)
        B = config.train.batch_size
        self._stream = iter(train_dataset(self.data.train, B, config.data.shuffle_seed, slice(0, B)))
        self.validation = val_batches(self.data.val, B, config.train.eval_batches, slice(0, B))
        self._batches: list[np.ndarray] = []
        self.builds: dict[tuple, Built] = {}
        self._initial: dict = {}

    def batches(self, count: int) -> list[np.ndarray]:
        """The first `count` training batches of the corpus: the same list for every run."""
        while len(self._batches) < count:
            self._batches.append(np.asarray(next(self._stream)))
        return self._batches[:count]

    def build(self, label: str, overrides: list[str], devices: int = 1) -> Built:
        """Configure, build and compile one run (cached by its overrides and device count)."""
        from jaxpar.parallel.registry import build_strategy

        key = (tuple(overrides), devices)
        if key not in self.builds:
            config = copy.deepcopy(self.base)
            apply_overrides(config, ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", "mesh.tensor=1",
                                     "parallel.expert=auto", "train.compute_dtype=float32", *overrides])
            strategy = build_strategy(config, self.devices[:devices], self.vocab)
            start = time.perf_counter()
            with jax.set_mesh(strategy.mesh):
                compiled = strategy.lower_step().compile()
            self.builds[key] = Built(label, config, strategy, compiled, time.perf_counter() - start)
            self.log(f"  compiled {label} in {self.builds[key].compile_s:.1f} s")
        return self.builds[key]

    def initial_state(self, built: Built):
        """The initial state of `built`'s model in its layout: made once per parameter shapes (the same seed
        gives the same values), on the host without compiling anything, then placed per layout."""
        shapes = jax.eval_shape(built.strategy.make_state)
        key = str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), shapes))
        if key not in self._initial:
            with jax.default_device(jax.devices("cpu")[0]):
                self._initial[key] = jax.device_get(built.strategy.make_state())
        return built.strategy.from_canonical(self._initial[key])

    def run(self, built: Built, steps: int, keep=("moe_routed", "moe_dropped"), evaluate: bool = False) -> dict:
        """Train from the initial state over the first `steps` batches: losses, times, kept metrics per step,
        and with `evaluate` the validation cross-entropy at the end."""
        state = self.initial_state(built)
        out: dict[str, Any] = {"losses": [], "ce": [], "times": [], **{k: [] for k in keep}}
        with jax.set_mesh(built.strategy.mesh):
            for batch in self.batches(steps):
                tokens = jax.device_put(batch, built.strategy.batch_sharding)
                start = time.perf_counter()
                state, metrics = built.compiled(state, tokens)
                jax.block_until_ready(metrics)
                out["times"].append(time.perf_counter() - start)
                out["losses"].append(float(metrics["loss"]))
                out["ce"].append(float(metrics.get("ce_loss", metrics["loss"])))
                for k in keep:
                    if k in metrics:
                        out[k].append(np.asarray(metrics[k]).tolist())
            if evaluate:
                out["val_loss"] = float(np.mean([float(built.strategy.evaluate(state["params"], b))
                                                 for b in self.validation]))
        return out

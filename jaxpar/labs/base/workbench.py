"""The workbench a lab's parts share: the corpus and its first batches (the same list for every run), the compile
cache (each program compiled once ahead of time, then run, timed and read: nothing compiles twice) and the
initial state every layout starts from. A lab's own workbench adds how it configures its variants."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxpar.config import model_vocab_size
from jaxpar.measure.hlo import compiled_hlo

if TYPE_CHECKING:
    from ml_collections import ConfigDict

    from jaxpar.parallel.strategy import Strategy


@dataclasses.dataclass
class Built:
    """One variant's strategy and a program of it compiled once (its step, or its gradient): run, timed and read."""

    key: str
    label: str
    config: ConfigDict
    strategy: Strategy
    compiled: jax.stages.Compiled
    compile_s: float

    @property
    def sizes(self) -> dict:
        """The mesh's axis sizes."""
        return {name: int(size) for name, size in self.strategy.mesh.shape.items()}

    @property
    def hlo(self) -> str:
        return compiled_hlo(self.compiled)


class Workbench:
    """The lab's config (`base`), devices, corpus, batches, compiled programs (`builds`) and initial states."""

    def __init__(self, config, devices, log=print, vocab_multiple: int = 1) -> None:
        from jaxpar.data.pipeline import build_token_data, train_dataset

        self.base, self.devices, self.n, self.log = config, devices, len(devices), log
        self.platform = devices[0].platform
        self.data = build_token_data(config.data)
        self.vocab = model_vocab_size(config, self.data.stats["vocab_size"], vocab_multiple)
        rows = config.train.batch_size
        self._stream = iter(train_dataset(self.data.train, rows, config.data.shuffle_seed, slice(0, rows)))
        self._batches: list[np.ndarray] = []
        self.builds: dict[tuple, Built] = {}
        self._initial: dict[str, object] = {}

    def batches(self, count: int) -> list[np.ndarray]:
        """The first `count` training batches of the corpus: the same list for every run."""
        while len(self._batches) < count:
            self._batches.append(np.asarray(next(self._stream)))
        return self._batches[:count]

    def compile(self, cache_key: tuple, key: str, label: str, config, strategy, lower=None) -> Built:
        """`strategy`'s train step (or the program `lower()` returns), compiled once under `cache_key`."""
        if cache_key not in self.builds:
            start = time.perf_counter()
            with jax.set_mesh(strategy.mesh):
                compiled = (lower or strategy.lower_step)().compile()
            self.builds[cache_key] = Built(key, label, config, strategy, compiled, time.perf_counter() - start)
        return self.builds[cache_key]

    def compiles(self) -> tuple[int, float] | None:
        """How many programs the cache compiled and their seconds (None: none), for the sheet's footer."""
        return (len(self.builds), sum(b.compile_s for b in self.builds.values())) if self.builds else None

    def initial_state(self, built: Built):
        """The initial train state of `built`'s model in its layout: made once per parameter shapes (the same seed
        gives the same values in every layout), on the host without compiling anything, then placed per layout."""
        shapes = jax.eval_shape(built.strategy.make_state)
        key = str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), shapes))
        if key not in self._initial:
            with jax.default_device(jax.devices("cpu")[0]):
                self._initial[key] = jax.device_get(built.strategy.make_state())
        return jax.device_put(self._initial[key], built.strategy.state_shardings)

    def train(self, built: Built, batches, record=None):
        """Train from the initial state over `batches` with `built`'s step: the last state, each step's loss and
        time (blocked until its metrics are ready); `record(metrics)` sees every step's metrics."""
        state, losses, times = self.initial_state(built), [], []
        with jax.set_mesh(built.strategy.mesh):
            for batch in batches:
                tokens = jax.device_put(batch, built.strategy.batch_sharding)
                start = time.perf_counter()
                state, metrics = built.compiled(state, tokens)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
                losses.append(float(metrics["loss"]))
                if record:
                    record(metrics)
        return state, losses, times

    def sheet_header(self, title: str, model: str) -> str:
        """The sheet's header: `title` with the config and the devices; the model (`model`) and the batches."""
        from jaxpar.labs.base.runner import sheet_header
        c = self.base
        return sheet_header(f"{title}: config {c.name}, {self.n} x {self.platform}",
                            f"{model}; batch {c.train.batch_size} x {c.data.seq_len} tokens of the corpus "
                            f"'{c.data.corpus}'. Measured values come from the compiled program or the clock; "
                            "predicted values from the formulas named beside them.")

    def facts(self) -> dict:
        """The run's facts that head every results.json: config, devices, platform, jax, date."""
        return {"config": self.base.name, "devices": self.n, "platform": self.platform, "jax": jax.__version__,
                "date": time.strftime("%Y-%m-%d")}

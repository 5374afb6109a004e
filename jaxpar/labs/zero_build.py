"""Lab 02's workbench: one strategy configured, compiled once ahead of time and cached, then run, timed and
read by every part (the same executable, so nothing compiles twice)."""
from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxpar.config import apply_overrides, model_vocab_size
from jaxpar.measure.hlo import compiled_hlo
from jaxpar.parallel.zero import STAGE_NAMES

if TYPE_CHECKING:
    from ml_collections import ConfigDict

    from jaxpar.parallel.strategy import Strategy

MANUAL = ("ddp", "zero1", "zero2", "zero3")


# ============================================================================ building and running one step

@dataclasses.dataclass
class Built:
    """One strategy's strategy and its compiled step (compiled once: run, timed and inspected)."""

    key: str
    label: str
    config: ConfigDict
    strategy: Strategy
    compiled: jax.stages.Compiled
    compile_s: float
    sizes: dict

    @property
    def hlo(self) -> str:
        return compiled_hlo(self.compiled)


class Lab:
    def __init__(self, config, devices, out: Path, log=print):
        from jaxpar.data.pipeline import build_token_data, train_dataset
        from jaxpar.model.counting import param_count
        from jaxpar.model.transformer import ModelConfig

        self.base, self.devices, self.n, self.out, self.log = config, devices, len(devices), out, log
        self.platform = devices[0].platform
        self.data = build_token_data(config.data)
        vocab = model_vocab_size(config, self.data.stats["vocab_size"], 1)
        self.model_cfg = ModelConfig.from_config(config.model, vocab)
        self.counts = param_count(self.model_cfg)
        self.psi = self.counts["total"]
        B = config.train.batch_size
        self._stream = iter(train_dataset(self.data.train, B, config.data.shuffle_seed, slice(0, B)))
        self._batches: list[np.ndarray] = []
        self.builds: dict[tuple, Built] = {}
        self._initial = None
        self._strategies: list[Built] | None = None

    def batches(self, count: int) -> list[np.ndarray]:
        """The first `count` training batches: the same list for every strategy and precision."""
        while len(self._batches) < count:
            self._batches.append(np.asarray(next(self._stream)))
        return self._batches[:count]

    def variant(self, key: str, *, impl="auto", data=1, fsdp=1, remat=None, dtype="float32", layers=None) -> Built:
        """Configure, build and compile one strategy (cached by its settings); `impl` is parallel.data."""
        from jaxpar.mesh import make_mesh
        from jaxpar.model.transformer import ModelConfig
        from jaxpar.parallel.registry import make_strategy

        remat = remat or self.base.train.remat
        layers = layers or self.base.model.layers
        settings = (impl, data, fsdp, remat, dtype, layers, jax.config.jax_default_matmul_precision)  # type: ignore[attr-defined]  # dynamic
        if settings in self.builds:
            return self.builds[settings]
        config = copy.deepcopy(self.base)
        apply_overrides(config, [f"parallel.data={impl}", f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                                 "mesh.pipe=1", "mesh.expert=1", "mesh.tensor=1", f"model.layers={layers}",
                                 f"train.remat={remat}", f"train.compute_dtype={dtype}"])
        mesh = make_mesh(config, self.devices[:data * fsdp])
        model_cfg = ModelConfig.from_config(config.model, self.model_cfg.vocab_size)
        strategy = make_strategy(config, model_cfg, mesh)
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = strategy.lower_step().compile()
        built = Built(key, _label(impl, data, fsdp), config, strategy, compiled, time.perf_counter() - start,
                      {name: int(size) for name, size in mesh.shape.items()})
        self.log(f"  compiled {built.label} (remat {remat}, {dtype}) in {built.compile_s:.1f} s")
        self.builds[settings] = built
        return built

    def initial_state(self, built: Built):
        """The initial train state in `built`'s layout. Every strategy initialises the same values (same
        seed, same init), so it is made once, kept on the host and placed per layout: one init
        compile instead of one per strategy."""
        if self._initial is None:
            self._initial = jax.device_get(built.strategy.init_state())
        return built.strategy.from_canonical(self._initial)

    def run(self, built: Built, batches) -> tuple[list[float], list[float]]:
        """Train from the initial state over `batches`: per-step losses and step times (blocked)."""
        state = self.initial_state(built)
        losses, times = [], []
        with jax.set_mesh(built.strategy.mesh):
            for batch in batches:
                tokens = jax.device_put(batch, built.strategy.batch_sharding)
                start = time.perf_counter()
                state, metrics = built.compiled(state, tokens)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
                losses.append(float(metrics["loss"]))
        del state
        return losses, times

    def manual(self, impl: str, **settings) -> Built:
        return self.variant(impl, impl=impl, data=self.n, **settings)

    def strategies(self) -> list[Built]:
        """single device (the oracle), auto data=N, auto fsdp=N, manual DDP and ZeRO-1/2/3: the executables
        of part a (made there, on accelerators at matmul precision 'highest'), which parts b and c read."""
        if self._strategies is None:
            self._strategies = [self.variant("single"), self.variant("auto-data", data=self.n),
                                self.variant("auto-fsdp", fsdp=self.n), *(self.manual(s) for s in MANUAL)]
        return self._strategies


def _label(impl, data, fsdp) -> str:
    if impl != "auto":
        return f"manual {STAGE_NAMES[impl]}"
    if data * fsdp == 1:
        return "single device"
    return f"auto data={data}" if data > 1 else f"auto fsdp={fsdp}"

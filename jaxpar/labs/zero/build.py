"""Lab 02's workbench: one strategy configured, compiled once ahead of time and cached, then run, timed and
read by every part (the same executable, so nothing compiles twice)."""
from __future__ import annotations

import copy

import jax

from jaxpar.config import apply_overrides
from jaxpar.labs.base.workbench import Built, Workbench
from jaxpar.parallel.zero import STAGE_NAMES

MANUAL = ("ddp", "zero1", "zero2", "zero3")


class Lab(Workbench):
    """Lab 02's variants: the single device, the automatic data and FSDP layouts and the manual stages."""

    def __init__(self, config, devices, log=print) -> None:
        from jaxpar.model.counting import param_count
        from jaxpar.model.transformer import ModelConfig

        super().__init__(config, devices, log)
        self.model_cfg = ModelConfig.from_config(config.model, self.vocab)
        self.counts = param_count(self.model_cfg)
        self.psi = self.counts["total"]
        self._strategies: list[Built] | None = None

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
        built = self.compile(settings, key, _label(impl, data, fsdp), config, make_strategy(config, model_cfg, mesh))
        self.log(f"  compiled {built.label} (remat {remat}, {dtype}) in {built.compile_s:.1f} s")
        return built

    def run(self, built: Built, batches) -> tuple[list[float], list[float]]:
        """Train from the initial state over `batches`: per-step losses and step times (blocked)."""
        _, losses, times = self.train(built, batches)
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

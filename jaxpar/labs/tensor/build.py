"""Lab 03 (tensor)'s workbench: each variant (single device, automatic TP, manual TP / TP+SP) configured
and compiled once, its step and its gradient cached, then run and read by every part."""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxpar.config import ConfigError, apply_overrides, model_vocab_size

if TYPE_CHECKING:
    from ml_collections import ConfigDict

    from jaxpar.parallel.strategy import Strategy


# variant key -> (label, config overrides, TensorStrategy keyword arguments)
VARIANTS = {
    "single": ("single device", ["mesh.data=1", "mesh.tensor=1"], None),
    "auto": ("auto TP", [], None),
    "auto-sp": ("auto TP, rules length=tensor", ["parallel.rules=length=tensor"], None),
    "tp": ("manual TP", ["parallel.tensor=manual"], {}),
    "sp": ("manual TP+SP", ["parallel.tensor=manual", "parallel.sequence=true"], {}),
    "sp-keep": ("manual TP+SP, gathered inputs kept", ["parallel.tensor=manual", "parallel.sequence=true"],
                {"regather": False}),
}


@dataclasses.dataclass
class Built:
    key: str
    label: str
    config: ConfigDict
    strategy: Strategy
    compiled: jax.stages.Compiled
    compile_s: float


class Lab:
    def __init__(self, config, devices, tensor: int, log=print):
        from jaxpar.data.pipeline import build_token_data, train_dataset
        from jaxpar.model.transformer import ModelConfig

        self.base, self.devices, self.t, self.log = config, devices, tensor, log
        self.d = len(devices) // tensor
        self.data = build_token_data(config.data)
        vocab = model_vocab_size(config, self.data.stats["vocab_size"], tensor)
        if vocab % tensor:
            raise ConfigError("model.vocab_size", f"{vocab} is not divisible by --tensor {tensor}")
        self.model_cfg = ModelConfig.from_config(config.model, vocab)
        B = config.train.batch_size
        self._stream = iter(train_dataset(self.data.train, B, config.data.shuffle_seed, slice(0, B)))
        self._batches: list[np.ndarray] = []
        self.builds: dict[tuple, Built] = {}
        self._initial = None

    def batches(self, count: int) -> list[np.ndarray]:
        while len(self._batches) < count:
            self._batches.append(np.asarray(next(self._stream)))
        return self._batches[:count]

    def config_of(self, key: str, layers: int | None = None):
        config = copy.deepcopy(self.base)
        overrides = [f"mesh.data={self.d}", f"mesh.tensor={self.t}", "mesh.fsdp=1", "mesh.pipe=1", "mesh.expert=1",
                     "train.compute_dtype=float32",
                     "train.microbatches=1", "train.remat=none", "parallel.tensor=auto", "parallel.sequence=false",
                     "parallel.data=auto", "parallel.rules=", *VARIANTS[key][1]]
        if layers:
            overrides.append(f"model.layers={layers}")
        apply_overrides(config, overrides)
        return config

    def strategy(self, key: str, layers: int | None = None):
        from jaxpar.mesh import make_mesh
        from jaxpar.model.transformer import ModelConfig
        from jaxpar.parallel.registry import make_strategy, select
        from jaxpar.parallel.tensor import TensorStrategy

        config = self.config_of(key, layers)
        mesh = make_mesh(config, self.devices[:1] if key == "single" else self.devices)
        model_cfg = ModelConfig.from_config(config.model, self.model_cfg.vocab_size)
        options = VARIANTS[key][2]
        if options is None:
            return config, make_strategy(config, model_cfg, mesh)
        select(config, dict(mesh.shape))
        return config, TensorStrategy(config, model_cfg, mesh, **options)

    def step(self, key: str) -> Built:
        """The variant's train step, compiled once (cached)."""
        if ("step", key) not in self.builds:
            config, strategy = self.strategy(key)
            start = time.perf_counter()
            with jax.set_mesh(strategy.mesh):
                compiled = strategy.lower_step().compile()
            self.builds[("step", key)] = Built(key, VARIANTS[key][0], config, strategy, compiled,
                                               time.perf_counter() - start)
            self.log(f"  compiled the step of {VARIANTS[key][0]} in {time.perf_counter() - start:.1f} s")
        return self.builds[("step", key)]

    def gradient(self, key: str, layers: int | None = None) -> Built:
        """The variant's gradient program (loss and mean gradient, no optimizer), compiled once (cached)."""
        layers = layers or self.model_cfg.layers
        if ("grad", key, layers) not in self.builds:
            config, strategy = self.strategy(key, layers)
            start = time.perf_counter()
            with jax.set_mesh(strategy.mesh):
                if key == "single":
                    compiled = jax.jit(_single_device_gradient(strategy)).lower(
                        strategy.abstract_state["params"], strategy.abstract_batch()).compile()
                else:
                    compiled = strategy.grad_fn.lower(strategy.abstract_state["params"],
                                                     strategy.abstract_batch()).compile()
            self.builds[("grad", key, layers)] = Built(key, VARIANTS[key][0], config, strategy, compiled,
                                                       time.perf_counter() - start)
            self.log(f"  compiled the gradient of {VARIANTS[key][0]} ({layers} layers) in "
                     f"{time.perf_counter() - start:.1f} s")
        return self.builds[("grad", key, layers)]

    def initial_params(self, built: Built):
        if self._initial is None:
            self._initial = jax.device_get(built.strategy.init_state())
        return self._initial

    def run(self, built: Built, batches) -> list[float]:
        state = jax.device_put(self.initial_params(built), built.strategy.state_shardings)
        losses = []
        with jax.set_mesh(built.strategy.mesh):
            for batch in batches:
                state, metrics = built.compiled(state, jax.device_put(batch, built.strategy.batch_sharding))
                losses.append(float(metrics["loss"]))
        return losses

    def grads(self, built: Built, batch):
        strategy = built.strategy
        params = jax.device_put(self.initial_params(built)["params"], strategy.param_shardings)
        with jax.set_mesh(strategy.mesh):
            metrics, grads = built.compiled(params, jax.device_put(batch, strategy.batch_sharding))
        return float(metrics["loss"]), jax.device_get(grads)


def _single_device_gradient(strategy):
    from jaxpar.model.transformer import loss

    def value_and_grad(params, tokens):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, tokens, strategy.model_cfg, strategy.ops,
                                                                     strategy.policy)
        return metrics, grads        # the manual strategies' `grad_fn` layout
    return value_and_grad

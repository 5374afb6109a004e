"""Lab 03 (tensor)'s workbench: each variant (single device, automatic TP, manual TP / TP+SP) configured
and compiled once, its step and its gradient cached, then run and read by every part."""
from __future__ import annotations

import copy

import jax

from jaxpar.config import ConfigError, apply_overrides
from jaxpar.labs.base.workbench import Built, Workbench

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


class Lab(Workbench):
    """Lab 03's variants on a data x tensor mesh (`VARIANTS`): their steps and their gradient programs."""

    def __init__(self, config, devices, tensor: int, log=print) -> None:
        from jaxpar.model.transformer import ModelConfig

        super().__init__(config, devices, log, vocab_multiple=tensor)
        self.t, self.d = tensor, len(devices) // tensor
        if self.vocab % tensor:
            raise ConfigError("model.vocab_size", f"{self.vocab} is not divisible by --tensor {tensor}")
        self.model_cfg = ModelConfig.from_config(config.model, self.vocab)

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
            built = self.compile(("step", key), key, VARIANTS[key][0], config, strategy)
            self.log(f"  compiled the step of {built.label} in {built.compile_s:.1f} s")
        return self.builds[("step", key)]

    def gradient(self, key: str, layers: int | None = None) -> Built:
        """The variant's gradient program (loss and mean gradient, no optimizer), compiled once (cached)."""
        layers = layers or self.model_cfg.layers
        if ("grad", key, layers) not in self.builds:
            config, strategy = self.strategy(key, layers)
            args = (strategy.abstract_state["params"], strategy.abstract_batch())
            gradient = jax.jit(_single_device_gradient(strategy)) if key == "single" else strategy.grad_fn
            built = self.compile(("grad", key, layers), key, VARIANTS[key][0], config, strategy,
                                 lambda: gradient.lower(*args))
            self.log(f"  compiled the gradient of {built.label} ({layers} layers) in {built.compile_s:.1f} s")
        return self.builds[("grad", key, layers)]

    def run(self, built: Built, batches) -> list[float]:
        return self.train(built, batches)[1]

    def grads(self, built: Built, batch):
        strategy = built.strategy
        params = jax.device_put(self.initial_state(built)["params"], strategy.param_shardings)
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

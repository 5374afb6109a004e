"""Lab 07 (MoE)'s workbench: one layout configured, compiled once and cached, then run and read by every part."""
from __future__ import annotations

import copy
from typing import Any

import jax
import numpy as np

from jaxpar.config import apply_overrides
from jaxpar.labs.base.workbench import Built, Workbench


class Lab(Workbench):
    """Lab 07's runs: a layout of the MoE model (or its dense twin) by its overrides, and the validation batches."""

    def __init__(self, config, devices, log=print) -> None:
        from jaxpar.data.pipeline import val_batches

        super().__init__(config, devices, log)
        rows = config.train.batch_size
        self.validation = val_batches(self.data.val, rows, config.train.eval_batches, slice(0, rows))

    def build(self, label: str, overrides: list[str], devices: int = 1) -> Built:
        """Configure, build and compile one run (cached by its overrides and device count)."""
        from jaxpar.parallel.registry import build_strategy

        key = (tuple(overrides), devices)
        if key not in self.builds:
            config = copy.deepcopy(self.base)
            apply_overrides(config, ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", "mesh.tensor=1",
                                     "parallel.expert=auto", "train.compute_dtype=float32", *overrides])
            built = self.compile(key, label, label, config, build_strategy(config, self.devices[:devices], self.vocab))
            self.log(f"  compiled {label} in {built.compile_s:.1f} s")
        return self.builds[key]

    def run(self, built: Built, steps: int, keep=("moe_routed", "moe_dropped"), evaluate: bool = False) -> dict:
        """Train from the initial state over the first `steps` batches: losses, times, kept metrics per step,
        and with `evaluate` the validation cross-entropy at the end."""
        out: dict[str, Any] = {"losses": [], "ce": [], "times": [], **{k: [] for k in keep}}

        def record(metrics):
            out["ce"].append(float(metrics.get("ce_loss", metrics["loss"])))
            for k in keep:
                if k in metrics:
                    out[k].append(np.asarray(metrics[k]).tolist())

        state, out["losses"], out["times"] = self.train(built, self.batches(steps), record)
        if evaluate:
            with jax.set_mesh(built.strategy.mesh):
                out["val_loss"] = float(np.mean([float(built.strategy.evaluate(state["params"], b))
                                                 for b in self.validation]))
        return out

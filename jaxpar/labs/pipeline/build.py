"""Lab 04 (pipeline)'s workbench: the lab model, the pipe settings of one schedule, and the Lab that
configures, compiles and runs each layout once."""
import copy
import time
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import apply_overrides
from jaxpar.parallel.pipeline import B_FIRST, B_MID, F_FIRST, F_LAST, F_MID, IDLE, W

VOCAB = 512
FAST = {"xla_backend_optimization_level": 0}      # equivalence and memory: same HLO, ~2.5x faster compiles
REPO = Path(__file__).resolve().parents[3]
# the lab's model: 8 layers (2 per stage at p=4), big enough that a tick's compute shows in a CPU profile
LAB_MODEL = ["model.layers=8", "model.d_model=128", "model.heads=4", "model.kv_heads=2", "model.mlp_dim=256",
             "data.seq_len=64", "train.warmup_steps=1", "train.weight_decay=0.1"]
MICRO = 4                                         # rows per pipeline microbatch (fixed, so memory tracks m)
KIND = {F_FIRST: "F", F_MID: "F", F_LAST: "F", B_FIRST: "B", B_MID: "B", W: "W", IDLE: None}
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}

TABLE_CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


# ============================================================================ building and running

class Lab:
    def __init__(self, config, out: Path, log=print, quick: bool = False):
        self.base, self.out, self.log, self.quick = config, out, log, quick
        self._built: dict = {}
        self._initial = None

    def few(self, cases: list, *keep: int) -> list:
        """`cases`, or with --quick only those at the indices `keep` (each part still runs, on fewer layouts)."""
        return [cases[i] for i in keep] if self.quick else cases

    def config(self, overrides: list[str]):
        config = copy.deepcopy(self.base)
        apply_overrides(config, overrides)
        return config

    def strategy(self, overrides: list[str], devices: int):
        from jaxpar.parallel.registry import build_strategy
        return build_strategy(self.config(overrides), jax.devices()[:devices], VOCAB)

    def compiled(self, overrides: list[str], devices: int, fast: bool = True):
        """(strategy, compiled step), compiled once per settings."""
        key = (tuple(overrides), devices, fast)
        if key not in self._built:
            strategy = self.strategy(overrides, devices)
            start = time.perf_counter()
            with jax.set_mesh(strategy.mesh):
                lowered = strategy.lower_step()
                step = lowered.compile(compiler_options=FAST) if fast else lowered.compile()
            self.log(f"  compiled {' '.join(o for o in overrides if 'pipe' in o or 'mesh' in o)} "
                     f"in {time.perf_counter() - start:.1f} s")
            self._built[key] = (strategy, step)
        return self._built[key]

    def initial(self, strategy):
        if strategy.config.parallel.pipe == "pipedream-2bw":   # its optimizer state is its own pytree; same params
            return strategy.init_state()
        if self._initial is None:
            self._initial = jax.device_get(self.strategy(["mesh.data=1"], 1).init_state())
        return jax.device_put(self._initial, strategy.state_shardings)

    def batches(self, config, steps: int):
        rng = np.random.default_rng(0)
        rows, length = config.train.batch_size, config.data.seq_len + 1
        out = []
        for _ in range(steps):   # rows counting up by a row's own stride: learnable
            start, stride = rng.integers(0, VOCAB, (rows, 1)), rng.integers(1, 4, (rows, 1))
            out.append(((start + stride * np.arange(length)) % VOCAB).astype(np.int32))
        return out

    def run(self, strategy, step, steps: int):
        state, losses, norms = self.initial(strategy), [], []
        for batch in self.batches(strategy.config, steps):
            with jax.set_mesh(strategy.mesh):
                state, metrics = step(state, jax.device_put(batch, strategy.batch_sharding))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        return losses, norms


def _pipe(schedule: str, p: int, m: int, v: int = 1, data: int = 1, fsdp: int = 1, tensor: int = 1) -> list[str]:
    return [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.pipe={p}", f"mesh.tensor={tensor}",
            f"parallel.pipe={schedule}", f"parallel.pipe_microbatches={m}", f"parallel.pipe_virtual={v}",
            f"train.batch_size={MICRO * m * data * fsdp}"]

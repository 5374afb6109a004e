"""Lab 08, part a: the Pallas kernels inside every hand-written strategy, against one device.

Each manual strategy (DDP and ZeRO-1/2/3 over `data`, Megatron TP, the pipeline schedules,
manual expert parallelism) trains the tiny model with flash attention, the fused RMSNorm and
the chunked loss; its losses and gradient norms are compared with the dot/XLA run on one
device (the oracle). On CPU the kernels run interpreted, and the ZeRO strategies' shard_map
then skips its vma check (kernels/kernel_ops.py: interpreted_pallas): this table is where that
is shown to change no number. The tests run one case (zero3); the whole matrix runs here.
"""
from __future__ import annotations

import time

import jax
import numpy as np

KERNELS = ["model.attention=pallas", "model.norm=pallas", "model.loss=chunked"]
PIPE = ["mesh.data=1", "parallel.pipe_microbatches=8"]
MOE = ["model.moe.experts=4"]
# label -> (overrides, devices, the oracle's overrides): one device with the same model; an MoE pipeline's oracle
# accumulates the same microbatches (its balance loss multiplies two means over a microbatch)
LAYOUTS = {
    "ddp, data=8": (["mesh.data=8", "parallel.data=ddp"], 8, []),
    "zero1, data=8": (["mesh.data=8", "parallel.data=zero1"], 8, []),
    "zero2, data=8": (["mesh.data=8", "parallel.data=zero2"], 8, []),
    "zero3, data=8": (["mesh.data=8", "parallel.data=zero3"], 8, []),
    "zero3 + prefetch, data=8": (["mesh.data=8", "parallel.data=zero3", "parallel.prefetch=true"], 8, []),
    "manual tp: tensor=4 x data=2": (["mesh.data=2", "mesh.tensor=4", "parallel.tensor=manual",
                                      "parallel.data=ddp"], 8, []),
    "gpipe, pipe=4": ([*PIPE, "mesh.pipe=4", "parallel.pipe=gpipe"], 4, []),
    "1f1b, pipe=4": ([*PIPE, "mesh.pipe=4", "parallel.pipe=1f1b"], 4, []),
    "interleaved, pipe=2 v=2": ([*PIPE, "mesh.pipe=2", "parallel.pipe=interleaved", "parallel.pipe_virtual=2"], 2,
                                []),
    "zb-h1, pipe=4": ([*PIPE, "mesh.pipe=4", "parallel.pipe=zb-h1"], 4, []),
    "dualpipev + manual tp: fsdp=2 x pipe=2 x tensor=2": (["mesh.data=1", "mesh.fsdp=2", "mesh.pipe=2",
                                                          "mesh.tensor=2", "parallel.pipe=dualpipev",
                                                          "parallel.tensor=manual", "parallel.pipe_microbatches=4"],
                                                         8, []),
    "MoE, manual expert: expert=4 x data=2": ([*MOE, "mesh.data=2", "mesh.expert=4", "parallel.expert=manual"], 8,
                                              MOE),
    "MoE, 1f1b + manual expert: pipe=2 x expert=2 x data=2": ([*MOE, "mesh.data=2", "mesh.pipe=2", "mesh.expert=2",
                                                               "parallel.pipe=1f1b", "parallel.expert=manual",
                                                               "parallel.pipe_microbatches=4"], 8,
                                                              [*MOE, "train.microbatches=4"]),
}


def relative_error(got, want) -> float:
    """The lab's measure: max |got - want| / max |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def counting_batches(batch: int, seq_len: int, vocab: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Rows that count up by a row-specific stride: learnable, deterministic, no corpus needed."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start, stride = rng.integers(0, vocab, (batch, 1)), rng.integers(1, 4, (batch, 1))
        out.append(((start + stride * np.arange(seq_len + 1)) % vocab).astype(np.int32))
    return out


def _train(overrides, devices: int, vocab: int, steps: int) -> np.ndarray:
    """[steps, 2]: loss and gradient norm of each step."""
    from jaxpar.config import apply_overrides, load_config
    from jaxpar.parallel.registry import build_strategy

    config = load_config(None)
    apply_overrides(config, overrides)
    strategy = build_strategy(config, jax.devices()[:devices], vocab)
    state, seen = strategy.init_state(), []
    for batch in counting_batches(config.train.batch_size, config.data.seq_len, vocab, steps):
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        seen.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return np.array(seen)


def strategy_agreement(base: list[str], vocab: int, steps: int, tolerance: float, log, layouts=None) -> dict:
    """Every layout in `layouts` (default: all) with the kernels vs the dot run on one device."""
    from jaxpar.labs.base.report import md_table

    layouts = LAYOUTS if layouts is None else {k: LAYOUTS[k] for k in layouts}
    oracles, rows = {}, []
    for label, (overrides, devices, oracle) in layouts.items():
        if devices > len(jax.devices()):
            continue
        if tuple(oracle) not in oracles:
            oracles[tuple(oracle)] = _train([*base, *oracle, "mesh.data=1"], 1, vocab, steps)
        start = time.perf_counter()
        seen, want = _train([*base, *overrides, *KERNELS], devices, vocab, steps), oracles[tuple(oracle)]
        row = {"layout": label, "losses": seen[:, 0].tolist(), "grad_norms": seen[:, 1].tolist(),
               "loss_rel": relative_error(seen[:, 0], want[:, 0]),
               "grad_norm_rel": relative_error(seen[:, 1], want[:, 1]),
               "seconds": time.perf_counter() - start}
        row["within"] = max(row["loss_rel"], row["grad_norm_rel"]) <= tolerance
        rows.append(row)
        log(f"  {label}: loss {row['loss_rel']:.1e}, grad norm {row['grad_norm_rel']:.1e} ({row['seconds']:.0f} s)")
    table = md_table(["layout (pallas attention + fused norm + chunked loss)", "loss: max rel. diff vs one device",
                      "grad norm: max rel. diff", "tolerance", "within"],
                     [[r["layout"], f"{r['loss_rel']:.1e}", f"{r['grad_norm_rel']:.1e}", f"{tolerance:.0e}",
                       "yes" if r["within"] else "**NO**"] for r in rows])
    return {"rows": rows, "markdown": table}

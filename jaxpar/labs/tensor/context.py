"""Lab 03 (tensor), part e: context parallelism (parallel/context.py), the sequence split over `context`.

For growing sequence lengths, ring and all_to_all over `context` devices train the same batches as one device
(fp32 losses, max relative deviation) and the compiled step's context-axis bytes are set beside
`parallel/context_predict.py`. The ring's schedule is drawn from the same rule the code runs (which chunk
pairs a device computes at each hop): with the load-balanced order every device does the same work at every
hop; with contiguous chunks the last device does 2c - 1 times the first's.
"""
from __future__ import annotations

import copy
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import apply_overrides
from jaxpar.figures import figure, save, styled
from jaxpar.labs.base.report import max_rel_dev, md_table
from jaxpar.measure.hlo import collectives
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.registry import make_strategy, predicted_collective_bytes
from jaxpar.units import fmt_bytes, ratio

TORCH = ("PyTorch's counterpart, `torch.distributed.tensor.experimental.context_parallel`, does not run on CPU: "
         "with torch 2.13.0+cpu on gloo (2 processes) it stops at `aten._scaled_dot_product_flash_attention_for_cpu"
         ".default does not have a sharding strategy registered` (its ring handles the CUDA flash, efficient and "
         "cuDNN attention ops only).")


def ring_work(context: int, zigzag: bool = True) -> np.ndarray:
    """[device, hop] -> visible key/value chunk pairs computed, in units of one (S/2c)² block (a diagonal
    block counts 1/2). zigzag: device i holds chunks i and 2c-1-i (parallel/context_attention.py); else
    chunks 2i and 2i+1 (contiguous)."""
    held = [(i, 2 * context - 1 - i) if zigzag else (2 * i, 2 * i + 1) for i in range(context)]
    work = np.zeros((context, context))
    for i in range(context):
        for hop in range(context):
            for q in held[i]:
                for k in held[(i - hop) % context]:
                    work[i, hop] += 1.0 if k < q else 0.5 if k == q else 0.0
    return work


def _run(config, overrides: list[str], devices, batches):
    config = copy.deepcopy(config)
    apply_overrides(config, overrides)
    strategy = make_strategy(config, ModelConfig.from_config(config.model), make_mesh(config, devices))
    with jax.set_mesh(strategy.mesh):
        compiled = strategy.lower_step().compile()
        state, losses = strategy.init_state(), []
        for batch in batches:
            state, metrics = compiled(state, jax.device_put(batch, strategy.batch_sharding))
            losses.append(float(metrics["loss"]))
    found = [c for c in collectives(compiled.as_text(), strategy.mesh) if c.axes == ("context",)]
    predicted = predicted_collective_bytes(config, strategy.model_cfg, dict(strategy.mesh.shape), "cpu")
    return losses, sum(c.bytes_per_step for c in found), predicted.get("context", 0.0)


def _batches(config, seq_len: int, steps: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    rows = config.train.batch_size
    return [((rng.integers(0, vocab, (rows, 1)) + rng.integers(1, 4, (rows, 1)) * np.arange(seq_len + 1)) % vocab
             ).astype(np.int32) for _ in range(steps)]


def context(lab, steps: int, quick: bool) -> dict:
    """Part e: exactness and bytes at growing lengths, for ring and all_to_all over `context` devices."""
    context_size = min(4, len(lab.devices))
    lengths = (32, 64) if quick else (64, 256, 1024)
    base = ["mesh.data=1", "mesh.fsdp=1", "mesh.pipe=1", "mesh.expert=1", "mesh.tensor=1", "parallel.tensor=auto",
            "parallel.sequence=false", "parallel.data=auto", "parallel.rules=", "model.loss=full",
            "model.attention=dot"]
    vocab = lab.model_cfg.vocab_size
    rows, out = [], {}
    for seq_len in lengths:
        common = [*base, f"data.seq_len={seq_len}", f"model.max_seq_len={max(seq_len, lab.base.model.max_seq_len)}",
                  f"model.vocab_size={vocab}"]
        batches = _batches(lab.base, seq_len, steps, vocab)
        oracle, _, _ = _run(lab.base, [*common, "mesh.context=1"], lab.devices[:1], batches)
        for impl in ("ring", "all_to_all"):
            losses, measured, predicted = _run(lab.base, [*common, f"mesh.context={context_size}",
                                                            f"parallel.context={impl}"],
                                               lab.devices[:context_size], batches)
            dev = max_rel_dev(losses, oracle)
            out[f"{impl}-{seq_len}"] = {"seq_len": seq_len, "impl": impl, "deviation": dev, "measured": measured,
                                        "predicted": predicted}
            rows.append([seq_len, impl, f"{dev:.1e}", fmt_bytes(measured), fmt_bytes(predicted),
                         ratio(measured, predicted)])
    zigzag, contiguous = ring_work(context_size), ring_work(context_size, zigzag=False)
    markdown = "\n\n".join([
        f"## e. Context parallelism: the sequence split over context={context_size}",
        f"{steps} fp32 steps of the same synthetic batches (rows counting up) as one device; bytes per step on "
        "the context axis (ring hops or all_to_alls, and the gradient all-reduce) from the compiled step, beside "
        "`parallel/context_predict.py`.",
        md_table(["seq_len", "parallel.context", "max rel. loss dev.", "compiled bytes", "predicted", "ratio"], rows),
        f"The ring's work per hop (chunk pairs with visible scores, (S/2c)² blocks): load-balanced order, the "
        f"busiest device per hop {zigzag.max(axis=0).tolist()} (total {zigzag.max(axis=0).sum():g}); contiguous "
        f"chunks {contiguous.max(axis=0).tolist()} (total {contiguous.max(axis=0).sum():g}), every hop waiting "
        "for its busiest device.",
        TORCH])
    return {"markdown": markdown, "runs": out, "context": context_size,
            "work": {"zigzag": zigzag.tolist(), "contiguous": contiguous.tolist()}}


@styled
def plot_context(result: dict, path: Path):
    """The ring's work per device and hop, load-balanced against contiguous chunks."""
    fig = figure(10, 4.2)
    for n, name in enumerate(("zigzag", "contiguous")):
        ax = fig.add_subplot(1, 2, n + 1)
        work = np.asarray(result["work"][name])
        image = ax.imshow(work, cmap="viridis", vmin=0, vmax=max(4.0, float(work.max())))
        ax.set_xticks(range(work.shape[1]))
        ax.set_yticks(range(work.shape[0]))
        ax.grid(False)
        ax.set_xlabel("ring hop")
        ax.set_ylabel("device")
        ax.set_title(f"{'load-balanced (chunks i, 2c-1-i)' if name == 'zigzag' else 'contiguous chunks'}: "
                     f"busiest device per hop, summed: {work.max(axis=0).sum():g}", fontsize=9)
        for (i, j), value in np.ndenumerate(work):
            ax.text(j, i, f"{value:g}", ha="center", va="center", color="white", fontsize=8)
    fig.colorbar(image, ax=fig.axes, label="(S/2c)² blocks computed")
    save(fig, path)

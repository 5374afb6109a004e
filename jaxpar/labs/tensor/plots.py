"""Lab 03 (tensor)'s figures, drawn from results.json (`python -m jaxpar.labs.replot tensor RUN_DIR`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs.base import report
from jaxpar.labs.tensor.context import plot_context
from jaxpar.units import byte_unit, fmt_bytes


def _variant_ticks(ax, rows) -> None:
    ax.set_xticks(np.arange(len(rows)), [r["label"].replace(", ", ",\n").replace(" TP", "\nTP", 1) for r in rows])


@styled
def plot_communication(result: dict, path: Path):
    """One layer's tensor-axis collectives: compiled by op (stacked) beside the formula, in units of u."""
    rows, u = list(result["rows"].values()), result["u"]
    unit, scale = byte_unit([v for r in rows for v in (r["layer_bytes"], r["layer_predicted"])])
    fig = figure(10, 5.8)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.38
    bottom = np.zeros(len(rows))
    for op in sorted({op for r in rows for op in r["layer_by_op"]}):
        vals = np.array([r["layer_by_op"].get(op, 0.0) for r in rows]) / scale
        ax.bar(x - w / 2, vals, w, bottom=bottom, label=f"compiled: {op}")
        bottom += vals
    predicted = [r["layer_predicted"] for r in rows]
    bars = ax.bar(x + w / 2, [(v or 0) / scale for v in predicted], w, color="0.6", hatch="..", edgecolor="0.3",
                  label=f"formula, ring model (u = (t-1)/t·4·b·s·h = {fmt_bytes(u)})")
    ax.bar_label(bars, [f"{v / u:.0f}u" if v else "" for v in predicted], padding=3)
    for i in (i for i, v in enumerate(predicted) if not v):
        ax.text(x[i] + w / 2, 0, " no formula: XLA's own layout", rotation=90, ha="center", va="bottom")
    _variant_ticks(ax, rows)
    ax.set_ylim(top=1.12 * max(bottom.max(), max(v or 0 for v in predicted) / scale))
    ax.set(ylabel=f"{unit} sent per device per layer",
           title="Tensor-axis collectives of one layer: compiled (left) vs formula (right)")
    legend_below(ax, ncols=2, gap=0.25)
    return save(fig, path)


@styled
def plot_memory(result: dict, path: Path):
    """Activation bytes per layer, four ways, each split into the sequence region (solid, what SP divides
    by t) and the tensor region (hatched, what TP divides by t)."""
    rows = list(result["rows"].values())
    sources = (("compiled (temp slope)", "k", [r["compiled_sequence_region"] for r in rows],
                [r["compiled_per_layer"] - r["compiled_sequence_region"] for r in rows]),
               ("autodiff saves", "#4c72b0", [r["saved"]["sequence_region"] for r in rows],
                [r["saved"]["tensor_region"] for r in rows]),
               ("jaxpar's count", "#55a868", [r["jaxpar_formula"]["sequence_region"] for r in rows],
                [r["jaxpar_formula"]["tensor_region"] for r in rows]),
               ("Korthikanti et al. x2 (their bf16 count, in fp32)", "#c44e52",
                [2 * r["korthikanti_bf16"]["sequence_region"] for r in rows],
                [2 * r["korthikanti_bf16"]["tensor_region"] for r in rows]))
    unit, scale = byte_unit([r["compiled_per_layer"] for r in rows])
    fig = figure(10, 6)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.2
    for i, (name, color, seq_bytes, ten_bytes) in enumerate(sources):
        seq, ten = np.array(seq_bytes) / scale, np.array(ten_bytes) / scale
        ax.bar(x + (i - 1.5) * w, seq, w, color=color, label=name)
        ax.bar(x + (i - 1.5) * w, ten, w, bottom=seq, color=color, alpha=0.35, hatch="//", edgecolor=color)
    ax.bar([0], [0], color="0.5", label="solid: sequence region (SP divides it by t)")
    ax.bar([0], [0], color="0.5", alpha=0.35, hatch="//", edgecolor="0.5",
           label="hatched: tensor region (TP divides it by t)")
    _variant_ticks(ax, rows)
    ax.set(ylabel=f"{unit} per layer per device", title="Activation memory per layer: compiled vs three counts")
    legend_below(ax, ncols=2, gap=0.25)
    return save(fig, path)


PLOTS = {"equivalence.png": ("equivalence", report.plot_single_device_equivalence),
         "communication.png": ("communication", plot_communication), "memory.png": ("memory", plot_memory),
         "context.png": ("context", plot_context)}

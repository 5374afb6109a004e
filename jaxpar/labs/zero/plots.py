"""Lab 02's figures, drawn from results.json (`python -m jaxpar.labs.replot zero RUN_DIR` redraws them)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs.base import report
from jaxpar.units import byte_unit


def _strategy_ticks(ax, rows) -> None:
    ax.set_xticks(np.arange(len(rows)), [r["label"].replace("manual ", "").replace(" ", "\n", 1) for r in rows])


@styled
def plot_memory(result: dict, path: Path):
    """Per strategy, the prediction (solid) beside the compiled step (hatched): state and temporaries."""
    rows = list(result["rows"].values())
    state = np.array([r["formula"]["params"] + r["formula"]["optimizer"] for r in rows])
    temp = np.array([r["temp_paper"] for r in rows])
    args = np.array([r["compiled"]["argument"] for r in rows])
    ctemp = np.array([r["compiled"]["temp"] for r in rows])
    unit, scale = byte_unit([*(state + temp), *(args + ctemp)])
    fig = figure(10, 5.6)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.38
    ax.bar(x - w / 2, state / scale, w, color="#4c72b0", label="predicted state: params + Adam (ZeRO formula)")
    ax.bar(x - w / 2, temp / scale, w, bottom=state / scale, color="#dd8452",
           label="predicted temp: grads (formula) + activations (paper: Korthikanti)")
    ax.bar(x + w / 2, args / scale, w, color="#4c72b0", hatch="//", edgecolor="k", alpha=0.6,
           label="compiled arguments: params + Adam + batch")
    ax.bar(x + w / 2, ctemp / scale, w, bottom=args / scale, color="#dd8452", hatch="//", edgecolor="k", alpha=0.6,
           label="compiled temp (memory_analysis)")
    _strategy_ticks(ax, rows)
    ax.set(ylabel=f"{unit} per device", title="Memory per device: predicted (left bar) vs compiled (right bar)")
    legend_below(ax, ncols=2, gap=0.2)
    return save(fig, path)


@styled
def plot_communication(result: dict, path: Path):
    """Per strategy, the compiled collectives by op (stacked) beside the course's and jaxpar's formulas."""
    rows = [r for r in result["rows"].values() if r["label"] != "single device"]
    ops = sorted({op for r in rows for op in r["by_op"]})
    unit, scale = byte_unit([r[k] for r in rows for k in ("compiled_bytes", "course_bytes", "written_bytes")])
    fig = figure(10, 5.6)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.27
    bottom = np.zeros(len(rows))
    for op in ops:
        vals = np.array([r["by_op"].get(op, {}).get("bytes", 0.0) for r in rows]) / scale
        ax.bar(x - w, vals, w, bottom=bottom, label=f"compiled: {op}")
        bottom += vals
    ax.bar(x, np.array([r["course_bytes"] for r in rows]) / scale, w, color="0.75", hatch="..", edgecolor="0.3",
           label="course formula: 2Ψ (DDP, ZeRO-1/2), 3Ψ (ZeRO-3, FSDP)")
    ax.bar(x + w, np.array([r["written_bytes"] for r in rows]) / scale, w, color="0.4",
           label="formula for jaxpar's code as written")
    _strategy_ticks(ax, rows)
    ax.set(ylabel=f"{unit} sent per device per step",
           title="Collectives per step: compiled (left) vs the formulas (middle, right)")
    legend_below(ax, ncols=2, gap=0.2)
    return save(fig, path)


REMAT_MEANING = {"none": "keeps every activation", "full": "recomputes the whole layer",
                 "dots": "keeps matmul outputs", "names": "keeps the named tensors"}


@styled
def plot_remat(result: dict, path: Path):
    """Each remat policy (what jax.checkpoint keeps for the backward pass) as a point: time vs temp."""
    unit, scale = byte_unit([r["temp"] for r in result["rows"].values()])
    fig = figure(8, 5.5)
    ax = fig.add_subplot()
    for (policy, r), marker in zip(result["rows"].items(), "osD^v"):
        ax.scatter(r["step_ms"], r["temp"] / scale, s=90, marker=marker,
                   label=f"{policy}: {REMAT_MEANING.get(policy, '')}")
    ax.margins(0.15)
    legend_below(ax, ncols=2, gap=0.18)
    ax.set(xlabel="step time, median (ms, measured)", ylabel=f"temp per device ({unit}, compiled)",
           title="Activation checkpointing (remat policy): memory vs time")
    return save(fig, path)


def plot_precision(result: dict, path: Path):
    runs = result["runs"]
    ref = runs["float32"]["label"] if "float32" in runs else None
    return report.plot_equivalence(path, [(r["label"], r["losses"], None if r["label"] == ref else ref)
                                          for r in runs.values()], None,
                                   title="Compute dtypes on the same batches: loss and deviation from fp32",
                                   reference="reference")


PLOTS = {"equivalence.png": ("equivalence", report.plot_single_device_equivalence),
         "memory.png": ("memory", plot_memory),
         "communication.png": ("communication", plot_communication), "remat.png": ("remat", plot_remat),
         "precision.png": ("precision", plot_precision)}

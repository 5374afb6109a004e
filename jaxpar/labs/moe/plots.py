"""Lab 07 (MoE)'s figures, drawn from results.json (`python -m jaxpar.labs.replot moe RUN_DIR`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs.base import report
from jaxpar.units import byte_unit


def plot_equivalence(result: dict, path: Path):
    """Each dispatch against its own single-device oracle."""
    return report.plot_equivalence(path, [(label, r["losses"], None if "single" in label else
                                           label.split(":")[0] + ": single device")
                                          for label, r in result["runs"].items()], result["tolerance"])


def _wrapped(labels, width: int = 15) -> list[str]:
    import textwrap
    return ["\n".join(textwrap.wrap(label, width)) for label in labels]


@styled
def plot_communication(result: dict, path: Path):
    """Per strategy: compiled all_to_all, the course's formula, jaxpar's buffers (manual EP only) and every
    compiled collective over `expert`; log scale."""
    from matplotlib.transforms import blended_transform_factory
    rows = result["rows"]
    every = [sum(o["bytes"] for o in r["by_op_expert_axes"].values()) for r in rows.values()]
    unit, scale = byte_unit([*every, *(r["formula"] for r in rows.values())])
    fig = figure(10, 6.4)
    ax = fig.add_subplot()
    x, w = np.arange(len(rows)), 0.2
    ax.bar(x - 1.5 * w, [r["all_to_all"] / scale for r in rows.values()], w, label="compiled all_to_all")
    ax.bar(x - 0.5 * w, [r["formula"] / scale for r in rows.values()], w, color="0.75", hatch="..", edgecolor="0.3",
           label="course formula 2·T·k·h·4 B x 2 (fwd + bwd):\nT tokens per device, k experts per token, h = d_model")
    ax.bar(x + 0.5 * w, [(r["predicted"] if r["manual"] else 0) / scale for r in rows.values()], w, color="0.35",
           label="jaxpar's buffers, manual EP (dryrun)")
    ax.bar(x + 1.5 * w, np.array(every) / scale, w, color="#c44e52", label="every compiled collective over `expert`")
    at_bottom = blended_transform_factory(ax.transData, ax.transAxes)
    for i, r in enumerate(rows.values()):
        if not r["manual"]:
            ax.text(x[i] + 0.5 * w, 0.02, "no formula: XLA's buffers", rotation=90, ha="center", va="bottom",
                    transform=at_bottom)
    ax.set_yscale("log")
    ax.set_xticks(x, _wrapped(rows))
    ax.set(ylabel=f"{unit} per device per step (log)", title="Expert-parallel all_to_all per step: compiled vs formula")
    legend_below(ax, ncols=2, gap=0.3)
    return save(fig, path)


@styled
def plot_balance(result: dict, path: Path):
    fig = figure(10, 5.2)
    cv, dropped = fig.subplots(1, 2)
    for method, r in result["runs"].items():
        steps = np.arange(1, len(r["cv"]) + 1)
        cv.plot(steps, np.mean(r["cv"], axis=1), lw=1.5, label=method)
        dropped.plot(steps, np.mean(r["dropped"], axis=1), lw=1.5, label=method)
    cv.set(xlabel="step", ylabel="CV of expert load (0 = balanced)", title="load imbalance")
    report.integer_steps(cv, dropped)
    dropped.set(xlabel="step", ylabel="fraction of assignments dropped", title="dropped at capacity factor 1.25")
    handles, labels = cv.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), title="balancing method")
    fig.suptitle("Load balance (CV = std / mean of each expert's share, mean over layers)")
    return save(fig, path)


@styled
def plot_heatmaps(result: dict, path: Path):
    methods = list(result["runs"])
    layers = np.asarray(result["runs"][methods[0]]["routed"]).shape[1]
    fig = figure(10, 1.8 * layers + 1.6)
    top = max(float(np.max(r["routed"])) for r in result["runs"].values())
    axes = np.asarray(fig.subplots(layers, len(methods), sharex=True, sharey=True, squeeze=False))
    image = None
    for col, method in enumerate(methods):
        load = np.asarray(result["runs"][method]["routed"])              # [steps, layers, experts]
        for layer in range(layers):
            ax = axes[layer, col]
            image = ax.imshow(load[:, layer, :].T, aspect="auto", cmap="viridis", vmin=0, vmax=top,
                              interpolation="nearest")
            ax.grid(False)
            ax.set_title(method if layer == 0 else "")
            if col == 0:
                ax.set_ylabel(f"layer {layer}\nexpert")
            if layer == layers - 1:
                ax.set_xlabel("step")
    fig.colorbar(image, ax=axes, shrink=0.8, label="share of the layer's assignments")
    fig.suptitle("Expert load over training, per balancing method (capacity factor 1.25)")
    return save(fig, path)


@styled
def plot_capacity(result: dict, path: Path):
    rows = result["rows"]
    fig = figure(10, 4.8)
    drop, t = fig.subplots(1, 2)
    labels = _wrapped(rows, 10)
    bars = drop.bar(labels, [r["dropped_mean"] for r in rows.values()], color="#dd8452")
    drop.bar_label(bars, [f"{r['dropped_mean']:.3f}" if r["dropped_mean"] else "0\n(drops none)"
                          for r in rows.values()], padding=2)
    bars = t.bar(labels, [r["step_ms"] for r in rows.values()], color="#4c72b0")
    t.bar_label(bars, [f"{r['step_ms']:.0f}" for r in rows.values()], padding=2)
    drop.margins(y=0.12)
    t.margins(y=0.12)
    drop.set(ylabel="fraction of assignments dropped", title="dropped (mean over steps, layers)")
    t.set(ylabel="step time, median (ms, measured)", title="step time")
    fig.suptitle("Capacity factor: each expert takes factor x its even share of a group's tokens")
    return save(fig, path)


@styled
def plot_moe_vs_dense(result: dict, path: Path):
    fig = figure(8, 5.2)
    ax = fig.add_subplot()
    for label, r in result["runs"].items():
        ax.plot(np.arange(1, len(r["ce"]) + 1), r["ce"], lw=1.5,
                label=f"{label}: validation CE after training {r['val_loss']:.3f}")
    ax.set(xlabel="step", ylabel="training cross-entropy", title="MoE vs dense, the same active FLOPs per token")
    report.integer_steps(ax)
    legend_below(ax, gap=0.16)
    return save(fig, path)


PLOTS = {"equivalence.png": ("equivalence", plot_equivalence),
         "communication.png": ("communication", plot_communication),
         "balance.png": ("balance", plot_balance), "balance_heatmaps.png": ("balance", plot_heatmaps),
         "capacity.png": ("capacity", plot_capacity), "moe_vs_dense.png": ("moe_vs_dense", plot_moe_vs_dense)}

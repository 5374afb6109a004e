"""Lab 04 (pipeline)'s figures, drawn from results.json (`python -m jaxpar.labs.replot pipeline RUN_DIR`)."""
from pathlib import Path

import numpy as np

from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs.base.report import integer_steps
from jaxpar.labs.pipeline.build import COLOURS, TABLE_CASES
from jaxpar.parallel.schedules import bubble_fraction, build
from jaxpar.units import byte_unit

KIND_MEANING = {"F": "F: forward", "B": "B: backward (input gradients; all gradients outside ZB-H1)",
                "W": "W: weight gradients (ZB-H1)"}


def _draw(ax, boxes, p, title, x_label):
    for box in boxes:
        ax.broken_barh([(box["x"], box["w"])], (p - 1 - box["stage"] - 0.4, 0.8), color=COLOURS[box["kind"]],
                       edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(p), [f"stage {p - 1 - i}" for i in range(p)])
    ax.grid(False)
    ax.set_title(title)
    ax.set_xlabel(x_label)


@styled
def plot_timeline(result: dict, path: Path):
    """Each schedule's table (left, in ticks) beside what the CPU mesh ran (right, profiler, in ms)."""
    from matplotlib.patches import Patch
    schedules = result["schedules"]
    fig = figure(10, 2.4 * len(schedules) + 1.2)
    for i, (name, r) in enumerate(schedules.items()):
        table = build(name, r["p"], r["m"], r["v"])
        cells = [{"stage": s, "kind": row[s].kind, "x": t, "w": 1} for t, row in enumerate(table.grid)
                 for s in range(r["p"]) if row[s] is not None]
        _draw(fig.add_subplot(len(schedules), 2, 2 * i + 1), cells, r["p"],
              f"{name} table: bubble {r['formula']:.3f} (formula)", "tick" if i == len(schedules) - 1 else "")
        measured = [{**b, "x": b["start_ms"], "w": b["ms"]} for b in r["boxes"]]
        _draw(fig.add_subplot(len(schedules), 2, 2 * i + 2), measured, r["p"],
              f"{name} measured: idle share {r['measured_idle']:.3f}", "ms" if i == len(schedules) - 1 else "")
    kinds = sorted({b["kind"] for r in schedules.values() for b in r["boxes"]} | {"F", "B"}, key="FBW".index)
    fig.legend([Patch(color=COLOURS[k]) for k in kinds] + [Patch(facecolor="white", edgecolor="0.5")],
               [KIND_MEANING[k] for k in kinds] + ["blank: idle (the bubble)"], loc="outside lower center", ncols=2)
    fig.suptitle("Pipeline schedules: the table (left) vs the CPU mesh's profile (right)")
    return save(fig, path)


@styled
def plot_tables(result: dict, path: Path):
    fig = figure(8, 5.2)
    ax = fig.add_subplot(1, 1, 1)
    markers = {"gpipe": {"marker": "o", "ms": 14, "mfc": "none", "mew": 2}, "1f1b": {"marker": "o", "ms": 6}}
    for name, v in TABLE_CASES:
        points = [r for r in result["sweep"] if r["schedule"] == name and r["p"] == 4]
        (dots,) = ax.plot([r["m"] for r in points], [r["table"] for r in points], ls="none",
                          **markers.get(name, {"marker": "s"}),
                          label=f"{name}" + (f" v={v}" if v > 1 else "")
                          + (" (overlapping gpipe: the same bubble)" if name == "1f1b" else ""))
        ms = range(4, 17)
        ax.plot(ms, [float(bubble_fraction(name, 4, x, v)) for x in ms], "-", alpha=0.5, color=dots.get_color())
    ax.plot([], [], "ko", label="points: the schedule's table")
    ax.plot([], [], "k-", alpha=0.5, label="lines: the formula")
    ax.set(xlabel="microbatches m (p = 4 stages)", ylabel="bubble fraction (idle share of stage-ticks)",
           title="Bubble of each schedule: tables on their formulas")
    legend_below(ax, ncols=2, gap=0.16)
    integer_steps(ax)
    return save(fig, path)


@styled
def plot_memory(result: dict, path: Path):
    unit, scale = byte_unit([s["temp"] for r in result["schedules"].values() for s in r["series"]])
    fig = figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for name, r in result["schedules"].items():
        ax.plot([s["m"] for s in r["series"]], [s["temp"] / scale for s in r["series"]], "o-",
                label=name + (f" v={r['v']}" if r.get("v", 1) > 1 else ""))
    ax.set(xlabel="microbatches m (fixed microbatch size)", ylabel=f"compiled temp per stage ({unit})",
           title="Activation memory vs m: 1F1B stays flat, GPipe grows")
    legend_below(ax, ncols=4, gap=0.16)
    return save(fig, path)


@styled
def plot_bytes(result: dict, path: Path):
    rows = result["schedules"]
    names = list(rows)
    unit, scale = byte_unit([rows[n][k] for n in names for k in ("formula", "compiled")])
    fig = figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [rows[n]["formula"] / scale for n in names], 0.4, color="0.6", hatch="..", edgecolor="0.3",
           label="formula 2(K-1)·m·b·s·h·e (K = p·v model stages)")
    ax.bar(x + 0.2, [rows[n]["compiled"] / scale for n in names], 0.4, label="compiled permutes (HLO)")
    ax.set_xticks(x, [n + (f" v={rows[n]['v']}" if rows[n].get("v", 1) > 1 else "") for n in names])
    ax.set(ylabel=f"{unit} per step over pipe", title="Point-to-point bytes between stages per step")
    legend_below(ax, gap=0.12)
    return save(fig, path)


PLOTS = {"tables.png": ("tables", plot_tables), "timeline.png": ("timeline", plot_timeline),
         "memory.png": ("memory", plot_memory), "bytes.png": ("p2p", plot_bytes)}


@styled
def plot_pipedream(result: dict, path: Path):
    fig = figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for name, curve in result["losses"].items():
        ax.plot(range(1, len(curve) + 1), curve, "-", label=name)
    ax.set(xlabel="step", ylabel="training loss (cross-entropy, nats)",
           title="PipeDream-2BW (weights one step stale) against synchronous 1F1B")
    legend_below(ax, ncols=2, gap=0.16)
    integer_steps(ax)
    return save(fig, path)


PLOTS["pipedream.png"] = ("pipedream", plot_pipedream)

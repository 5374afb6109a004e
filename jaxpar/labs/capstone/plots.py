"""Lab 10's figures: the ranked plan, memory and step-time breakdowns, the CPU check, tokenizer fertility."""
from __future__ import annotations

from pathlib import Path

from jaxpar.figures import figure, legend_below, save, styled
from jaxpar.labs.capstone.sheet import GB


def plots(p, reality, fert, out: Path, parts: str = "abcdef") -> None:
    """The figures of the parts that ran (they need the plan object, so they are drawn here, not from
    results.json)."""
    if "a" in parts:
        plot_plan(p, out / "plan.png")
        plot_breakdown(p.best.label, p.best.memory.parts(), "GB per device (prediction)", GB, out / "memory.png",
                       limit=p.best.memory.limit)
        plot_breakdown(p.best.label, p.best.time.terms(), "seconds per step (prediction)", 1.0, out / "steptime.png")
    if reality:
        plot_cpu_check(reality, out / "cpu_check.png")
    if fert:
        plot_fertility(fert, out / "fertility.png")


@styled
def plot_plan(p, path: Path):
    top = p.ranked[:10]
    names = sorted({k for r in top for k in r.time.terms()}, key=lambda k: (k != "compute", k))
    fig = figure(10, 6.5)
    ax = fig.add_subplot()
    bottom = [0.0] * len(top)
    for name in names:
        values = [r.time.terms().get(name, 0.0) for r in top]
        ax.barh(range(len(top)), values, left=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_yticks(range(len(top)), [f"#{i} {r.label}" for i, r in enumerate(top, 1)], fontsize=10)
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds per step")
    ax.set_title("The ten best candidates: step time by term (prediction)")
    legend_below(ax, ncols=3, gap=0.12)
    return save(fig, path)


@styled
def plot_breakdown(label: str, parts: dict, unit: str, scale: float, path: Path, limit: float | None = None):
    """One stacked bar of the best plan: its memory parts or its step-time terms."""
    fig = figure(8, 3.4 + 0.3 * ((len(parts) + 2) // 2))
    ax = fig.add_subplot()
    left = 0.0
    for k, v in parts.items():
        ax.barh([0], [v / scale], height=0.6, left=left, label=k)
        left += v / scale
    if limit is not None:
        ax.axvline(limit / scale, color="k", linestyle="--", lw=2.5, label="usable memory per device")
    ax.set_yticks([])
    ax.set_xlabel(unit)
    ax.set_title(f"The chosen plan: {label}")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2)
    return save(fig, path)


@styled
def plot_cpu_check(reality: dict, path: Path):
    rows = reality["rows"]
    fig = figure(10, 5.8)
    ax = fig.add_subplot()
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["predicted_s"] for r in rows], 0.4, color="0.6", hatch="..", edgecolor="0.3",
           label="predicted")
    ax.bar([i + 0.2 for i in x], [r["cpu_s"] for r in rows], 0.4, label="measured (median CPU seconds per core)")
    ax.set_xticks(list(x), [r["strategy"].replace(" ", "\n") + ("\n(calibration)" if r["calibration"] else "")
                            for r in rows], fontsize=10)
    ax.set_ylabel("seconds per step")
    ax.set_title("CPU check: predicted vs measured step time; η is fitted on the calibration strategy")
    ax.title.set_wrap(True)
    legend_below(ax, ncols=2, gap=0.3)
    return save(fig, path)


@styled
def plot_fertility(fert: dict, path: Path):
    from matplotlib.ticker import ScalarFormatter
    fig = figure(7, 4.8)
    ax = fig.add_subplot()
    for normalize, label in ((False, "diacritics kept"), (True, "diacritics stripped")):
        rows = [r for r in fert["rows"] if r["normalize"] == normalize]
        ax.plot([r["vocab_requested"] for r in rows], [r["tokens_per_word"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set(xlabel="BPE vocabulary asked for", ylabel="tokens per word (held-out text)",
           title=f"Tokenizer fertility on '{fert['corpus']}' (measured)")
    legend_below(ax, ncols=2, gap=0.18)
    return save(fig, path)

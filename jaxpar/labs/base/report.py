"""The sheet's pieces every lab shares: markdown tables, the deviation every equivalence part reports, and the
figures' common style and equivalence plot (results.json and the parts runner are in results.py and runner.py)."""
from __future__ import annotations

import itertools
import textwrap

import numpy as np

from jaxpar.figures import figure, legend_below, save, styled


def md_table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` has one letter per column, l or r (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    return "\n".join(["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |",
                      *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)])


def max_rel_dev(got, want) -> float:
    """max |got - want| / |want| elementwise (losses against the oracle's)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want) / np.abs(want)))


# ---------------------------------------------------------------------------- figures

# One style for every lab's figures. Figures are at most 10 inches wide at 100 dpi (1000 px), so a README
# (about 880 px wide) shows 12-point text at about 15 px.
VISIBLE = 0.03      # a gap under 3% of an axis's span hides under a marker at a README's size
ZERO_LINEAR = 1e-9  # deviation axes: symlog, linear below this so that an exact 0 is drawn at 0


def _wrap(text: str, width: int = 44) -> str:
    return "\n".join(textwrap.wrap(text, width))


def _short(label: str, ref: str) -> str:
    """`label` without the part before ': ' that it shares with its reference ('dropless: manual EP' -> 'manual EP')."""
    prefix = ref.split(": ")[0] + ": "
    return label[len(prefix):] if ": " in ref and label.startswith(prefix) else label


def integer_steps(*axes) -> None:
    """Step axes tick at whole steps."""
    from matplotlib.ticker import MaxNLocator
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _groups(items: list[tuple[str, np.ndarray]]) -> list[tuple[list[str], np.ndarray]]:
    """Items whose curves coincide on a log axis (within 1%, or both below ZERO_LINEAR) as one group."""
    groups: list[tuple[list[str], np.ndarray]] = []
    for label, curve in items:
        for names, first in groups:
            if np.allclose(curve, first, rtol=1e-2, atol=ZERO_LINEAR):
                names.append(label)
                break
        else:
            groups.append(([label], curve))
    return groups


@styled
def plot_equivalence(path, runs: list[tuple[str, list[float], str | None]], tolerance: float | None,
                     title: str = "Same batches, same losses? The oracle is the single-device run",
                     reference: str = "oracle"):
    """Same losses? `runs` holds (label, losses, the label of its reference run, or None for a reference:
    the oracle, a single-device run). Left: each reference's loss; a run within VISIBLE of the loss axis's span is
    named in the reference's entry ('overlapping') instead of hiding under it. Right: each run's
    |loss - reference| / reference (symlog, so an exact 0 is at 0), runs with the same deviations as one
    line marked '(overlapping)', and the tolerance."""
    fig = figure(10, 5.6)
    ax, dev = fig.subplots(1, 2)
    losses = {label: np.asarray(values, dtype=np.float64) for label, values, _ in runs}
    followers = {label: ref for label, _, ref in runs if ref is not None}
    gaps = {label: np.abs(losses[label] - losses[ref]) for label, ref in followers.items()}
    span = np.ptp(np.concatenate(list(losses.values()))) or 1.0
    drawn: list[str] = []
    for ref in (label for label, _, r in runs if r is None):
        hidden = [_short(f, ref) for f, r in followers.items() if r == ref and gaps[f].max() < VISIBLE * span]
        text = f"{ref} = the {reference}" + (f"; overlapping it: {', '.join(hidden)}" if hidden else "")
        under = [d for d in drawn if np.max(np.abs(losses[d] - losses[ref])) < VISIBLE * span]
        text += f" (overlapping {', '.join(under)})" if under else ""
        ax.plot(np.arange(1, len(losses[ref]) + 1), losses[ref], marker="o", label=_wrap(text))
        drawn.append(ref)
    for label in (f for f in followers if gaps[f].max() >= VISIBLE * span):
        ax.plot(np.arange(1, len(losses[label]) + 1), losses[label], ls="--", marker="s", label=_wrap(label))
    deviations = {label: gaps[label] / np.abs(losses[ref]) for label, ref in followers.items()}
    ax.set(xlabel="step", ylabel="training loss", title="loss")
    legend_below(ax)
    integer_steps(ax, dev)
    for (names, curve), marker in zip(_groups(list(deviations.items())), itertools.cycle("osD^v<>ph")):
        label = ", ".join(names) + (" (overlapping)" if len(names) > 1 else "")
        dev.plot(np.arange(1, len(curve) + 1), curve, marker=marker, label=_wrap(label))
    top = max([10 * d.max() for d in deviations.values()] + ([10 * tolerance] if tolerance else []) + [1e-6])
    if tolerance:
        dev.axhline(tolerance, color="k", ls=":", label=f"tolerance {tolerance:.0e} (pass bound)".replace("e-0", "e-"))
    dev.set_yscale("symlog", linthresh=ZERO_LINEAR, linscale=0.3)
    dev.set_ylim(bottom=0, top=top)
    dev.set(xlabel="step", ylabel=f"|loss - {reference}| / {reference}", title=f"deviation from the {reference}")
    legend_below(dev)
    fig.suptitle(title)
    rows = max(sum(t.get_text().count("\n") + 1 for t in a.get_legend().get_texts()) for a in (ax, dev))
    fig.set_figheight(4.3 + 0.35 * rows)       # room for the legends' rows under the axes
    return save(fig, path)


def plot_single_device_equivalence(result: dict, path):
    """An equivalence part's figure whose `result["runs"]` ({key: label, losses}) all follow the run keyed "single"
    (the single-device oracle), within `result["tolerance"]`."""
    oracle = result["runs"]["single"]["label"]
    return plot_equivalence(path, [(r["label"], r["losses"], None if key == "single" else oracle)
                                   for key, r in result["runs"].items()], result["tolerance"])

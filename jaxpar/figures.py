"""Figures the way every report draws them: one style, off-screen, at most a README's width.

matplotlib is imported only when a figure is drawn, so importing this costs nothing.
"""
from __future__ import annotations

import functools

STYLE = {"font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12, "xtick.labelsize": 12, "ytick.labelsize": 12,
         "legend.fontsize": 11, "figure.titlesize": 14, "lines.linewidth": 2, "lines.markersize": 7,
         "axes.grid": True, "grid.alpha": 0.3, "savefig.dpi": 100}
MAX_WIDTH = 10


def styled(plot):
    """Decorator for a plot function: it draws under STYLE (matplotlib reads fonts when text is created)."""
    @functools.wraps(plot)
    def draw(*args, **kwargs):
        import matplotlib
        with matplotlib.rc_context(STYLE):
            return plot(*args, **kwargs)
    return draw


def figure(width: float = 8, height: float = 4.5):
    """A matplotlib Figure drawn off-screen (no display, no global pyplot state), laid out by matplotlib's
    constrained layout so legends placed outside the axes keep their room."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    if width > MAX_WIDTH:
        raise ValueError(f"figure width {width} in: at most {MAX_WIDTH} (README width)")
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig, path):
    """Write `fig` to `path` (STYLE's dpi) and return it (tests read its labels)."""
    fig.savefig(path)
    return fig


def legend_below(ax, ncols: int = 1, gap: float = 0.16):
    """The axes' legend under it (`gap`: the drop below the axes, a fraction of their height), off the data."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -gap), ncols=ncols)

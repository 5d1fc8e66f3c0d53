"""What every chapter's figures share: byte sizes, request colours, log axes in plain numbers."""

from __future__ import annotations

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter, Locator, NullFormatter


GIB = 2**30


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


# Requests 11-20 after tab10's ten: saturated colours tab10 lacks (navy, yellow, teal, maroon,
# lime, dark goldenrod, ...). tab20's light halves were used before, but pale fills read as the
# pool's pale "waste" states and pairs of them blur on a projector. No magenta and no black:
# those mark copied blocks and the budget bar.
_AFTER_TAB10 = ("#000075", "#ffe119", "#469990", "#800000", "#bfef45", "#b8860b", "#4363d8",
                "#e6194b", "#3cb44b", "#f58231")


def _colour(i: int):
    """Twenty distinct saturated colours: tab10's ten, then ten it lacks (chapter 01 shows 16
    requests at once)."""
    i %= 20
    if i < 10:
        return plt.get_cmap("tab10")(i)
    return mcolors.to_rgba(_AFTER_TAB10[i - 10])


def plain_number(v: float) -> str:
    """20, 1,000, 0.5, 0.00005: digits as written by hand, never 5e-05."""
    if v >= 1:
        return f"{v:,.0f}"
    return np.format_float_positional(float(f"{v:.3g}"), trim="-")


class _OneTwoFive(Locator):
    """Ticks at 1, 2, 5, 10, 20, 50, ... inside the visible range, however narrow: LogLocator
    with these subs drops some of them when the range spans less than a decade (an axis from 17
    to 150 showed only 50 and 100)."""

    def __call__(self):
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin, vmax):
        vmin, vmax = sorted((vmin, vmax))
        if vmax <= 0:
            return []
        vmin = max(vmin, vmax * 1e-9)
        ticks = []
        for exponent in range(int(np.floor(np.log10(vmin))), int(np.ceil(np.log10(vmax))) + 1):
            ticks += [m * 10.0**exponent for m in (1, 2, 5)
                      if vmin <= m * 10.0**exponent <= vmax]
        return ticks


def log_axis(axis, base: int = 10, ticks=None) -> None:
    """Put `axis` (ax.xaxis or ax.yaxis) on a log scale labelled in plain numbers: at `ticks`
    when given, else at 1, 2, 5, 10, 20, ... (base 10) or 1, 2, 4, 8, ... (base 2); never
    matplotlib's default 10^n / 2^n, since a reader compares values, not exponents."""
    ax = axis.axes
    (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log", base=base)
    if ticks is not None:
        axis.set_ticks(ticks, [plain_number(t) for t in ticks])
    elif base == 10:
        axis.set_major_locator(_OneTwoFive())
    if ticks is None:
        axis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    axis.set_minor_formatter(NullFormatter())


def _log2_axes(ax, xlabel: str, ylabel: str, ticks=None, legend_size: int = 8,
               legend: dict | None = None) -> None:
    """A log2 x axis (ticks at `ticks`, written as plain numbers), labels, legend and grid.
    `legend`: where to put the legend (matplotlib's legend keywords); default "best"."""
    log_axis(ax.xaxis, base=2, ticks=ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    # Long handles, so that a dashed series shows its dashes in the legend as on the plot.
    ax.legend(fontsize=legend_size, handlelength=3, **(legend or {}))
    ax.grid(alpha=0.3)

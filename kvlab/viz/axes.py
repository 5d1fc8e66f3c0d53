"""What every chapter's figures share: byte sizes, request colours, log axes in plain numbers."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter


GIB = 2**30


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _colour(i: int):
    """Twenty distinct colours: tab10's ten (tab20's dark halves), then their light halves, so
    the first ten are tab10's and requests 11-20 do not repeat them (chapter 01 shows 16)."""
    return plt.get_cmap("tab20")((2 * i + (i // 10) % 2) % 20)


def plain_number(v: float) -> str:
    """20, 1,000, 0.5, 0.00005: digits as written by hand, never 5e-05."""
    if v >= 1:
        return f"{v:,.0f}"
    return np.format_float_positional(float(f"{v:.3g}"), trim="-")


def log_axis(axis, base: int = 10, ticks=None) -> None:
    """Put `axis` (ax.xaxis or ax.yaxis) on a log scale labelled in plain numbers: at `ticks`
    when given, else at 1, 2, 5, 10, 20, ... (base 10) or 1, 2, 4, 8, ... (base 2); never
    matplotlib's default 10^n / 2^n, since a reader compares values, not exponents."""
    ax = axis.axes
    (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log", base=base)
    if ticks is not None:
        axis.set_ticks(ticks, [plain_number(t) for t in ticks])
    elif base == 10:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
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
    ax.legend(fontsize=legend_size, **(legend or {}))
    ax.grid(alpha=0.3)

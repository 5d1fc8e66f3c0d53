"""Chapter 10's figures: a second tier's hit rate and TTFT by its size, loading against
recomputing by prompt length, and the timeline of one engine against a prefill-decode pair."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from kvlab.workbook.viz.axes import log_axis

TIER_COLOUR = "#2ca02c"  # green: the tier
POOL_COLOUR = "#1f77b4"  # blue: the pool alone / recompute
PAIR_COLOUR = "#d62728"  # red: the pair


def plot_tier_sweep(rows: list[dict], doc_blocks: int):
    """`kvlab.bench.offload.tier_size_sweep`'s rows: the share of the repeat rounds' prompt
    tokens found (pool and tier) against the most they could find, and their median TTFT, by
    the tier's size in blocks."""
    x = [r["tier_blocks"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.plot(x, [100 * r["hit_rate"] for r in rows], "o-", color=TIER_COLOUR, lw=2,
           label="found (pool + tier)")
    a.axhline(100 * rows[0]["ceiling"], color="0.4", ls="--", lw=1.5,
              label="the most there is to find (documents' full blocks)")
    a.set_ylabel("repeat rounds' prompt tokens (%)")
    a.set_ylim(0, 100)
    b.plot(x, [r["median_ttft_ms"] for r in rows], "o-", color=TIER_COLOUR, lw=2,
           label="median TTFT, repeat rounds")
    b.set_ylabel("TTFT (ms)")
    b.set_ylim(bottom=0)
    for ax in (a, b):
        ax.set_xlabel(f"tier size (blocks; a document is {doc_blocks})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    a.legend(loc="center left", fontsize=10, frameon=False)
    b.legend(loc="upper right", fontsize=10, frameon=False)
    fig.tight_layout()
    return fig


def plot_load_vs_recompute(rows: list[dict]):
    """`kvlab.bench.offload.load_vs_recompute`'s rows: TTFT by prompt length."""
    x = [r["prompt_len"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.plot(x, [r["recompute_ttft_ms"] for r in rows], "o-", color=POOL_COLOUR, lw=2,
            label="computed from nothing")
    ax.plot(x, [r["load_ttft_ms"] for r in rows], "s-", color=TIER_COLOUR, lw=2,
            label="loaded from the tier, last token computed")
    log_axis(ax.xaxis, 2, x)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=10, frameon=False)
    fig.tight_layout()
    return fig


def plot_pair_timeline(result: dict):
    """`kvlab.bench.disagg.disaggregated_pair`'s result: per request, a line from its arrival
    to its first token, then a tick per token; one engine above, the pair below, each from its
    first request's arrival (the two runs had the same arrival offsets)."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
    for ax, key, title, colour in ((axes[0], "one_engine", "one engine, 2 cores", POOL_COLOUR),
                                   (axes[1], "pair", "prefill engine + decode engine, 1 core "
                                    "each", PAIR_COLOUR)):
        run = result[key]
        t0 = min(run["arrivals"])
        for i, (arrival, times) in enumerate(zip(run["arrivals"], run["token_times"])):
            ax.plot([arrival - t0, times[0] - t0], [i, i], color="0.6", lw=2,
                    label="waiting for its first token" if i == 0 else None)
            ax.plot([t - t0 for t in times], [i] * len(times), "|", color=colour, ms=9,
                    label="a token" if i == 0 else None)
        ax.set_title(title, fontsize=11, loc="left")
        ax.set_ylabel("request")
        ax.invert_yaxis()
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, axis="x")
    axes[0].legend(loc="upper right", fontsize=10, frameon=False)
    axes[1].set_xlabel("seconds since the first request arrived")
    fig.tight_layout()
    return fig


def format_pair(result: dict) -> str:
    """The pair against one engine: median TTFT, median and p99 gap between tokens."""
    head = f"{'':34} {'TTFT median':>12} {'gap median':>11} {'gap p99':>9}"
    lines = [head]
    for key, name in (("one_engine", "one engine (2 cores)"),
                      ("pair", "prefill + decode engines (1 each)")):
        lines.append(f"{name:34} {result['median_ttft_ms'][key]:>9.0f} ms "
                     f"{result['median_gap_ms'][key]:>8.0f} ms {result['p99_gap_ms'][key]:>6.0f} ms")
    return "\n".join(lines)

"""Chapter 07 and the benchmarks: kvlab beside its peers, the roofline sweep, the API run."""

from __future__ import annotations

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from kvlab.workbook.viz.axes import _colour, _log2_axes

# Every label on these figures is read from the back of a room: none under this size (points).
LABEL_PT = 10


def _ink(face) -> str:
    """Black or white, whichever reads better on a bar of colour `face` (WCAG's relative
    luminance: white text only on dark bars)."""
    def lin(c):
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in mcolors.to_rgb(face))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    # Contrast with white (1.05 / (L + 0.05)) against contrast with black ((L + 0.05) / 0.05).
    return "white" if 1.05 / (luminance + 0.05) > (luminance + 0.05) / 0.05 else "black"


def plot_peers(peers: dict, ceiling: dict):
    """Left: useful output tokens/s of kvlab and its peers on one workload (compare_peers), the
    median of its runs, a whisker from the slowest run's rate to the fastest's where it has
    more than one. Right: kvlab's decode rate at the ceiling's batch against this machine's two limits
    (ceiling_fraction): the arithmetic at the fastest matmul measured and the bytes at the
    bandwidth."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.4), width_ratios=(3, 2))
    names = list(peers["rows"])
    rates = [peers["rows"][n]["useful_tok_s"] for n in names]
    spreads = [peers["rows"][n].get("useful_tok_s_spread") or [r, r] for n, r in zip(names, rates)]
    xerr = [[r - lo for r, (lo, _) in zip(rates, spreads)],
            [hi - r for r, (_, hi) in zip(rates, spreads)]]
    ax1.barh(names, rates, color=[_colour(i) for i in range(len(names))], xerr=xerr, capsize=4)
    # Each value right of its whisker's end, so no label sits on a whisker.
    for y, (r, (_, hi)) in enumerate(zip(rates, spreads)):
        ax1.annotate(f"{r:.0f}", (max(r, hi), y), xytext=(4, 0), textcoords="offset points",
                     va="center", fontsize=LABEL_PT)
    ax1.set_xlim(0, 1.2 * max(max(hi for _, hi in spreads), max(rates)))
    ax1.invert_yaxis()
    ax1.tick_params(labelsize=LABEL_PT)
    runs = peers.get("repeats", 1)
    ax1.set_xlabel("useful output tokens/s" + (f" (median of {runs} runs, whisker min-max)"
                                               if runs > 1 else ""), fontsize=LABEL_PT)
    # Two lines each: the titles of the two panels must not run into each other.
    ax1.set_title(f"each makes the same {peers['useful_tokens']} tokens\n(same prompts, same "
                  "weights)", fontsize=LABEL_PT)
    c = ceiling["ceiling"]
    labels = ["arithmetic\nlimit", "memory\nlimit", "kvlab"]
    values = [c["compute_bound_tok_s"], c["memory_bound_tok_s"], ceiling["kvlab_decode_tok_s"]]
    bars = ax2.bar(labels, values, color=["0.75", "0.6", _colour(0)])
    ax2.bar_label(bars, fmt="%.0f", fontsize=LABEL_PT)
    ax2.margins(y=0.12)  # the tallest bar's label inside the frame
    ax2.tick_params(labelsize=LABEL_PT)
    ax2.set_ylabel("decode tokens/s", fontsize=LABEL_PT)
    ax2.set_title(f"one decode step, batch {c['batch']}, context {c['context']}:\nkvlab at "
                  f"{ceiling['fraction_of_ceiling']:.0%} of the lower limit", fontsize=LABEL_PT)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="x" if ax is ax1 else "y")
    fig.tight_layout()
    return fig


def plot_serve_peers(rows: list[dict]):
    """Two servers through one streaming client (kvlab.bench.online_peers, notebook 07): output
    tokens/s, TTFT and ITL by concurrency, bars grouped by concurrency, one colour per server.
    Latency bars are medians, their whiskers reach the p90."""
    servers = list(dict.fromkeys(r["server"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["server"], r["concurrency"]): r for r in rows}
    width = 0.8 / max(len(servers), 1)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = (("output_tok_s", None, "output tokens/s"),
              ("ttft_median_ms", "ttft_p90_ms", "TTFT (ms)"),
              ("itl_median_ms", "itl_p90_ms", "ITL (ms)"))
    for ax, (key, p90, label) in zip(axes, panels):
        for i, name in enumerate(servers):
            here = [j for j, c in enumerate(levels)
                    if (name, c) in by and by[(name, c)][key] is not None]
            xs = [j + (i - (len(servers) - 1) / 2) * width for j in here]
            pts = [by[(name, levels[j])] for j in here]
            values = [r[key] for r in pts]
            yerr = None if p90 is None else [[0] * len(pts), [r[p90] - r[key] for r in pts]]
            bars = ax.bar(xs, values, width, yerr=yerr, capsize=3, color=_colour(i), label=name)
            # Inside the bar (the whisker leaves its top), in the ink that reads on its colour.
            ax.bar_label(bars, fmt="%.0f", fontsize=LABEL_PT, label_type="center",
                         color=_ink(_colour(i)))
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.tick_params(labelsize=LABEL_PT)
        ax.set_xlabel("concurrency", fontsize=LABEL_PT)
        ax.set_ylabel(label if p90 is None else f"{label}: median, whisker p90",
                      fontsize=LABEL_PT)
        ax.grid(alpha=0.3, axis="y")
    # Headroom above the tallest bar, so the legend (upper left) covers none at this type size.
    top = max((r["output_tok_s"] for r in rows if r["output_tok_s"] is not None), default=1)
    axes[0].set_ylim(0, 1.45 * top)
    axes[0].legend(fontsize=LABEL_PT, loc="upper left")
    fig.tight_layout()
    return fig


def plot_roofline_sweep(results: dict):
    """Decode throughput by batch against this machine's ceilings (notebook 07, `python -m
    kvlab.bench roofline`).

    `results` is `kvlab.bench.roofline.roofline(...)`'s output. Left: decode tokens/s at the
    sweep's context by running batch, with the two ceilings measured in the same run (arithmetic
    at torch.mm's rate or at the fastest matmul, weights and K/V read once at the copy
    bandwidth), and the other contexts measured as single points. Right: each batch's step as a
    share of each ceiling."""
    ctx = results["context"]
    rows = sorted((r for r in results["rows"] if abs(r["context"] - ctx) <= 8),
                  key=lambda r: r["batch"])
    others = [r for r in results["rows"] if abs(r["context"] - ctx) > 8]
    batches = [r["batch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    ax1.plot(batches, [r["tok_s"] for r in rows], "o-", color=_colour(0),
             label=f"kvlab, context {ctx}")
    # Where torch.mm was itself the fastest matmul, the two ceilings are one: draw it once and
    # say so, rather than a dotted line hidden under a dashed one.
    same = all(abs(r["ceiling_ms_mm"] - r["ceiling_ms_peak"]) <= 1e-3 * r["ceiling_ms_mm"]
               for r in rows)
    # (key, line style, the line's name, the bars' name)
    ceilings = ((("peak", "--", "torch.mm, the fastest matmul here",
                  "of the ceiling (torch.mm, the fastest matmul here)"),) if same else
                (("mm", "--", "torch.mm rate", "of ceiling (torch.mm rate)"),
                 ("peak", ":", "fastest matmul", "of ceiling (fastest matmul)")))
    for key, style, name, _ in ceilings:
        ax1.plot(batches, [1000 * r["batch"] / r[f"ceiling_ms_{key}"] for r in rows], style,
                 color="k", label=f"ceiling ({name})")
    for i, c in enumerate(sorted({r["context"] for r in others})):
        pts = [r for r in others if r["context"] == c]
        ax1.plot([r["batch"] for r in pts], [r["tok_s"] for r in pts], "s", ms=5,
                 color=_colour(i + 1), label=f"kvlab, context {c}")
    _log2_axes(ax1, "running requests (decode batch)", "decode tokens/s", ticks=batches,
               legend_size=LABEL_PT - 1)
    width = 0.8 / len(ceilings)
    for i, (key, _, _, name) in enumerate(ceilings):
        xs = [j + (i - (len(ceilings) - 1) / 2) * width for j in range(len(rows))]
        bars = ax2.bar(xs, [100 * r[f"fraction_{key}"] for r in rows], width,
                       color=_colour(i), label=name)
        # Each bar names the bound that sets its ceiling (memory or compute), as the sweep prints.
        ax2.bar_label(bars, [f"{100 * r[f'fraction_{key}']:.0f}%"
                             + (f"\n{r[f'bound_{key}']}" if r.get(f"bound_{key}") else "")
                             for r in rows], fontsize=LABEL_PT - 1)
    ax2.set_xticks(range(len(rows)), [str(b) for b in batches])
    ax2.set_xlabel(f"running requests (context {ctx})")
    # Headroom above the tallest bar's label, so the legend (top) covers no label.
    ax2.set_ylim(0, 1.6 * max(100 * r["fraction_mm"] for r in rows))
    if len(ceilings) == 1:  # one series: its name is the axis's, a legend would repeat it
        which = ceilings[0][3].removeprefix("of the ceiling ")
        ax2.set_ylabel(f"share of the ceiling (%)\n{which}")
    else:
        ax2.set_ylabel("share of the ceiling (%)")
        ax2.legend(fontsize=LABEL_PT - 1, loc="upper center", ncol=2)
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _short_salt(salt) -> str:
    """'tenant-a' -> 'a': the salt table's salts fit under narrow bars; others stay as they are."""
    salt = str(salt)
    return salt.removeprefix("tenant-")


def plot_api_run(results: dict):
    """The experiments through the API (`kvlab.bench.api_experiments.run_api_experiments`, notebook 07):
    tokens/s and TTFT by concurrency (chapter 03), cold / warm / after-reset TTFT (05) and the
    salt table's TTFT (06), each panel only where the run measured it."""
    panels = [p for p in ("concurrency", "prefix-cache", "cache-salt") if results.get(p)]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(3.8 * max(len(panels), 1), 3.4),
                             squeeze=False)
    for ax, name in zip(axes[0], panels):
        rows = [r for r in results[name] if r.get("result") != "not measurable"]
        if name == "concurrency":
            levels = [str(r["concurrency"]) for r in rows]
            bars = ax.bar(levels, [r["tok_s"] for r in rows], color="0.8")
            # Inside each bar, at its foot: the TTFT line crosses the bars' tops, never their feet
            # (its lowest point is the smallest concurrency's TTFT, well above the axis).
            top = 1.2 * max(r["tok_s"] for r in rows)
            for bar, r in zip(bars, rows):
                ax.text(bar.get_x() + bar.get_width() / 2, 0.03 * top, f"{r['tok_s']:.1f} tok/s",
                        ha="center", va="bottom", fontsize=LABEL_PT - 1, color=_ink("0.8"))
            ax.set_xlabel("concurrency (2c requests, closed loop)")
            ax.set_ylabel("output tokens/s")
            twin = ax.twinx()
            ttfts = [r["ttft_median_ms"] for r in rows]
            twin.plot(levels, ttfts, "o-", color="black")
            for x, y in zip(levels, ttfts):
                # Above the point: the line leaves each point to the right, below would touch it.
                twin.annotate(f"{y:,.0f} ms", (x, y), xytext=(0, 7), textcoords="offset points",
                              fontsize=LABEL_PT - 1, color="black", va="bottom", ha="center")
            twin.set_ylabel("TTFT median (ms)", color="black")
            twin.set_ylim(0, 1.2 * max(ttfts))  # no point on the frame
            ax.set_ylim(0, top)
            ax.set_title("bars: tokens/s; line: TTFT", fontsize=9)
        elif name == "prefix-cache":
            r = rows[0]
            keys = [("cold", "cold_ttft_ms"), ("warm", "warm_ttft_ms"),
                    ("after reset", "after_reset_ttft_ms")]
            keys = [(label, k) for label, k in keys if r.get(k) is not None]
            # One meaning per colour across the panels: blue = nothing cached (cold), orange =
            # cached blocks found; after the reset it is cold again, hatched to tell it apart.
            bars = ax.bar([label for label, _ in keys], [r[k] for _, k in keys],
                          color=[_colour(1) if label == "warm" else _colour(0)
                                 for label, _ in keys],
                          hatch=["//" if label == "after reset" else "" for label, _ in keys])
            ax.bar_label(bars, fmt="%.0f", fontsize=LABEL_PT - 1)
            ax.set_ylabel("TTFT (ms)")
            ax.set_title(f"shared prefix, {r['prompt_tokens']}-token prompts", fontsize=9)
            ax.margins(y=0.12)  # the tallest bar's label inside the frame
            if any(label == "after reset" for label, _ in keys):
                ax.legend(handles=[Patch(fc=_colour(0), hatch="//",
                                         label="same prompt after\nreset_prefix_cache")],
                          fontsize=LABEL_PT - 1, loc="upper center")  # two lines: it fits
                ax.set_ylim(0, 1.45 * max(r[k] for _, k in keys))
        else:
            table = [r for r in rows if r.get("experiment") == "salt table" and "order" in r]
            # One label per request on two lines (its place, its salt): side by side they overlap.
            # Short labels: the salts' names side by side ran into each other.
            bars = ax.bar([f"{r['order']}\n{_short_salt(r['cache_salt'])}" for r in table],
                          [r["ttft_ms"] for r in table],
                          color=[_colour(1) if r["cached_tokens"] else _colour(0) for r in table])
            ax.bar_label(bars, fmt="%.0f", fontsize=LABEL_PT - 1)
            ax.set_ylabel("TTFT (ms)")
            ax.set_xlabel("request order, cache_salt", fontsize=LABEL_PT - 1)
            ax.set_title("one document, in order, by cache_salt", fontsize=9)
            # One entry a line: side by side, at this type size, they overrun the panel.
            ax.legend(handles=[Patch(color=_colour(1), label="found cached blocks"),
                               Patch(color=_colour(0), label="none cached")],
                      fontsize=LABEL_PT - 1, loc="upper center")
            ax.set_ylim(0, 1.55 * max(r["ttft_ms"] for r in table))
            ax.tick_params(axis="x", labelsize=LABEL_PT - 1)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig

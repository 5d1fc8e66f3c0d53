"""Chapters 00-02: what one token's KV costs, the pool as a grid, the allocator simulation,
the block-size trade-off, and the savings of shared blocks."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from kvlab.kv_cache import NULL_BLOCK_OWNER
from kvlab.workbook.allocator_sim import SimResult, block_table_entries, internal_waste
from kvlab.workbook.viz.axes import GIB, _colour, _log2_axes, log_axis

EXTERNAL = "0.82"  # a free block no one can be given: grey, no request's colour


def plot_kv_memory(bytes_per_token: int, seq_lens, batch_sizes, budget_bytes: float | None = None,
                   title: str = "KV cache memory"):
    """KV bytes for batch_size requests of seq_len tokens each: it grows as the product."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for b in batch_sizes:
        ax.plot(seq_lens, [b * s * bytes_per_token / GIB for s in seq_lens], marker="o", ms=3,
                label=f"batch {b}")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / GIB, color="k", ls="--", lw=1,
                   label=f"KV budget ({budget_bytes / GIB:,.3g} GiB)")
    # Both axes on a log scale: batch 1 and batch 64 differ 64-fold, so on a linear axis the
    # small batches lie on zero. Equal steps up the page are equal factors of memory.
    log_axis(ax.xaxis, base=2, ticks=list(seq_lens))
    log_axis(ax.yaxis)
    ax.set_xlabel("tokens per request (prompt + output)")
    ax.set_ylabel("KV cache (GiB, log scale)")
    ax.set_title(f"{title}: {bytes_per_token:,} bytes/token")
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3, which="major")
    fig.tight_layout()
    return fig


def plot_no_cache(runs: dict, prompt_len: int):
    """Milliseconds per generated token, without a KV cache and with one (chapter 00)."""
    import statistics

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    styles = {"no cache": ("tab:red", "every token recomputes the whole sequence"),
              "KV cache": ("tab:blue", "every token computes itself only")}
    series = {name: [1000 * s for s in run["seconds"]] for name, run in runs.items()}
    # The axis stops at twice the slowest run's median of its last tokens: one pause of the
    # machine (a token taking seconds) would otherwise flatten the growth the figure is for.
    top = 2 * max(statistics.median(ms[-8:]) for ms in series.values())
    off_scale = []
    for name, ms in series.items():
        colour, what = styles.get(name, (None, name))
        xs = list(range(1, len(ms) + 1))
        # Token 1 is the prefill (the whole prompt) in both runs: drawn as a dot, not the line.
        ax.plot(xs[1:], [min(m, top) for m in ms[1:]], color=colour, lw=1.2,
                label=f"{name}: {what}")
        ax.plot([1], [min(ms[0], top)], "o", color=colour, ms=4)
        off_scale += [(x, m, colour) for x, m in zip(xs, ms) if m > top]
    for x, m, colour in off_scale:
        ax.annotate(f"{m:,.0f} ms", (x, top), xytext=(0, -10), textcoords="offset points",
                    ha="center", va="top", fontsize=9, color=colour)
    ax.set_xlabel(f"generated token (after a {prompt_len}-token prompt; dot: the prefill)")
    ax.set_ylabel("ms for this token")
    ax.set_ylim(0, top * 1.02)
    ax.set_title("Time per new token, without and with a KV cache"
                 + (" (tokens above the top: their ms written)" if off_scale else ""), fontsize=10)
    ax.legend(fontsize=9, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def draw_memory_map(memory_map: list[tuple[str | None, int, int]], block_size: int, title: str,
                    ax=None, columns: int = 32, state_legend: bool = True,
                    unusable_free=frozenset()):
    """The physical pool as a grid of blocks, one square per block: colour = owner (up to 20
    distinct), solid = slots holding tokens, hatched = slots reserved for tokens still to come,
    pale and dotted = slots held that will never hold a token (internal waste), white = free,
    grey = free but in a gap too short for anyone (`unusable_free`: external fragmentation).
    Block 0, vLLM's null block (never handed out), is drawn black in a row of its own above the
    grid and labelled, so every row of the grid starts at a block boundary a reader can count
    from: block 1, 1 + columns, ...; each row's first block id is written at its left.
    `memory_map` comes from the manager's `memory_map(num_tokens, final_tokens)`. A legend on
    the right names the requests; with `state_legend`, one below the grid names the states
    (pass False on all but the last of several stacked maps). Every label is 9 pt."""
    memory_map = list(memory_map)
    null = [b for b, (o, *_) in enumerate(memory_map) if o == NULL_BLOCK_OWNER]
    first = 1 if null == [0] else 0  # the grid starts after the null block
    for b in null:  # drawn black, counted with no request
        memory_map[b] = (None, 0, 0)
    owners = [o for o, *_ in memory_map if o is not None]
    order = list(dict.fromkeys(owners))
    grid = len(memory_map) - first
    rows = -(-grid // columns)
    top = rows + (1.2 if first else 0)  # the null block's row, a little apart from the grid
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.3 * top + 1.6))
    side = 0.92
    if first:
        ax.add_patch(Rectangle((0, rows + 0.25), side, side, fc="black", ec="black", lw=0.5))
        ax.text(side + 0.3, rows + 0.25 + side / 2, "block 0: vLLM's null block, never handed out",
                ha="left", va="center", fontsize=9)
    for b in range(first, len(memory_map)):
        owner, filled, reserved = memory_map[b]
        i = b - first
        x, y = i % columns, rows - 1 - i // columns
        if x == 0:
            ax.text(-0.25, y + side / 2, str(b), ha="right", va="center", fontsize=9)
        if b in null:  # a null block past block 0 (none in kvlab): black, in place
            ax.add_patch(Rectangle((x, y), side, side, fc="black", ec="black", lw=0.5))
            continue
        if owner is None:
            unusable = b in unusable_free
            ax.add_patch(Rectangle((x, y), side, side, fc=EXTERNAL if unusable else "white",
                                   ec="0.6" if unusable else "0.75", lw=0.5))
            continue
        c = _colour(order.index(owner))
        # Left to right within the block: tokens, then reserved slots, then internal waste.
        w_fill, w_res = side * filled / block_size, side * reserved / block_size
        ax.add_patch(Rectangle((x, y), w_fill, side, fc=c, ec="none"))
        ax.add_patch(Rectangle((x + w_fill, y), w_res, side, fc=(*c[:3], 0.35), ec="none",
                               hatch="////"))
        ax.add_patch(Rectangle((x + w_fill + w_res, y), side - w_fill - w_res, side,
                               fc=(*c[:3], 0.08), ec="none", hatch=".."))
        ax.add_patch(Rectangle((x, y), side, side, fc="none", ec=c, lw=0.5))  # the block's edge
    ax.set_xlim(-1.4, columns)
    ax.set_ylim(0, top)
    ax.set_aspect("equal")
    ax.axis("off")
    used = sum(f for o, f, _ in memory_map if o is not None)
    held = sum(block_size for o, *_ in memory_map if o is not None)
    total = (len(memory_map) - len(null)) * block_size
    ax.set_title(f"{title}: {len(order)} requests, {used:,} tokens in {held:,} held slots "
                 f"of {total:,}", fontsize=9)
    if state_legend:
        grey = (0.35, 0.35, 0.35)
        states = [Patch(fc=grey, label="tokens"),
                  Patch(fc=(*grey, 0.35), hatch="////", label="reserved: tokens to come"),
                  Patch(fc=(*grey, 0.12), ec=grey, hatch="..",
                        label="internal waste: never filled"),
                  Patch(fc=EXTERNAL, ec="0.6", label="external: free, too short a gap"),
                  Patch(fc="white", ec="0.75", label="free")]
        # The null block is named beside its own square, above the grid: not repeated here.
        legend = ax.legend(handles=states, fontsize=9, loc="upper center",
                           bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False, handlelength=1.5)
        ax.add_artist(legend)
        legend.set_clip_on(False)  # else a saved figure's tight bounding box leaves it out
    handles = [Patch(fc=_colour(i), label=str(o)) for i, o in enumerate(order)]
    if handles:
        ax.legend(handles=handles, fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  ncol=1 + (len(handles) > 8), handlelength=1, columnspacing=0.6,
                  borderaxespad=0.2)
    return ax


def format_block_tables(block_tables: dict[str, list[int]], max_entries: int = 12,
                        ref_cnts: list[int] | None = None) -> str:
    """Each request's block table (logical block -> physical block), one line each; with
    `ref_cnts` (indexed by block id), shared blocks show their count: `5(x3)`."""
    lines = []
    for rid, ids in block_tables.items():
        cells = [f"{b}(x{ref_cnts[b]})" if ref_cnts and ref_cnts[b] > 1 else str(b) for b in ids]
        shown = ", ".join(cells[:max_entries])
        more = f", ... ({len(ids)} blocks)" if len(ids) > max_entries else ""
        lines.append(f"{rid:>10}: [{shown}{more}]")
    return "\n".join(lines)


LAYOUT_COLOURS = {"contiguous": "tab:red", "paged": "tab:blue"}  # one colour per layout
RULE_STYLES = {"vllm": "-", "one-block": "--"}  # the paged admission rule: the line's style


def _sim_label(res: SimResult) -> str:
    return res.layout if res.admission == "vllm" else f"{res.layout}, {res.admission} rule"


def plot_sim(*results: SimResult):
    """Requests running at each step, and the pool's share holding tokens, for every result on
    one step axis, from step 0 until its last request finished (a dotted line, "all done").
    Each layout keeps its colour; a paged run under the too-eager one-block rule is dashed. The
    legend gives each run's mean over its steps and the last step at which requests waited."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.9))
    for n, res in enumerate(results):
        c, ls = LAYOUT_COLOURS.get(res.layout, _colour(n)), RULE_STYLES.get(res.admission, ":")
        steps = list(range(len(res.running_per_step)))
        waits = res.steps
        last = f"; none waits after step {waits[-1]:,}" if waits else "; none waits"
        name = _sim_label(res)
        ax1.plot(steps, res.running_per_step, ls=ls, lw=1.3, color=c,
                 label=f"{name}: whole-run mean {res.mean_running:.1f}{last}")
        ax2.plot(steps, [u * 100 for u in res.utilisation_per_step], ls=ls, lw=1.3, color=c,
                 label=f"{name}: whole-run mean {res.mean_utilisation:.0%}{last}")
        for ax in (ax1, ax2):
            if res.num_steps:
                ax.axvline(res.num_steps, color=c, ls=":", lw=1.2)
                ax.annotate(f"{name}:\nall done, step {res.num_steps:,}", (res.num_steps, 1),
                            xycoords=("data", "axes fraction"), xytext=(-3, -3 - 24 * n),
                            textcoords="offset points", ha="right", va="top", fontsize=9,
                            color=c)
    for ax, ylabel in ((ax1, "requests running"), (ax2, "pool holding tokens (%)")):
        ax.set_xlabel("engine step", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.tick_params(labelsize=9)
        ax.set_xlim(0, max((r.num_steps for r in results), default=1) * 1.02)
        ax.grid(alpha=0.3)
    top = max((r.max_running for r in results), default=1)
    # Headroom above the curves for the "all done" labels, one under the other.
    ax1.set_ylim(0, top * (1.2 + 0.15 * len(results)))
    ax2.set_ylim(0, 100 * (1.2 + 0.15 * len(results)))
    ax2.set_yticks(range(0, 101, 25))
    ax1.legend(fontsize=9, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax2.legend(fontsize=9, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def block_size_summary(lengths: list[int], block_size: int) -> str:
    waste = internal_waste(lengths, block_size)
    entries = block_table_entries(lengths, block_size)
    mean_len = sum(lengths) / len(lengths)
    return (f"block_size={block_size:>3}: internal waste {waste:5.1f} slots/request "
            f"({waste / mean_len:5.1%} of the mean length), block table {entries:6.1f} entries")


def plot_block_size_tradeoff(lengths: list[int], block_size: int,
                             block_sizes=(1, 2, 4, 8, 16, 32, 64, 128)):
    """Internal waste grows with the block size; the block table shrinks. One figure, two axes."""
    sizes = sorted(set(block_sizes) | {block_size})
    waste = [internal_waste(lengths, b) for b in sizes]
    entries = [block_table_entries(lengths, b) for b in sizes]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(sizes, waste, "o-", color="tab:red", label="internal waste (slots/request)")
    log_axis(ax.xaxis, base=2, ticks=sizes)
    ax.set_xlabel("block_size (tokens)")
    ax.set_ylabel("wasted slots per request", color="tab:red")
    ax2 = ax.twinx()
    ax2.plot(sizes, entries, "s-", color="tab:blue", label="block-table entries")
    log_axis(ax2.yaxis)
    ax2.set_ylabel("block-table entries per request", color="tab:blue")
    ax.axvline(block_size, color="k", ls="--", lw=1)
    ax.set_title(block_size_summary(lengths, block_size), fontsize=9)
    fig.tight_layout()
    return fig


def plot_blocks_per_step(series: dict[str, list[int]], title: str = "KV blocks in use"):
    """Blocks in use after each engine step, one line per run; each run has its own colour,
    marker and line style, so runs that coincide for a while stay told apart."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
    for i, (label, blocks) in enumerate(series.items()):
        marker, ls = styles[i % len(styles)]
        # Where runs meet (all end at 0 blocks) one would hide the other: the first is drawn
        # on top with small filled markers, each later one below it with larger hollow ones,
        # so a shared point shows both.
        ax.plot(range(1, len(blocks) + 1), blocks, marker=marker, ls=ls, color=_colour(i),
                ms=4 if i == 0 else 7, mfc=None if i == 0 else "none",
                drawstyle="steps-post", label=f"{label} (peak {max(blocks, default=0)})",
                zorder=2 + len(series) - i)
    ax.set_xlabel("step")
    ax.set_ylabel("blocks in use")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_cow_savings(rows: list[dict]):
    """Share of peak KV memory saved by block sharing, against n or beam width. Colour = prompt
    length; beam search = solid line, large hollow circles; sampling = dashed line, small filled
    squares. Where two series are equal the square sits inside the circle, and the legend says
    "same as ..."."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    keys = sorted({(r["kind"], r["prompt_len"]) for r in rows})
    lens = sorted({L for _, L in keys})
    drawn: dict[tuple, str] = {}
    for kind, prompt_len in keys:
        pts = tuple(sorted((r["k"], r["saved"]) for r in rows
                           if r["kind"] == kind and r["prompt_len"] == prompt_len))
        label = f"{kind}, prompt {prompt_len}"
        same = f" (same as {drawn[pts]})" if pts in drawn else ""
        drawn.setdefault(pts, label)
        c = _colour(lens.index(prompt_len))
        style = (dict(ls="-", marker="o", ms=9, mfc="none", mew=1.5) if kind == "beam" else
                 dict(ls="--", marker="s", ms=4))
        ax.plot([k for k, _ in pts], [100 * v for _, v in pts], color=c, label=label + same,
                **style)
    _log2_axes(ax, "n (sampling) or beam width", "peak KV memory saved (%)",
               ticks=sorted({r["k"] for r in rows}))
    fig.tight_layout()
    return fig


def plot_parallel_sampling(rows: list[dict]):
    """Chapter 02: the paper's fork against vLLM v1's child requests against no sharing, from
    `bench.cow.parallel_sampling_table` rows. One row of panels per prompt length; left the peak
    KV blocks held, right the prompt tokens computed; one group of bars per n, one bar per mode
    (its own colour and hatch), each bar labelled with its value."""
    lens = sorted({r["prompt_len"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["prompt_len"], r["n"], r["mode"]): r for r in rows}
    hatches = ["", "///", ".."]
    fig, axes = plt.subplots(len(lens), 2, figsize=(9, 2.6 * len(lens) + 0.6), squeeze=False)
    width = 0.8 / len(modes)
    for row, prompt_len in enumerate(lens):
        for col, (key, ylabel) in enumerate((("peak_blocks", "peak KV blocks held"),
                                             ("prompt_tokens_computed", "prompt tokens computed"))):
            ax = axes[row][col]
            for m, mode in enumerate(modes):
                xs = [i + (m - (len(modes) - 1) / 2) * width for i in range(len(ns))]
                vals = [by[(prompt_len, n, mode)][key] for n in ns]
                bars = ax.bar(xs, vals, width, color=_colour(m), hatch=hatches[m % 3],
                              ec="white", lw=0.5, label=mode)
                ax.bar_label(bars, fontsize=9, padding=1)
            ax.set_xticks(range(len(ns)), [f"n={n}" for n in ns])
            ax.set_ylabel(ylabel, fontsize=9)
            ax.set_title(f"prompt {prompt_len} tokens", fontsize=9)
            ax.margins(y=0.15)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(modes), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig

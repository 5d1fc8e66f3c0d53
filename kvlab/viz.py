"""Pure functions that return matplotlib figures or text. Widgets (widgets.py) only call these.

Nothing here touches an engine's state: callers pass in numbers or snapshots, so every figure can
be drawn in a test without a browser.
"""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import offset_copy

from kvlab.explorer import CACHED, FREE, HELD, SHARED, EngineSnapshot
from kvlab.kv_cache import ContiguousKVCacheManager
from kvlab.sim import SimResult, block_table_entries, internal_waste

GIB = 2**30


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def plot_kv_memory(bytes_per_token: int, seq_lens, batch_sizes, budget_bytes: float | None = None,
                   title: str = "KV cache memory"):
    """KV bytes for batch_size requests of seq_len tokens each: it grows as the product."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for b in batch_sizes:
        ax.plot(seq_lens, [b * s * bytes_per_token / GIB for s in seq_lens], marker="o", ms=3,
                label=f"batch {b}")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / GIB, color="k", ls="--", lw=1, label="KV budget")
    ax.set_xlabel("tokens per request (prompt + output)")
    ax.set_ylabel("KV cache (GiB)")
    ax.set_title(f"{title}: {bytes_per_token:,} bytes/token")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _colour(i: int):
    """Twenty distinct colours: tab10's ten (tab20's dark halves), then their light halves, so
    the first ten are tab10's and requests 11-20 do not repeat them (chapter 01 shows 16)."""
    return plt.get_cmap("tab20")((2 * i + (i // 10) % 2) % 20)


def plot_no_cache(runs: dict, prompt_len: int):
    """Milliseconds per generated token, without a KV cache and with one (chapter 00)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    styles = {"no cache": ("tab:red", "every token recomputes the whole sequence"),
              "KV cache": ("tab:blue", "every token computes itself only")}
    for name, run in runs.items():
        colour, what = styles.get(name, (None, name))
        ms = [1000 * s for s in run["seconds"]]
        xs = range(1, len(ms) + 1)
        # Token 1 is the prefill (the whole prompt) in both runs: drawn as a dot, not the line.
        ax.plot(list(xs)[1:], ms[1:], color=colour, lw=1.2, label=f"{name}: {what}")
        ax.plot([1], ms[:1], "o", color=colour, ms=4)
    ax.set_xlabel(f"generated token (after a {prompt_len}-token prompt; dot: the prefill)")
    ax.set_ylabel("ms for this token")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def memory_map(manager, num_tokens: dict[str, int]) -> list[tuple[str | None, int]]:
    """For each physical block of a KV-cache manager, in address order: (owner request id or
    None, slots filled). A bookkeeping reading for the pictures, kept outside the engine.

    `num_tokens` gives each request's tokens in the cache; a block past them is held but
    empty (reservation), and the unfilled part of a request's last block is internal waste.
    """
    bs = manager.block_size
    owner: list[tuple[str | None, int]] = [(None, 0)] * manager.num_blocks
    for rid, blocks in manager.req_to_blocks.items():
        n = num_tokens.get(rid, 0)
        for i, blk in enumerate(blocks):
            owner[blk.block_id] = (rid, max(0, min(bs, n - i * bs)))
    return owner


def usable_free_slots(manager) -> int:
    """Free slots someone could still be given. Paged: all of them. Contiguous: only those in
    gaps large enough for a whole max-length region; the rest is external fragmentation."""
    free = [blk.ref_cnt == 0 for blk in manager.block_pool.blocks]
    if not isinstance(manager, ContiguousKVCacheManager):
        return sum(free) * manager.block_size
    region = manager.num_blocks_for(manager.max_model_len)
    usable, run = 0, 0
    for is_free in free + [False]:  # the sentinel closes the last run
        if is_free:
            run += 1
        else:
            usable += (run // region) * region
            run = 0
    return usable * manager.block_size


def draw_memory_map(memory_map: list[tuple[str | None, int]], block_size: int, title: str,
                    ax=None, columns: int = 32, state_legend: bool = True):
    """The physical pool as a grid of blocks, one square per block: colour = owner (up to 20
    distinct), solid = slots holding tokens, pale and hatched = slots held but empty (reserved
    for tokens not yet produced; internal waste if the request ends before filling them),
    white = free. `memory_map` comes from `viz.memory_map`. A legend on the right names the
    requests; with `state_legend`, one below the grid names the three states (pass False on all
    but the last of several stacked maps)."""
    owners = [o for o, _ in memory_map if o is not None]
    order = list(dict.fromkeys(owners))
    rows = -(-len(memory_map) // columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.28 * rows + 1.3))
    for b, (owner, filled) in enumerate(memory_map):
        x, y = b % columns, rows - 1 - b // columns
        if owner is None:
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, fc="white", ec="0.75", lw=0.5))
            continue
        c = _colour(order.index(owner))
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, fc=(*c[:3], 0.3), ec=c, hatch="////",
                               lw=0.5))
        ax.add_patch(Rectangle((x, y), 0.92 * filled / block_size, 0.92, fc=c, ec="none"))
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    used = sum(f for o, f in memory_map if o is not None)
    held = sum(block_size for o, _ in memory_map if o is not None)
    total = len(memory_map) * block_size
    ax.set_title(f"{title}: {len(order)} requests, {used:,} tokens in {held:,} held slots "
                 f"of {total:,}", fontsize=9)
    if state_legend:
        grey = (0.35, 0.35, 0.35)
        states = [Patch(fc=grey, label="holding tokens"),
                  Patch(fc=(*grey, 0.3), ec=grey, hatch="////",
                        label="held, empty (reserved; internal waste if never filled)"),
                  Patch(fc="white", ec="0.75", label="free")]
        legend = ax.legend(handles=states, fontsize=7, loc="upper center",
                           bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False, handlelength=1.5)
        ax.add_artist(legend)
        legend.set_clip_on(False)  # else a saved figure's tight bounding box leaves it out
    handles = [Patch(fc=_colour(i), label=str(o)) for i, o in enumerate(order)]
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0),
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


def _with_gaps(steps: list[int], values: list[float]) -> tuple[list, list]:
    """Break a line where recorded steps are not consecutive (matplotlib skips a NaN)."""
    xs, ys = [], []
    for i, (x, y) in enumerate(zip(steps, values)):
        if i and x != steps[i - 1] + 1:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(x)
        ys.append(y)
    return xs, ys


def plot_sim(contiguous: SimResult, paged: SimResult):
    """Requests running at once, and the pool's share holding tokens, on one step axis, drawn
    only at the steps with requests waiting (where memory, not arrivals, sets the batch)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    for res, c in ((contiguous, "tab:red"), (paged, "tab:blue")):
        steps = res.steps or list(range(len(res.running_per_step)))
        # A dot per recorded step too: a step alone between gaps draws no line.
        ax1.plot(*_with_gaps(steps, res.running_per_step), ".-", ms=2, lw=1, color=c,
                 label=f"{res.layout} (mean {res.mean_running:.1f})")
        ax2.plot(*_with_gaps(steps, [u * 100 for u in res.utilisation_per_step]), ".-", ms=2,
                 lw=1, color=c, label=f"{res.layout} (mean {res.mean_utilisation:.0%})")
    ax1.set_xlabel("step (drawn while requests wait)")
    ax1.set_ylabel("requests running")
    ax2.set_xlabel("step (drawn while requests wait)")
    ax2.set_ylabel("pool holding real tokens (%)")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def block_size_summary(lengths: list[int], block_size: int) -> str:
    waste = internal_waste(lengths, block_size)
    entries = block_table_entries(lengths, block_size)
    mean_len = sum(lengths) / len(lengths)
    return (f"block_size={block_size:>3}: internal waste {waste:5.1f} slots/request "
            f"({waste / mean_len:5.1%} of the mean length), block table {entries:6.1f} entries")


def log_axis(axis, base: int = 10, ticks=None) -> None:
    """Put `axis` (ax.xaxis or ax.yaxis) on a log scale labelled in plain numbers: at `ticks`
    when given, else at 1, 2, 5, 10, 20, ... (base 10) or 1, 2, 4, 8, ... (base 2); never
    matplotlib's default 10^n / 2^n, since a reader compares values, not exponents."""
    ax = axis.axes
    (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log", base=base)
    if ticks is not None:
        axis.set_ticks(ticks, [str(t) for t in ticks])
    elif base == 10:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    if ticks is None:
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


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
    ax.set_title(block_size_summary(lengths, block_size), fontsize=8)
    fig.tight_layout()
    return fig


def plot_blocks_per_step(series: dict[str, list[int]], title: str = "KV blocks in use"):
    """Blocks in use after each engine step, one line per run; each run has its own colour,
    marker and line style, so runs that coincide for a while stay told apart."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
    for i, (label, blocks) in enumerate(series.items()):
        marker, ls = styles[i % len(styles)]
        ax.plot(range(1, len(blocks) + 1), blocks, marker=marker, ls=ls, ms=4, color=_colour(i),
                drawstyle="steps-post", label=f"{label} (peak {max(blocks, default=0)})")
    ax.set_xlabel("step")
    ax.set_ylabel("blocks in use")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
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
                ax.bar_label(bars, fontsize=6, padding=1)
            ax.set_xticks(range(len(ns)), [f"n={n}" for n in ns])
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(f"prompt {prompt_len} tokens", fontsize=9)
            ax.margins(y=0.15)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(modes), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def plot_gantt(traces: dict[str, list], title: str = "requests over steps"):
    """One row per request, a bar for every step it ran in; one panel per run.

    `traces` maps a run's name to its StepRecords (e.g. `BatchResult.steps`).
    """
    fig, axes = plt.subplots(len(traces), 1, figsize=(7.5, 1.6 + 1.1 * len(traces)), sharex=True)
    axes = [axes] if len(traces) == 1 else list(axes)
    for ax, (name, steps) in zip(axes, traces.items()):
        first = steps[0].step if steps else 0
        rows: dict[str, list[int]] = {}
        for rec in steps:
            for rid in rec.request_ids:
                rows.setdefault(rid, []).append(rec.step - first)
        for y, (rid, xs) in enumerate(rows.items()):
            ax.broken_barh([(x, 0.9) for x in xs], (y - 0.4, 0.8), color=_colour(y))
        ax.set_yticks(range(len(rows)), list(rows), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {len(steps)} steps", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("engine step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_concurrency(rows: list[dict], key: str = "server"):
    """Throughput and TTFT median against concurrency, one line per `key` value."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    for name in dict.fromkeys(r[key] for r in rows):
        pts = [r for r in rows if r[key] == name]
        cs = [r["concurrency"] for r in pts]
        ax1.errorbar(cs, [r["tok_s"] for r in pts], marker="o", label=name,
                     yerr=[[r["tok_s"] - r["tok_s_spread"][0] for r in pts],
                           [r["tok_s_spread"][1] - r["tok_s"] for r in pts]])
        ax2.plot(cs, [r["ttft_median_ms"] for r in pts], marker="o", label=name)
    _concurrency_axes(fig, ax1, ax2)
    return fig


def _concurrency_axes(fig, ax1, ax2, knee: int | None = None) -> None:
    """Shared styling: throughput left, TTFT right, concurrency on a log2 axis."""
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "TTFT median (ms)")):
        if knee is not None:
            ax.axvline(knee, color="k", ls="--", lw=1, label=f"KV tokens / request = {knee}")
        _log2_axes(ax, "concurrency", ylabel)
    fig.tight_layout()


def _log2_axes(ax, xlabel: str, ylabel: str, ticks=None, legend_size: int = 8) -> None:
    """A log2 x axis (ticks at `ticks`, written as plain numbers), labels, legend and grid."""
    log_axis(ax.xaxis, base=2, ticks=ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)


def plot_capacity(sweep: dict):
    """The KV-capacity knee: throughput flattens and TTFT climbs past KV tokens / request."""
    rows = sweep["rows"]
    cs = [r["concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot(cs, [r["tok_s"] for r in rows], "o-")
    ax2.plot(cs, [r["ttft_median_ms"] for r in rows], "o-", color="tab:red")
    for c, r in zip(cs, rows):
        if r["preemptions"]:
            ax2.annotate(f"{r['preemptions']:g} preempted", (c, r["ttft_median_ms"]), fontsize=7,
                         textcoords="offset points", xytext=(-30, 6))
    _concurrency_axes(fig, ax1, ax2, knee=sweep["predicted_knee"])
    return fig


def plot_stall(runs: list):
    """The decoding request's inter-token gaps over time, one line per budget (StallRuns)."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, run in enumerate(runs):
        t = run.decode_times
        label = "no chunking" if run.budget is None else f"budget {run.budget}"
        gaps = [1000 * (b - a) for a, b in zip(t, t[1:])]
        if not gaps:
            continue
        # A gap lasts from one token to the next: draw it as a flat step over that interval
        # (a line from dot to dot would draw one long gap as a ramp that starts a token early).
        ax.plot(t, gaps + gaps[-1:], drawstyle="steps-post", lw=1.2, color=_colour(i),
                label=f"{label}: max gap {1000 * run.max_gap:.0f} ms")
        ax.plot(t[1:], gaps, "o", ms=3, color=_colour(i))  # a dot where each token arrived
        ax.axvline(run.insert_time, color=_colour(i), ls=":", lw=1)
    ax.set_xlabel("seconds since the decoding request arrived (dotted: long prompt arrives)")
    ax.set_ylabel("gap since the previous token (ms)")
    log_axis(ax.yaxis)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_gap_vs_budget(runs: list, prefill_tokens_per_s: float, decode_step_s: float, fit=None):
    """Measured worst gap against the budget, with the prediction budget / prefill rate +
    one decode step, and the least-squares line through the chunked points."""
    chunked = [r for r in runs if r.budget is not None]
    xs = [r.budget for r in chunked]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(xs, [1000 * r.max_gap for r in chunked], "o", label="measured max gap")
    grid = [0, max(xs)]
    ax.plot(grid, [1000 * (x / prefill_tokens_per_s + decode_step_s) for x in grid], "k--", lw=1,
            label=f"predicted: budget / {prefill_tokens_per_s:.0f} tok/s + one decode step")
    if fit is not None:
        a, b, r2 = fit
        ax.plot(grid, [1000 * (a + b * x) for x in grid], color="tab:orange", lw=1,
                label=f"fit: {1000 * a:.0f} ms + {1000 * b:.2f} ms/token x budget, R² {r2:.3f}")
    for r in runs:
        if r.budget is None:
            ax.axhline(1000 * r.max_gap, color="tab:red", lw=1,
                       label=f"no chunking: {1000 * r.max_gap:.0f} ms")
    ax.set_xlabel("max_num_batched_tokens (tokens per step)")
    ax.set_ylabel("worst decode gap (ms)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def format_hash_chain(prompts: dict[str, list[int]], block_size: int, salts=None,
                      digits: int = 8) -> str:
    """Each prompt's full blocks as key prefixes, `=` where the key equals the first prompt's.

    The boundary effect shows directly: a shared part that ends mid-block shares only the full
    blocks before it.
    """
    from kvlab.prefix_cache import extend_block_hashes

    salts = salts or {}
    chains = {}
    for name, tokens in prompts.items():
        hashes: list[bytes] = []
        extend_block_hashes(hashes, lambda a, b, t=tokens: t[a:b], len(tokens), block_size,
                            salts.get(name))
        chains[name] = hashes
    first = next(iter(chains.values()))
    lines = []
    for name, hashes in chains.items():
        cells = []
        for i, h in enumerate(hashes):
            same = name != next(iter(chains)) and i < len(first) and first[i] == h
            cells.append(("=" if same else " ") + h.hex()[:digits])
        tail = len(prompts[name]) % block_size
        salt = f" (salt {salts[name]!r})" if name in salts else ""
        lines.append(f"{name:>8}{salt}: " + " ".join(cells)
                     + (f"  + {tail} tokens in a partial block" if tail else ""))
    return "\n".join(lines)


def plot_ttft_attack(result: dict, ax=None):
    """Tenant B's TTFT per trial, coloured by whether tenant A had sent the document."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3))
    for sent, colour, label in ((True, "tab:red", "A had sent it"),
                                (False, "tab:blue", "A had not")):
        pts = [(i, r["ttft_ms"]) for i, r in enumerate(result["rows"]) if r["a_sent"] == sent]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=colour, label=label)
    ax.axhline(result["threshold_ms"], color="k", ls="--", lw=1, label="B's threshold")
    log_axis(ax.yaxis)
    ax.set_xlabel("trial")
    ax.set_ylabel("B's TTFT (ms)")
    salted = "with per-tenant cache_salt" if result["salted"] else "no salt"
    ax.set_title(f"{salted}: B guesses right {result['accuracy']:.0%} of the time", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return ax


def plot_cold_warm_ttft(runs: list[dict], ax=None):
    """First (cold) against later (warm) TTFT, one pair of bars per `cold_warm_ttft` run
    (caching on, caching off), each labelled with its median; the warm bar's whisker spans
    the warm requests' range. Log scale: a hit is an order of magnitude faster."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.4))
    width = 0.38
    for i, run in enumerate(runs):
        lo, hi = run["warm_ttft_ms_range"]
        warm = run["warm_ttft_ms"]
        for dx, value, colour, label, err in (
                (-width / 2, run["cold_ttft_ms"], "tab:red", "first request (cold)", None),
                (width / 2, warm, "tab:blue", "later requests (median)",
                 [[warm - lo], [hi - warm]])):
            ax.bar(i + dx, value, width, color=colour, yerr=err, capsize=3,
                   label=label if i == 0 else None)
            top = value if err is None else max(value, hi)  # above the whisker, if any
            ax.annotate(f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms", (i + dx, top),
                        xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8)
    ax.set_xticks(range(len(runs)), [
        f"{'caching on' if r['enable_prefix_caching'] else 'caching off'}\n"
        f"first / later = {r['speedup']:g}x" for r in runs])
    # A linear axis (a bar's length is its value): the warm bar is short, and its label says
    # how short.
    ax.set_ylim(0, ax.get_ylim()[1] * 1.4)  # room for the labels and the legend above them
    ax.set_ylabel("TTFT (ms)")
    first = runs[0]
    ax.set_title(f"{first['prefix_len']:,}-token shared prefix + {first['tail_len']}-token "
                 "tails", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.grid(alpha=0.3, axis="y")
    ax.figure.tight_layout()
    return ax


def plot_prefix_hits(cached_tokens: list[int], prompt_lens, ax=None):
    """Requests behind a shared system prompt, in arrival order: each prompt's tokens found in
    the cache and computed, stacked, and the running hit rate (all hits / all prompt tokens so
    far, the ratio of vLLM's two counters) on the right axis."""
    n = len(cached_tokens)
    lens = [prompt_lens] * n if isinstance(prompt_lens, int) else list(prompt_lens)
    if len(lens) != n:
        raise ValueError(f"{len(lens)} prompt lengths for {n} requests")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.2))
    xs = range(1, n + 1)
    computed = [total - hit for total, hit in zip(lens, cached_tokens)]
    ax.bar(xs, cached_tokens, color="tab:green", label="found in the cache")
    ax.bar(xs, computed, bottom=cached_tokens, color="0.7", label="computed")
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("prompt tokens")
    ax.set_xticks(list(xs))
    rate, hits, total = [], 0, 0
    for hit, length in zip(cached_tokens, lens):
        hits, total = hits + hit, total + length
        rate.append(100 * hits / total)
    ax2 = ax.twinx()
    ax2.plot(xs, rate, "o-", color="k", ms=4, label="hit rate so far")
    # Headroom above the bars and the line for the legend.
    ax.set_ylim(0, 1.35 * max(lens))
    ax2.set_ylim(0, 135)
    ax2.set_yticks([0, 25, 50, 75, 100])
    ax2.set_ylabel("hit rate so far (%)")
    ax.set_title(f"hit rate after {n} requests: {rate[-1]:.1f}%", fontsize=9)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=3)
    return ax


def free_queue_snapshot(block_pool, label: str, names: dict | None = None) -> dict:
    """A reading of a `BlockPool` for `draw_free_queue`: the free queue's block ids, head (the
    next to be reused: a block without a key first, else the cached block to evict) first; the blocks in use; and, for every block still holding a prefix
    key, a short name (`names` maps a key to it, e.g. {key: "a0"}; others read "key")."""
    names = names or {}
    return {"label": label,
            "queue": list(block_pool.free_queue),
            "in_use": [blk.block_id for blk in block_pool.blocks if blk.ref_cnt > 0],
            "keys": {blk.block_id: names.get(blk.block_hash, "key")
                     for blk in block_pool.blocks if blk.block_hash is not None}}


def draw_free_queue(snapshots: list[dict], ax=None):
    """The free queue at each moment, one row per `free_queue_snapshot`, head on the left: the
    next block handed out is the leftmost. A block still findable by its prefix key is coloured
    and named (same prefix, same colour); an empty one is white. Blocks in use stand apart on
    the right, in grey."""
    owners = list(dict.fromkeys(name[:1] for s in snapshots for name in s["keys"].values()))
    width = max(len(s["queue"]) for s in snapshots)
    gap = 1.2
    if ax is None:
        total = width + gap + max(len(s["in_use"]) for s in snapshots)
        _, ax = plt.subplots(figsize=(1.0 + 0.62 * total + 2.2, 0.62 * len(snapshots) + 0.9))
    for row, snap in enumerate(snapshots):
        y = len(snapshots) - 1 - row
        for x, block_id in enumerate(snap["queue"]):
            name = snap["keys"].get(block_id)
            colour = "white" if name is None else _colour(owners.index(name[:1]))
            ax.add_patch(Rectangle((x, y + 0.1), 0.9, 0.8, fc=colour,
                                   alpha=1 if name is None else 0.45, ec="0.3", lw=0.8))
            ax.text(x + 0.45, y + 0.5, str(block_id) if name is None else f"{block_id}\n{name}",
                    ha="center", va="center", fontsize=7)
        for k, block_id in enumerate(snap["in_use"]):
            x = width + gap + k
            ax.add_patch(Rectangle((x, y + 0.1), 0.9, 0.8, fc="0.75", ec="0.3", lw=0.8))
            name = snap["keys"].get(block_id)
            ax.text(x + 0.45, y + 0.5, str(block_id) if name is None else f"{block_id}\n{name}",
                    ha="center", va="center", fontsize=7)
        ax.text(-0.3, y + 0.5, snap["label"], ha="right", va="center", fontsize=8)
    top = len(snapshots)
    ax.annotate("head: reused first", xy=(0.2, top + 0.05), xytext=(0.2, top + 0.45),
                fontsize=7, arrowprops={"arrowstyle": "->", "lw": 0.8})
    ax.text(width - 0.1, top + 0.25, "tail", ha="right", fontsize=7)
    ax.text(width + gap, top + 0.25, "in use", fontsize=7)
    ax.set_xlim(-0.2, width + gap + max(len(s["in_use"]) for s in snapshots) + 0.2)
    ax.set_ylim(0, top + 0.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("free queue, step by step (number: block id; name: the prefix block it still "
                 "holds)", fontsize=9)
    return ax


def plot_peers(peers: dict, ceiling: dict):
    """Left: useful output tokens/s of kvlab and its peers on one workload (compare_peers).
    Right: kvlab's decode rate at the ceiling's batch against this machine's two limits
    (ceiling_fraction): the arithmetic at the fastest matmul measured and the bytes at the
    bandwidth."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.4), width_ratios=(3, 2))
    names = list(peers["rows"])
    rates = [peers["rows"][n]["useful_tok_s"] for n in names]
    bars = ax1.barh(names, rates, color=[_colour(i) for i in range(len(names))])
    ax1.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    ax1.invert_yaxis()
    ax1.set_xlabel("useful output tokens/s")
    ax1.set_title(f"{peers['useful_tokens']} tokens, same prompts and weights", fontsize=9)
    c = ceiling["ceiling"]
    labels = ["arithmetic\nlimit", "memory\nlimit", "kvlab"]
    values = [c["compute_bound_tok_s"], c["memory_bound_tok_s"], ceiling["kvlab_decode_tok_s"]]
    bars = ax2.bar(labels, values, color=["0.75", "0.6", _colour(0)])
    ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.tick_params(axis="x", labelsize=8)
    ax2.set_ylabel("decode tokens/s")
    ax2.set_title(f"batch {c['batch']}, context {c['context']}: "
                  f"{ceiling['fraction_of_ceiling']:.0%} of the limit", fontsize=9)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="x" if ax is ax1 else "y")
    fig.tight_layout()
    return fig


def plot_serve_peers(rows: list[dict]):
    """Two servers through one streaming client (kvlab.bench.serve_peers, notebook 07): output
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
            ax.bar_label(bars, fmt="%.0f", fontsize=7, label_type="center")
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label if p90 is None else f"{label}: median, whisker p90")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
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
    for key, style, name in (("mm", "--", "torch.mm rate"), ("peak", ":", "fastest matmul")):
        ax1.plot(batches, [1000 * r["batch"] / r[f"ceiling_ms_{key}"] for r in rows], style,
                 color="k", label=f"ceiling ({name})")
    for i, c in enumerate(sorted({r["context"] for r in others})):
        pts = [r for r in others if r["context"] == c]
        ax1.plot([r["batch"] for r in pts], [r["tok_s"] for r in pts], "s", ms=5,
                 color=_colour(i + 1), label=f"kvlab, context {c}")
    _log2_axes(ax1, "running requests (decode batch)", "decode tokens/s", ticks=batches,
               legend_size=7)
    width = 0.4
    for i, (key, name) in enumerate((("mm", "of ceiling (torch.mm rate)"),
                                     ("peak", "of ceiling (fastest matmul)"))):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        bars = ax2.bar(xs, [100 * r[f"fraction_{key}"] for r in rows], width,
                       color=_colour(i), label=name)
        ax2.bar_label(bars, fmt="%.0f%%", fontsize=7)
    ax2.set_xticks(range(len(rows)), [str(b) for b in batches])
    ax2.set_xlabel(f"running requests (context {ctx})")
    ax2.set_ylabel("share of the ceiling (%)")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


# ---- the engine explorer's picture (kvlab.explorer): pure functions of a snapshot -------------
SHARED_COLOUR = "#37474f"  # a shared block belongs to several requests: no one request's colour
DECODE_COLOUR, PREFILL_COLOUR = "#1f77b4", "#ff7f0e"
COPY_EDGE = "magenta"  # a copied block's edge: no request colour (tab20) is magenta
MAX_EVENTS_DRAWN = 12


def format_queues(snap: EngineSnapshot) -> str:
    """The queues as text, one line each: the explorer's widget shows it under its buttons, and
    the picture repeats it."""

    def describe(rid: str) -> str:
        r = snap.requests[rid]
        mark = " (preempted)" if r.status == "preempted" else ""
        return (f"{rid}{mark} [{r.num_computed_tokens}/"
                f"{r.num_prompt_tokens + r.num_output_tokens} tokens in KV, "
                f"{r.num_output_tokens}/{r.max_tokens} out]")

    running = ", ".join(describe(r) for r in snap.running) or "-"
    waiting = ", ".join(describe(r) for r in snap.waiting) or "-"
    return (f"step {snap.step}\n"
            f"running ({len(snap.running)}): {running}\n"
            f"waiting ({len(snap.waiting)}): {waiting}")


def _block_colour(snap: EngineSnapshot, owner: str):
    return _colour(snap.colours.get(owner, 0))


def _text_lines(ax, x: float, lines: list[tuple[str, object]]) -> None:
    """Monospace lines from the top of `ax`, each in its own colour, 9 points apart."""
    for i, (line, colour) in enumerate(lines):
        ax.text(x, 1, line, va="top", family="monospace", fontsize=6.5, color=colour,
                transform=offset_copy(ax.transAxes, fig=ax.figure, y=-9 * i, units="points"))


def draw_snapshot(snap: EngineSnapshot, title: str | None = None):
    """The snapshot as one figure: the pool as a grid of blocks, the step's token budget as a
    bar, then the queues, the block tables (each in its request's colour) and the step's
    events. Reads only `snap`.

    Blocks: white = free; grey, dotted = cached but free (a later request can still hit it; it
    is evicted when it reaches the free queue's head); a request's colour = held (solid part:
    slots holding K/V; pale part: taken, not yet written); dark with "xN" = shared by N block
    tables; a magenta edge = written by a copy in the last step (copy-on-write). A dot in the
    corner: the block has a prefix-cache key. Small grey numbers are block ids.
    """
    n = len(snap.blocks)
    columns = 16 if n <= 64 else 32
    small = columns == 16
    rows = -(-n // columns)

    black = "black"
    left = [(line, black) for q in format_queues(snap).splitlines()
            for line in textwrap.wrap(q, 92, subsequent_indent="    ")]
    left += [("", black), ("block tables (logical -> physical block):", black)]
    refs = [b.ref_cnt for b in snap.blocks]
    for rid, table in snap.block_tables.items():
        left.append((format_block_tables({rid: table}, max_entries=16, ref_cnts=refs),
                     _block_colour(snap, rid)))
    if not snap.block_tables:
        left.append(("(none)", black))
    events = snap.events[-MAX_EVENTS_DRAWN:]
    right = [("events", black)]
    if len(snap.events) > len(events):
        right.append((f"... {len(snap.events) - len(events)} earlier", black))
    right += [(line, black) for e in events
              for line in textwrap.wrap(str(e), 70, subsequent_indent="    ")]
    if not events:
        right.append(("(none)", black))

    heights = [(rows + 1.2) * (0.42 if small else 0.27), 0.5,
               0.125 * max(len(left), len(right)) + 0.1]
    fig = plt.figure(figsize=(10, sum(heights) + 0.9))
    grid = fig.add_gridspec(3, 1, height_ratios=heights, hspace=0.5, left=0.02, right=0.98,
                            top=0.94, bottom=0.02)
    ax_pool, ax_budget, ax_text = (fig.add_subplot(grid[i]) for i in range(3))

    for b in snap.blocks:
        x, y = b.block_id % columns, rows - 1 - b.block_id // columns
        state, gid = b.state, f"block-{b.block_id}"
        edge, lw = (COPY_EDGE, 2.5) if b.just_copied else ("0.4", 0.6)
        if state == FREE:
            ax_pool.add_patch(Rectangle((x, y), 0.9, 0.9, fc="white", ec="0.75", lw=0.6, gid=gid))
        elif state == CACHED:
            ax_pool.add_patch(Rectangle((x, y), 0.9, 0.9, fc="0.88", ec="0.4", lw=0.8, ls=":",
                                        hatch="..", gid=gid))
        elif state == SHARED:
            ax_pool.add_patch(Rectangle((x, y), 0.9, 0.9, fc=SHARED_COLOUR, ec=edge, lw=lw,
                                        gid=gid))
            ax_pool.text(x + 0.45, y + 0.45, f"x{b.ref_cnt}", ha="center", va="center",
                         color="white", fontsize=7 if small else 5, fontweight="bold")
        else:
            c = _block_colour(snap, b.owners[0])
            ax_pool.add_patch(Rectangle((x, y), 0.9, 0.9, fc=(*c[:3], 0.3), ec=edge, lw=lw,
                                        hatch="////", gid=gid))
            ax_pool.add_patch(Rectangle((x, y), 0.9 * b.num_filled / snap.block_size, 0.9,
                                        fc=c, ec="none"))
        if b.key is not None:  # keyed: findable by the prefix cache
            ax_pool.plot([x + 0.78], [y + 0.78], marker="o", ms=2.5 if small else 1.5,
                         color="white" if state == SHARED else "black")
        if small and state != SHARED:
            ax_pool.text(x + 0.06, y + 0.08, str(b.block_id), fontsize=5, color="0.3")
    for r in range(rows):
        ax_pool.text(-0.2, rows - 1 - r + 0.45, str(r * columns), ha="right", va="center",
                     fontsize=6, color="0.3")
    ax_pool.set_xlim(-1, columns)
    ax_pool.set_ylim(-1.2, rows)  # the strip below the grid holds the legend
    ax_pool.set_aspect("equal")
    ax_pool.axis("off")
    # Counts of the states on screen only (held and free always), like the legend below.
    counts = ", ".join(f"{snap.count(s)} {s}" for s in (HELD, SHARED, CACHED, FREE)
                       if s in (HELD, FREE) or snap.count(s))
    ax_pool.set_title(title or f"KV pool after step {snap.step} ({snap.kv_layout}, block_size "
                      f"{snap.block_size}): {counts}", fontsize=9)
    # The legend names what is on screen: free and held always, the states of later chapters
    # (cached, shared, copied, keyed) only once a block is in them, so chapter 01's explorer
    # does not list chapter 05's.
    present = {b.state for b in snap.blocks}
    states = [Patch(fc="white", ec="0.75", label="free"),
              Patch(fc=(0.4, 0.4, 0.4, 0.3), ec="0.4", hatch="////",
                    label="held by a request (solid: K/V written)")]
    if CACHED in present:
        states.append(Patch(fc="0.88", ec="0.4", ls=":", hatch="..",
                            label="cached, free (evictable)"))
    if SHARED in present:
        states.append(Patch(fc=SHARED_COLOUR, label="shared (xN: ref count)"))
    if any(b.just_copied for b in snap.blocks):
        states.append(Patch(fc="white", ec=COPY_EDGE, lw=2, label="just copied (copy-on-write)"))
    handles = list(states)
    if any(b.key is not None for b in snap.blocks):
        handles.append(Line2D([], [], marker="o", ls="none", color="black", ms=3,
                              label="dot: has a prefix-cache key"))
    ax_pool.legend(handles=handles, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 0.0),
                   ncol=len(handles), frameon=False, handlelength=1.2, borderaxespad=0.1)

    budget, dec, pre = snap.token_budget, snap.num_decode_tokens, snap.num_prefill_tokens
    unused = max(budget - dec - pre, 0)
    ax_budget.barh([0], [dec], height=0.6, color=DECODE_COLOUR, gid="budget-decode")
    ax_budget.barh([0], [pre], left=[dec], height=0.6, color=PREFILL_COLOUR,
                   gid="budget-prefill")
    ax_budget.barh([0], [unused], left=[dec + pre], height=0.6, color="white", ec="0.6",
                   gid="budget-unused")
    ax_budget.set_xlim(0, max(budget, dec + pre, 1))
    ax_budget.set_ylim(-0.5, 0.5)
    ax_budget.set_yticks([])
    ax_budget.tick_params(axis="x", labelsize=7)
    for side in ("top", "right", "left"):
        ax_budget.spines[side].set_visible(False)
    ax_budget.set_title(f"last step's token budget: {dec} decode (blue) + {pre} prefill "
                        f"(orange), {unused} unused of max_num_batched_tokens={budget}",
                        fontsize=8)

    ax_text.axis("off")
    _text_lines(ax_text, 0, left)
    _text_lines(ax_text, 0.6, right)
    return fig


def plot_api_run(results: dict):
    """The experiments through the API (`kvlab.bench.api.run_api_experiments`, notebook 07):
    tokens/s and TTFT by concurrency (chapter 03), cold / warm / after-reset TTFT (05) and the
    salt table's TTFT (06), each panel only where the run measured it."""
    panels = [p for p in ("concurrency", "prefix-cache", "cache-salt") if results.get(p)]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(3.8 * max(len(panels), 1), 3.4),
                             squeeze=False)
    for ax, name in zip(axes[0], panels):
        rows = [r for r in results[name] if r.get("result") != "not measurable"]
        if name == "concurrency":
            levels = [str(r["concurrency"]) for r in rows]
            bars = ax.bar(levels, [r["tok_s"] for r in rows], color=_colour(0))
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
            ax.set_xlabel("concurrency (2c requests, closed loop)")
            ax.set_ylabel("output tokens/s")
            twin = ax.twinx()
            twin.plot(levels, [r["ttft_median_ms"] for r in rows], "o-", color=_colour(1))
            twin.set_ylabel("TTFT median (ms)", color=_colour(1))
            twin.set_ylim(bottom=0)
        elif name == "prefix-cache":
            r = rows[0]
            keys = [("cold", "cold_ttft_ms"), ("warm", "warm_ttft_ms"),
                    ("after reset", "after_reset_ttft_ms")]
            keys = [(label, k) for label, k in keys if r.get(k) is not None]
            bars = ax.bar([label for label, _ in keys], [r[k] for _, k in keys],
                          color=[_colour(i) for i in range(len(keys))])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
            ax.set_ylabel("TTFT (ms)")
            ax.set_title(f"shared prefix, {r['prompt_tokens']}-token prompts", fontsize=9)
        else:
            table = [r for r in rows if r.get("experiment") == "salt table" and "order" in r]
            bars = ax.bar([f"{r['order']}: {r['cache_salt']}" for r in table],
                          [r["ttft_ms"] for r in table], color=_colour(2))
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
            ax.set_ylabel("TTFT (ms)")
            ax.set_title("one document, in order, by cache_salt", fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig

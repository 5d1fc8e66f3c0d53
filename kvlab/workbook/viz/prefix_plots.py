"""Chapters 05-06: the hash chain, cold against warm TTFT, hits per prompt, the free queue, and
the timing attack."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from kvlab.workbook.viz.axes import _colour, log_axis


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
    # Every label padded to the longest, so that the keys line up in columns, block by block.
    labels = {name: f"{name}" + (f" (salt {salts[name]!r})" if name in salts else "")
              for name in chains}
    width = max(8, *(len(label) for label in labels.values()))
    lines = []
    for name, hashes in chains.items():
        cells = []
        for i, h in enumerate(hashes):
            same = name != next(iter(chains)) and i < len(first) and first[i] == h
            cells.append(("=" if same else " ") + h.hex()[:digits])
        tail = len(prompts[name]) % block_size
        lines.append(f"{labels[name]:>{width}}: " + " ".join(cells)
                     + (f"  + {tail} tokens in a partial block" if tail else ""))
    return "\n".join(lines)


def plot_ttft_attack(result: dict, ax=None, same_scale_as: dict | None = None):
    """Tenant B's TTFT per trial, coloured by whether tenant A had sent the document.

    same_scale_as: another `timing_attack` result (the unsalted run) whose TTFTs the y axis
    spans too, so the two plots compare at a glance: a defended run's points all sit where the
    undefended run's misses did."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3))
    for sent, colour, label in ((True, "tab:red", "A had sent it"),
                                (False, "tab:blue", "A had not")):
        pts = [(i, r["ttft_ms"]) for i, r in enumerate(result["rows"]) if r["a_sent"] == sent]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=colour, label=label)
    ax.axhline(result["threshold_ms"], color="k", ls="--", lw=1, label="B's threshold")
    log_axis(ax.yaxis)
    shown = [result["threshold_ms"]] + [r["ttft_ms"] for run in (result, same_scale_as) if run
                                        for r in run["rows"]]
    ax.set_ylim(min(shown) / 1.5, max(shown) * 1.5)  # a decade or so: several labelled ticks
    ax.set_xlabel("trial")
    ax.set_ylabel("B's TTFT (ms)")
    salted = "with per-tenant cache_salt" if result["salted"] else "no salt"
    trials = len(result["rows"])  # one row a trial: the count the rate comes from
    ax.set_title(f"{salted}: B right in {round(result['accuracy'] * trials)} of {trials} trials",
                 fontsize=9)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return ax


def plot_cold_warm_ttft(runs: list[dict], ax=None):
    """First (cold) against later (warm) TTFT, one pair of bars per `cold_warm_ttft` run
    (caching on, caching off), each labelled with its median; the warm bar's whisker spans
    the warm requests' range."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.4))
    width = 0.38
    for i, run in enumerate(runs):
        lo, hi = run["warm_ttft_ms_range"]
        warm = run["warm_ttft_ms"]
        for dx, value, colour, label, err in (
                (-width / 2, run["cold_ttft_ms"], "tab:red",
                 "cold (median: first requests, and resends after a cache reset)", None),
                (width / 2, warm, "tab:blue", "later requests (median; whisker: range)",
                 [[warm - lo], [hi - warm]])):
            ax.bar(i + dx, value, width, color=colour, yerr=err, capsize=3,
                   label=label if i == 0 else None)
            top = value if err is None else max(value, hi)  # above the whisker, if any
            ax.annotate(f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms", (i + dx, top),
                        xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                        fontsize=9)
    ax.set_xticks(range(len(runs)), [
        f"{'caching on' if r['enable_prefix_caching'] else 'caching off'}\n"
        f"first / later = {r['speedup']:g}x" for r in runs])
    # A linear axis (a bar's length is its value): the warm bar is short, and its label says
    # how short.
    ax.set_ylim(0, ax.get_ylim()[1] * 1.6)  # room for the labels and the legend above them
    ax.set_ylabel("TTFT (ms)")
    first = runs[0]
    ax.set_title(f"{first['prefix_len']:,}-token shared prefix + {first['tail_len']}-token "
                 "tails", fontsize=9)
    # One entry a row: two of these long labels side by side are wider than the axes.
    ax.legend(fontsize=9, loc="upper center", ncol=1)
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
    ax.legend(handles=handles, fontsize=9, loc="upper left", ncol=3)
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
                    ha="center", va="center", fontsize=9)
        for k, block_id in enumerate(snap["in_use"]):
            x = width + gap + k
            ax.add_patch(Rectangle((x, y + 0.1), 0.9, 0.8, fc="0.75", ec="0.3", lw=0.8))
            name = snap["keys"].get(block_id)
            ax.text(x + 0.45, y + 0.5, str(block_id) if name is None else f"{block_id}\n{name}",
                    ha="center", va="center", fontsize=9)
        ax.text(-0.3, y + 0.5, snap["label"], ha="right", va="center", fontsize=9)
    top = len(snapshots)
    ax.annotate("head: reused first", xy=(0.2, top + 0.05), xytext=(0.2, top + 0.45),
                fontsize=9, arrowprops={"arrowstyle": "->", "lw": 0.8})
    ax.text(width - 0.1, top + 0.25, "tail", ha="right", fontsize=9)
    ax.text(width + gap, top + 0.25, "in use (by block id)", fontsize=9)
    ax.set_xlim(-0.2, width + gap + max(len(s["in_use"]) for s in snapshots) + 0.2)
    ax.set_ylim(0, top + 0.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("free queue, step by step (number: block id; name: the prefix block it still "
                 "holds)", fontsize=9)
    swatches = [Patch(fc=_colour(i), alpha=0.45, ec="0.3") for i in range(len(owners))]
    labels = [f"free, still holds a block of prefix {o}" for o in owners]
    swatches += [Patch(fc="white", ec="0.3"), Patch(fc="0.75", ec="0.3")]
    labels += ["free, no prefix key", "in use by a request"]
    ax.legend(swatches, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
              ncol=min(len(swatches), 4), fontsize=9.5, frameon=False)
    return ax

"""Pure functions that return matplotlib figures or text. Widgets (widgets.py) only call these.

Nothing here touches an engine's state: callers pass in numbers or snapshots, so every figure can
be drawn in a test without a browser.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

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
    return plt.get_cmap("tab10")(i % 10)


def draw_memory_map(memory_map: list[tuple[str | None, int]], block_size: int, title: str,
                    ax=None, columns: int = 32):
    """The physical pool as a grid of blocks: colour = owner, solid = slots holding tokens,
    pale = slots reserved but empty, white = free. `memory_map` comes from
    `KVCacheManager.memory_map`."""
    owners = [o for o, _ in memory_map if o is not None]
    order = list(dict.fromkeys(owners))
    rows = -(-len(memory_map) // columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.28 * rows + 0.9))
    for b, (owner, filled) in enumerate(memory_map):
        x, y = b % columns, rows - 1 - b // columns
        if owner is None:
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, fc="white", ec="0.8", lw=0.5))
            continue
        c = _colour(order.index(owner))
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, fc=c, alpha=0.25, ec="0.6", lw=0.5))
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
    handles = [Patch(fc=_colour(i), label=str(o)) for i, o in enumerate(order[:10])]
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
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


def plot_sim(contiguous: SimResult, paged: SimResult):
    """Requests running at once, step by step, for the two allocators."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    for res, c in ((contiguous, "tab:red"), (paged, "tab:blue")):
        ax1.plot(res.running_per_step, color=c, label=f"{res.layout} (mean {res.mean_running:.1f})")
        ax2.plot([u * 100 for u in res.utilisation_per_step], color=c,
                 label=f"{res.layout} (mean {res.mean_utilisation:.0%})")
    ax1.set_xlabel("step")
    ax1.set_ylabel("requests running")
    ax2.set_xlabel("step")
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


def plot_block_size_tradeoff(lengths: list[int], block_size: int,
                             block_sizes=(1, 2, 4, 8, 16, 32, 64, 128)):
    """Internal waste grows with the block size; the block table shrinks. One figure, two axes."""
    sizes = sorted(set(block_sizes) | {block_size})
    waste = [internal_waste(lengths, b) for b in sizes]
    entries = [block_table_entries(lengths, b) for b in sizes]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(sizes, waste, "o-", color="tab:red", label="internal waste (slots/request)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block_size (tokens)")
    ax.set_ylabel("wasted slots per request", color="tab:red")
    ax2 = ax.twinx()
    ax2.plot(sizes, entries, "s-", color="tab:blue", label="block-table entries")
    ax2.set_yscale("log")
    ax2.set_ylabel("block-table entries per request", color="tab:blue")
    ax.axvline(block_size, color="k", ls="--", lw=1)
    ax.set_title(block_size_summary(lengths, block_size), fontsize=8)
    fig.tight_layout()
    return fig


def plot_blocks_per_step(series: dict[str, list[int]], title: str = "KV blocks in use"):
    """Blocks in use after each engine step, one line per run."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for label, blocks in series.items():
        ax.plot(range(1, len(blocks) + 1), blocks, label=f"{label} (peak {max(blocks, default=0)})")
    ax.set_xlabel("step")
    ax.set_ylabel("blocks in use")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_cow_savings(rows: list[dict]):
    """Share of peak KV memory saved by block sharing, against n or beam width."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    keys = sorted({(r["kind"], r["prompt_len"]) for r in rows})
    for kind, prompt_len in keys:
        pts = sorted((r["k"], r["saved"]) for r in rows
                     if r["kind"] == kind and r["prompt_len"] == prompt_len)
        ax.plot([k for k, _ in pts], [100 * v for _, v in pts], "o-" if kind == "beam" else "s--",
                label=f"{kind}, prompt {prompt_len}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n (sampling) or beam width")
    ax.set_ylabel("peak KV memory saved (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig

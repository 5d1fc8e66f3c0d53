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
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()


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
        ax.plot([b for b in t[1:]], [1000 * (b - a) for a, b in zip(t, t[1:])], "o-", ms=3,
                color=_colour(i), label=f"{label}: max gap {1000 * run.max_gap:.0f} ms")
        ax.axvline(run.insert_time, color=_colour(i), ls=":", lw=1)
    ax.set_xlabel("seconds since the decoding request arrived (dotted: long prompt arrives)")
    ax.set_ylabel("gap before this token (ms)")
    ax.set_yscale("log")
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
    ax.set_yscale("log")
    ax.set_xlabel("trial")
    ax.set_ylabel("B's TTFT (ms)")
    salted = "with per-tenant cache_salt" if result["salted"] else "no salt"
    ax.set_title(f"{salted}: B guesses right {result['accuracy']:.0%} of the time", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return ax


def plot_peers(peers: dict, ceiling: dict):
    """Left: useful output tokens/s of kvlab and its peers on one workload (compare_peers).
    Right: kvlab's decode rate at the ceiling's batch against this machine's two limits
    (ceiling_fraction): the arithmetic at the matmul rate and the bytes at the bandwidth."""
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

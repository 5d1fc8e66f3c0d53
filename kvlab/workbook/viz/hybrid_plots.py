"""Chapter 09's figures: the blocks each KV cache group of a hybrid model holds as a request
grows, and what the same bytes hold with and without sliding-window layers."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

FULL_COLOUR = "#1f77b4"  # blue: the full-attention group
WINDOW_COLOUR = "#ff7f0e"  # orange: the sliding-window group


def plot_blocks_per_group(trace: dict):
    """`trace`: `kvlab.bench.hybrid.window_trace`'s result. Blocks held after each step, by
    the tokens in the cache: one line per kind of group."""
    rows = trace["rows"]
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.step(tokens, [r["full"] for r in rows], where="post", color=FULL_COLOUR, lw=2,
            label="full-attention group: every block it was given")
    ax.step(tokens, [r["window"] for r in rows], where="post", color=WINDOW_COLOUR, lw=2,
            label=f"sliding-window group (window {trace['window']} tokens)")
    ax.set_xlabel("tokens in the cache (prompt, then one more each step)")
    ax.set_ylabel(f"blocks held (blocks of {trace['block_size']})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=10, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def format_capacity(rows: list[dict]) -> str:
    """`kvlab.bench.hybrid.capacity`'s rows as a table."""
    head = (f"{'model':24} {'groups':>6} {'blocks':>7} {'KV MiB':>7} {'vLLM: tokens':>12} "
            f"{'concurrency':>11} {'running (mean)':>14} {'preemptions':>11} {'steps':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['model']:24} {r['groups']:>6} {r['num_blocks']:>7} "
                     f"{r['kv_bytes'] / 2**20:>7.1f} {r['vllm_tokens']:>12,} "
                     f"{r['vllm_concurrency']:>10.2f}x {r['mean_running']:>14.1f} "
                     f"{r['preemptions']:>11} {r['steps']:>6}")
    return "\n".join(lines)

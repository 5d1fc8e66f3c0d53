"""Chapter 08's figures: what each KV precision holds, what it costs, and the weights' dtype.

One colour per dtype in every figure of the chapter: `dtype_colour` is the only place a figure
here gets a dtype's colour from, so `int8_per_token_head` is the same brown in the accuracy
scatter, the capacity bars and wherever else it appears (tests/workbook/test_viz_precision.py).
"""

from __future__ import annotations

import math

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt

from kvlab.workbook.viz.axes import log_axis

_TAB10 = plt.get_cmap("tab10")

# Each kv_cache_dtype's colour (the names of kvlab/kv_quant.py, as vLLM's CacheDType spells them).
DTYPE_COLOURS: dict[str, tuple] = {
    "auto": _TAB10(0),  # blue: the model's own dtype, the full-precision cache
    "bfloat16": _TAB10(1),  # orange
    "fp8_e4m3": _TAB10(2),  # green
    "fp8_e5m2": _TAB10(3),  # red
    "fp8_per_token_head": _TAB10(4),  # purple
    "int8_per_token_head": _TAB10(5),  # brown
    "int4_per_token_head": _TAB10(6),  # pink
    "float16": _TAB10(8),  # olive
}
# Other names the chapter draws for the same dtypes: vLLM's "fp8" is fp8_e4m3; the notebook
# labels its bfloat16 row "bf16 model + bf16 KV" (a bfloat16 cache comes with a bfloat16 model);
# the weights' figure names the float32 model, whose "auto" cache is float32; "int8" and "int4"
# are the per-token-head modes' short names.
_ALIASES = {"fp8": "fp8_e4m3", "bf16 model + bf16 KV": "bfloat16", "float32": "auto",
            "int8": "int8_per_token_head", "int4": "int4_per_token_head"}
# KV heads are not dtypes: their lines take colours no dtype has (navy, teal, dark goldenrod,
# black, grey), so a head never reads as a precision.
HEAD_COLOURS = ("#000075", "#469990", "#b8860b", "#000000", "#7f7f7f")


def dtype_colour(name: str):
    """The one colour of a kv_cache_dtype (or of its alias) in every chapter-08 figure."""
    key = _ALIASES.get(name, name)
    if key not in DTYPE_COLOURS:
        raise KeyError(f"no colour for dtype {name!r}: add it to DTYPE_COLOURS "
                       f"(known: {', '.join(DTYPE_COLOURS)})")
    return DTYPE_COLOURS[key]


def plot_head_scales(absmax, layer: int):
    """absmax: (tokens, heads), the largest |value| of each token's K vector in each KV head
    of one layer. One line per head: the scale each vector would need."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for h in range(absmax.shape[1]):
        ax.plot(range(absmax.shape[0]), absmax[:, h].tolist(),
                color=mcolors.to_rgba(HEAD_COLOURS[h % len(HEAD_COLOURS)]), lw=1.5,
                label=f"KV head {h}")
    ax.set_xlabel("token position")
    ax.set_ylabel("largest |value| in the vector")
    ax.set_ylim(bottom=0)
    ax.set_title(f"K in layer {layer}: each (token, head) vector's largest |value|")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_precision_tradeoff(rows: list[dict]):
    """Left: requests that fit in the same bytes, per kv_cache_dtype. Right: what that costs,
    the mean KL divergence from the full-precision cache against bytes per token, on log axes
    in plain numbers, over the lossy rows only (a row with KL 0 cannot sit on a log axis:
    the title names it)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r["kv_cache_dtype"] for r in rows]
    fits = [r["requests_fit"] for r in rows]
    bars = left.barh(range(len(rows)), fits, color=[dtype_colour(n) for n in names])
    left.set_yticks(range(len(rows)), names)
    left.invert_yaxis()
    for bar, n in zip(bars, fits):
        left.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {n}", va="center",
                  fontsize=9)
    left.set_xlim(0, max(fits) * 1.15)
    r0 = rows[0]
    left.set_xlabel(f"requests of {r0['request_len']:,} tokens that fit at once")
    left.set_title(f"the same {r0['kv_cache_memory_bytes'] / 2**20:g} MiB pool")
    lossy = [r for r in rows if r["mean_kl"] > 0]
    for r in lossy:
        right.scatter(r["bytes_per_token"], r["mean_kl"], color=dtype_colour(r["kv_cache_dtype"]),
                      s=40, zorder=3)
        right.annotate(r["kv_cache_dtype"], (r["bytes_per_token"], r["mean_kl"]),
                       textcoords="offset points", xytext=(6, 3), fontsize=9)
    if lossy:
        # Only the drawn points' range (the full-precision row, the largest, is not drawn), on a
        # log axis since the modes differ by factors of two (int4 half of fp8, fp8 half of
        # bfloat16); room on the right for the last point's name.
        xs = [r["bytes_per_token"] for r in lossy]
        log_axis(right.xaxis)
        right.set_xlim(min(xs) / 1.3, max(xs) * 1.6)
        lo = min(r["mean_kl"] for r in lossy)
        hi = max(r["mean_kl"] for r in lossy)
        # One tick a decade: 1-2-5 ticks over five decades crowd the axis.
        first, last = math.floor(math.log10(lo / 3)), math.ceil(math.log10(hi * 3))
        log_axis(right.yaxis, ticks=[10.0 ** k for k in range(first, last + 1)])
        right.set_ylim(lo / 3, hi * 3)
    exact = [r["kv_cache_dtype"] for r in rows if r["mean_kl"] == 0]
    right.set_xlabel("bytes per token (K and V, every layer, scales included)")
    right.set_ylabel("mean KL from the full-precision cache (nats)")
    right.set_title("accuracy paid" + (f" ({', '.join(exact)}: 0, not drawn)" if exact else ""),
                    fontsize=10)
    right.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_capacity_by_dtype(rows: list[dict]):
    """Throughput of one burst per kv_cache_dtype in the same bytes, preemptions on each bar."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = [r["kv_cache_dtype"] for r in rows]
    tok_s = [r["tok_s"] for r in rows]
    bars = ax.bar(range(len(rows)), tok_s, color=[dtype_colour(n) for n in names])
    for bar, r in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{r['preemptions']:g} preempted\nroom for {r['fit_at_once']}", ha="center",
                va="bottom", fontsize=9)
    # Horizontal, on two lines ("int8" over "per token head"): rotated 8-point names were hard
    # to tell apart on a projector.
    ax.set_xticks(range(len(rows)),
                  [n.replace("_per_token_head", "\nper token head") for n in names], fontsize=9)
    ax.set_ylim(0, max(tok_s) * 1.3)
    ax.set_ylabel("output tokens/s")
    r0 = rows[0]
    ax.set_title(f"a burst of {r0['concurrency']} requests in the same "
                 f"{r0['memory_bytes'] / 2**20:g} MiB" if "memory_bytes" in r0 else
                 f"a burst of {r0['concurrency']} requests in the same bytes")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def plot_weights_dtype(result: dict):
    """Decode step time against batch size, per weights dtype, with each dtype's ceiling. The
    weights' dtypes take the colours of the caches they come with: float32 that of "auto" (the
    float32 model's own cache), bfloat16 that of "bfloat16"."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    dtypes = list(dict.fromkeys(r["dtype"] for r in result["rows"]))
    batches = sorted({r["batch"] for r in result["rows"]})
    for d in dtypes:
        rows = [r for r in result["rows"] if r["dtype"] == d]
        ax.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], "o-",
                color=dtype_colour(d), label=f"{d}: measured step")
        ax.plot([r["batch"] for r in rows], [r["ceiling_ms"] for r in rows], "--",
                color=dtype_colour(d), label=f"{d}: ceiling")
    log_axis(ax.xaxis, base=2, ticks=batches)
    log_axis(ax.yaxis)
    ax.set_xlabel("requests decoding in one step")
    ax.set_ylabel("step time (ms)")
    ax.set_title("a decode step, by the weights' dtype")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig

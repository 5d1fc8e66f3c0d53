"""The engine explorer's picture (kvlab.workbook.explorer, kvlab.workbook.widgets): pure functions of a snapshot."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.legend_handler import HandlerTuple
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.transforms import offset_copy

from kvlab.workbook.explorer import CACHED, EngineSnapshot, FREE, HELD, NULL, SHARED
from kvlab.workbook.viz.axes import _colour
from kvlab.workbook.viz.memory_plots import format_block_tables


SHARED_COLOUR = "#37474f"  # a shared block belongs to several requests: no one request's colour
# The budget bar's: black, and white hatched black, so that no request's colour (axes._colour)
# is read as decode or prefill.
DECODE_COLOUR, PREFILL_COLOUR = "black", "white"
COPY_EDGE = "magenta"  # a copied block's edge: no request colour (axes._colour) is magenta
MAX_EVENTS_DRAWN = 12
# The smallest type in the picture, in points: at the 100 dpi the notebook draws at, 11 points
# are 15 px, and JupyterLab at 1280x720 with its sidebar open shows the picture at about 0.86 of
# its size: 13 px, over the 12 px a projector's back row needs (tests/workbook/test_browser.py
# measures it; 10 points came to 11.97 px there).
FONT_PT = 11
LINE_PT = 15  # the text lines' spacing
LEFT_WRAP, RIGHT_WRAP, RIGHT_X = 60, 40, 0.62  # characters a line, and where the right column starts


def format_queues(snap: EngineSnapshot) -> str:
    """The queues as text, one line each: the explorer's widget shows it under its buttons, and
    the picture repeats it."""

    def describe(rid: str) -> str:
        r = snap.requests[rid]
        mark = {"preempted": " (preempted)",
                "waiting_for_remote_kvs": " (waiting for its KV to load)"}.get(r.status, "")
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


def _ink_on(fill) -> str:
    """Text colour readable on `fill` (an RGB(A) tuple): white on a dark colour, dark grey on a
    light one (relative luminance, ITU-R BT.709 weights)."""
    r, g, b = fill[:3]
    return "white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5 else "0.25"


def _text_lines(ax, x: float, lines: list[tuple[str, object]]) -> None:
    """Monospace lines from the top of `ax`, each in its own colour (FONT_PT type, LINE_PT
    apart: read from the back of a room)."""
    for i, (line, colour) in enumerate(lines):
        ax.text(x, 1, line, va="top", family="monospace", fontsize=FONT_PT, color=colour,
                transform=offset_copy(ax.transAxes, fig=ax.figure, y=-LINE_PT * i,
                                      units="points"))


def _legend_entries(snap: EngineSnapshot) -> tuple[list, list[str]]:
    """The pool legend's swatches and labels."""
    # The legend names what is on screen: free and held always, the states of later chapters
    # (cached, shared, copied, keyed) only once a block is in them, so chapter 01's explorer
    # does not list chapter 05's.
    present = {b.state for b in snap.blocks}
    # Each swatch is drawn as its blocks are: "held" half solid (K/V written), half hatched.
    grey = (0.4, 0.4, 0.4)
    states = [Patch(fc="white", ec="0.75"),
              (Patch(fc=grey, ec="none"), Patch(fc=(*grey, 0.3), ec="none", hatch="////"))]
    labels = ["free", "held by a request (solid: K/V written)"]
    if NULL in present:
        states.append(Patch(fc="black"))
        labels.append("block 0: vLLM's null block, never handed out")
    if CACHED in present:
        states.append(Patch(fc="0.88", ec="0.4", ls=":", hatch=".."))
        labels.append("cached, free (evictable)")
    if SHARED in present:
        states.append(Patch(fc=SHARED_COLOUR))
        labels.append("shared (xN: ref count)")
    if any(b.just_copied for b in snap.blocks):
        states.append(Patch(fc="white", ec=COPY_EDGE, lw=2))
        labels.append("just copied (copy-on-write)")
    if any(b.key is not None for b in snap.blocks):
        states.append(Line2D([], [], marker="o", ls="none", color="black", ms=4))
        labels.append("dot: has a prefix-cache key")
    return states, labels


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
    rows = -(-n // columns)
    left, right = _queue_and_table_lines(snap), _event_lines(snap)
    states, labels = _legend_entries(snap)
    # The numbers left of the grid: each row's first block id (blocks count left to right).
    states.append(Line2D([], [], ls="none"))
    labels.append(f"0, {columns}, ...: the row's first block id")
    fig, ax_pool, ax_budget, ax_text, strip = _layout(rows, columns, len(states),
                                                      max(len(left), len(right)))
    for b in snap.blocks:
        _draw_block(ax_pool, snap, b, columns, rows)
    _finish_pool(ax_pool, snap, columns, rows, strip, (states, labels), title)
    _draw_budget(ax_budget, snap)
    ax_text.axis("off")
    _text_lines(ax_text, 0, left)
    _text_lines(ax_text, RIGHT_X, right)
    return fig


def _queue_and_table_lines(snap: EngineSnapshot) -> list[tuple[str, object]]:
    """The text's left column: the key to the queue lines, the queues, then the block tables,
    each in its request's colour."""
    black = "black"
    left = [("a [k/n tokens in KV, i/m out]: K/V written for k", "0.35"),
            ("    of request a's n tokens; i of its m new tokens made", "0.35")]
    left += [(line, black) for q in format_queues(snap).splitlines()
            for line in textwrap.wrap(q, LEFT_WRAP, subsequent_indent="    ")]
    left += [("", black), ("block tables (logical -> physical block):", black)]
    if snap.groups:  # a hybrid model: one table per KV cache group, 0 the null block
        left.append(("  " + ", ".join(f"g{g}: {name}" for g, name in enumerate(snap.groups)),
                     black))
    refs = [b.ref_cnt for b in snap.blocks]
    for rid, table in snap.block_tables.items():
        per_group = ({f"{rid} g{g}": t for g, t in enumerate(table)}
                     if isinstance(table, tuple) else {rid: table})
        text = format_block_tables(per_group, max_entries=16, ref_cnts=refs)
        left += [(line, _block_colour(snap, rid))
                 for line in textwrap.wrap(text, LEFT_WRAP, subsequent_indent="    ")]
    if not snap.block_tables:
        left.append(("(none)", black))
    if snap.tier_blocks:  # chapter 10: the second tier, a file
        left += [("", black), (f"tier: {len(snap.tier_keys)} of {snap.tier_blocks} blocks hold "
                               "K/V (a file behind the pool)", black)]
    return left


def _event_lines(snap: EngineSnapshot) -> list[tuple[str, object]]:
    """The text's right column: the step's last MAX_EVENTS_DRAWN events."""
    black = "black"
    events = snap.events[-MAX_EVENTS_DRAWN:]
    right = [("events", black)]
    if len(snap.events) > len(events):
        right.append((f"... {len(snap.events) - len(events)} earlier", black))
    right += [(line, black) for e in events
              for line in textwrap.wrap(str(e), RIGHT_WRAP, subsequent_indent="    ")]
    if not events:
        right.append(("(none)", black))
    return right


def _layout(rows: int, columns: int, legend_entries: int, text_lines: int):
    """The figure and its three axes (pool, budget, text), each as tall as what it holds, and
    the height of the legend's strip below the grid, in the grid's units (a block is one)."""
    small = columns == 16
    legend_rows = -(-legend_entries // 3)
    # A legend row of FONT_PT type is about 0.2 inch, and a unit 0.56 or 0.29 inch.
    strip = 0.3 + legend_rows * (0.4 if small else 0.75)
    # The budget bar is one thin line: it shows three numbers, so it gets a line's height,
    # not a panel's (a third of the picture for a few tokens drew the eye away from the pool).
    heights = [(rows + strip) * (0.56 if small else 0.29), 0.22,
               LINE_PT / 72 * text_lines + 0.1]
    fig = plt.figure(figsize=(10, sum(heights) + 1.0))
    grid = fig.add_gridspec(3, 1, height_ratios=heights, hspace=0.35, left=0.02, right=0.98,
                            top=0.95, bottom=0.02)
    ax_pool, ax_budget, ax_text = (fig.add_subplot(grid[i]) for i in range(3))
    return fig, ax_pool, ax_budget, ax_text, strip


def _draw_block(ax, snap: EngineSnapshot, b, columns: int, rows: int) -> None:
    """One block of the grid, as the docstring of draw_snapshot describes its states."""
    small = columns == 16
    x, y = b.block_id % columns, rows - 1 - b.block_id // columns
    state, gid = b.state, f"block-{b.block_id}"
    edge, lw = (COPY_EDGE, 2.5) if b.just_copied else ("0.4", 0.6)
    if state == NULL:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, fc="black", ec="black", lw=0.6, gid=gid))
        return
    if state == FREE:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, fc="white", ec="0.75", lw=0.6, gid=gid))
    elif state == CACHED:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, fc="0.88", ec="0.4", lw=0.8, ls=":",
                               hatch="..", gid=gid))
    elif state == SHARED:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, fc=SHARED_COLOUR, ec=edge, lw=lw, gid=gid))
        ax.text(x + 0.45, y + 0.45, f"x{b.ref_cnt}", ha="center", va="center",
                color="white", fontsize=FONT_PT, fontweight="bold")
    else:
        c = _block_colour(snap, b.owners[0])
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, fc=(*c[:3], 0.3), ec=edge, lw=lw,
                               hatch="////", gid=gid))
        ax.add_patch(Rectangle((x, y), 0.9 * b.num_filled / snap.block_size, 0.9,
                               fc=c, ec="none"))
    if b.key is not None:  # keyed: findable by the prefix cache
        ax.plot([x + 0.78], [y + 0.78], marker="o", ms=2.5 if small else 1.5,
                color="white" if state == SHARED else "black")
    if state == HELD:
        # The owner's name in the block's upper half, so that two requests whose colours are
        # near (tab10's blue and cyan, olive and goldenrod) are told apart by more than hue.
        under = (_block_colour(snap, b.owners[0])
                 if 2 * b.num_filled >= snap.block_size else (1, 1, 1))
        label = b.owners[0] if b.group is None else f"{b.owners[0]} g{b.group}"
        ax.text(x + 0.06, y + 0.84, label, va="top", fontsize=FONT_PT,
                color=_ink_on(under), gid=f"owner-{b.block_id}")
    if small and state != SHARED:
        # The id sits in the block's lower left: over the solid part once a third of the
        # block holds K/V, else over the pale part (the colour at 30% on white: light).
        under = (_block_colour(snap, b.owners[0])
                 if state == HELD and 3 * b.num_filled >= snap.block_size else (1, 1, 1))
        ax.text(x + 0.06, y + 0.08, str(b.block_id), fontsize=FONT_PT, color=_ink_on(under))


def _finish_pool(ax, snap: EngineSnapshot, columns: int, rows: int, strip: float, legend,
                 title: str | None) -> None:
    """The grid's row numbers, its frame and title (the counts of the states on screen), and
    its legend in the strip right under it."""
    for r in range(rows):
        ax.text(-0.2, rows - 1 - r + 0.45, str(r * columns), ha="right", va="center",
                fontsize=FONT_PT, color="0.3")
    ax.set_xlim(-1, columns)
    ax.set_ylim(-strip, rows)  # the strip below the grid holds the legend
    ax.set_aspect("equal")
    ax.axis("off")
    # Counts of the states on screen only (held and free always), like the legend below.
    counts = ", ".join(f"{snap.count(s)} {s}" for s in (HELD, SHARED, CACHED, FREE)
                       if s in (HELD, FREE) or snap.count(s))
    # The precision only where it is not the model's own (chapter 08): bytes a token, blocks.
    precision = ("" if snap.kv_cache_dtype == "auto" else
                 f", kv_cache_dtype {snap.kv_cache_dtype}: {snap.kv_bytes_per_token:,} bytes/token"
                 f" x {snap.block_size} a block, {len(snap.blocks)} blocks")
    ax.set_title(title or f"KV pool after step {snap.step} ({snap.kv_layout}, block_size "
                 f"{snap.block_size}{precision}): {counts}", fontsize=FONT_PT + 1)
    states, labels = legend
    # Large enough for a projector: at most three entries a row.
    # Right under the grid, so that no empty band separates the blocks from their key.
    ax.legend(states, labels, fontsize=FONT_PT, loc="upper center",
              bbox_to_anchor=(0.5, (strip - 0.1) / (rows + strip)),
              ncol=min(len(states), 3), frameon=False, handlelength=1.6,
              borderaxespad=0.1, handler_map={tuple: HandlerTuple(ndivide=2, pad=0)})


def _draw_budget(ax, snap: EngineSnapshot) -> None:
    """The last step's token budget as one bar: decode (black), prefill (hatched), unused."""
    budget, dec, pre = snap.token_budget, snap.num_decode_tokens, snap.num_prefill_tokens
    unused = max(budget - dec - pre, 0)
    # A used part is at least a sliver wide, so one decode token shows in a budget of 8,192.
    sliver = 0.006 * max(budget, dec + pre, 1)
    w_dec, w_pre = (max(n, sliver) if n else 0 for n in (dec, pre))
    ax.barh([0], [w_dec], height=0.6, color=DECODE_COLOUR, gid="budget-decode")
    ax.barh([0], [w_pre], left=[w_dec], height=0.6, color=PREFILL_COLOUR, ec="black",
            hatch="////", lw=0.6, gid="budget-prefill")
    ax.barh([0], [max(unused - (w_dec - dec) - (w_pre - pre), 0)], left=[w_dec + w_pre],
            height=0.6, color="white", ec="0.6", gid="budget-unused")
    ax.set_xlim(0, max(budget, dec + pre, 1))
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.tick_params(axis="x", labelsize=FONT_PT)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"last step's token budget: {dec} decode (black) + {pre} prefill "
                 f"(hatched), {unused} unused of max_num_batched_tokens={budget}",
                 fontsize=FONT_PT)

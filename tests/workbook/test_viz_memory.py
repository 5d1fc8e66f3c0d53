"""Figures of chapters 01-02: the memory map's legends and colours, and plots whose series must
stay told apart where they coincide."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from kvlab.workbook import viz  # noqa: E402
from kvlab.kv_cache import NULL_BLOCK_OWNER, KVCacheManager  # noqa: E402


def test_memory_map_names_its_states_and_gives_16_requests_16_colours():
    m = KVCacheManager(num_blocks=40, block_size=4, max_model_len=16)
    tokens = {f"r{i}": 1 + i % 6 for i in range(16)}
    for rid, n in tokens.items():
        assert m.allocate_slots(rid, n)
    ax = viz.draw_memory_map(m.memory_map(tokens), 4, "paged", columns=10)
    legends = [a for a in ax.get_children() if isinstance(a, matplotlib.legend.Legend)]
    texts = {t.get_text() for lg in legends for t in lg.get_texts()}
    assert {"tokens", "free"} <= texts
    assert {t.split(":")[0] for t in texts} >= {"reserved", "internal waste", "external"}
    requests = next(lg for lg in legends if "r0" in {t.get_text() for t in lg.get_texts()})
    colours = [tuple(h.get_facecolor()) for h in requests.legend_handles]
    assert len(colours) == 16 and len(set(colours)) == 16  # tab10 would repeat after ten
    plt.close(ax.figure)
    ax = viz.draw_memory_map(m.memory_map(tokens), 4, "paged", state_legend=False)
    texts = {t.get_text() for a in ax.get_children()
             if isinstance(a, matplotlib.legend.Legend) for t in a.get_texts()}
    assert "free" not in texts and "r15" in texts
    plt.close(ax.figure)


def test_the_three_wastes_are_three_different_marks():
    """Chapter 01's tiny pool: reservation (slots for tokens still to come), internal waste
    (slots past the request's end) and external fragmentation (free blocks in a gap too short
    for a region) are each counted by the manager and drawn with a look of their own."""
    from kvlab.kv_cache import ContiguousKVCacheManager

    # Block 0 + 14 usable, as chapter 01: block 0 is vLLM's null block, so A, B and C take the
    # 16-slot regions 1-4, 5-8 and 9-12, and 13-14 are left in a gap too short for a region.
    m = ContiguousKVCacheManager(num_blocks=15, block_size=4, max_model_len=16)
    now, end = {"A": 5, "B": 9, "C": 2}, {"A": 9, "B": 12, "C": 15}
    for rid, n in now.items():
        assert m.allocate_slots(rid, n)
    mm = m.memory_map(now, end)
    assert [b for b, (o, *_) in enumerate(mm) if o == NULL_BLOCK_OWNER] == [0]
    filled, reserved = sum(f for _, f, _ in mm), sum(r for _, _, r in mm)
    held = sum(4 for o, *_ in mm if o not in (None, NULL_BLOCK_OWNER))  # the null block: no one's
    assert (filled, reserved, held - filled - reserved) == (16, 20, 12)
    assert m.unusable_free_blocks() == {13, 14} and m.usable_free_slots() == 0
    ax = viz.draw_memory_map(mm, 4, "contiguous", columns=15,
                             unusable_free=m.unusable_free_blocks())
    looks = {(p.get_hatch(), round(p.get_facecolor()[3], 2)) for p in ax.patches}
    assert {("////", 0.35), ("..", 0.08)} <= looks  # reserved and internal waste differ
    greys = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("0.82")]
    assert len(greys) == 2  # the two unusable free blocks, drawn apart from the usable ones
    plt.close(ax.figure)


def test_the_null_block_is_drawn_black_in_its_own_row_and_left_out_of_the_slots():
    """Block 0, vLLM's null block, is never handed out: draw_memory_map draws it black in a row
    of its own above the grid, labelled beside it (not again in the legend), and counts its slots
    neither held nor in the pool's total. The grid's rows start at blocks 1, 1 + columns, ..."""
    m = KVCacheManager(num_blocks=8, block_size=4, max_model_len=16)
    assert m.allocate_slots("a", 6)
    assert m.get_block_ids("a") == [1, 2]
    mm = m.memory_map({"a": 6})
    assert mm[0] == (NULL_BLOCK_OWNER, 0, 0)
    ax = viz.draw_memory_map(mm, 4, "paged", columns=4)
    black = [p for p in ax.patches if matplotlib.colors.same_color(p.get_facecolor(), "black")]
    # Two rows of 4 (blocks 1-4 and 5-7) and the null block's row above them.
    assert len(black) == 1 and black[0].get_xy()[0] == 0 and black[0].get_xy()[1] > 2
    first = [p for p in ax.patches if p.get_xy() == (0, 1)]  # row 1's first square: block 1
    assert first and matplotlib.colors.same_color(first[0].get_facecolor(), viz.axes._colour(0))
    texts = [t.get_text() for t in ax.texts]
    assert "block 0: vLLM's null block, never handed out" in texts
    assert [t for t in texts if t.isdigit()] == ["1", "5"]  # each row's first block id
    # 7 usable blocks of 4: 28 slots, not 32; a's 6 tokens in its 2 blocks' 8 slots.
    assert ax.get_title() == "paged: 1 requests, 6 tokens in 8 held slots of 28"
    legends = [a for a in ax.get_children() if isinstance(a, matplotlib.legend.Legend)]
    states = next(lg for lg in legends if "free" in {t.get_text() for t in lg.get_texts()})
    assert not [t for t in states.get_texts() if "null" in t.get_text()]  # named once, by its square
    requests = next(lg for lg in legends if lg is not states)
    assert [t.get_text() for t in requests.get_texts()] == ["a"]  # no request called "null"
    assert min(t.get_fontsize() for lg in legends for t in lg.get_texts()) >= 9
    assert min(t.get_fontsize() for t in ax.texts) >= 9 and ax.title.get_fontsize() >= 9
    plt.close(ax.figure)


def test_the_simulation_figure_draws_every_layout_over_every_step():
    """Both layouts on one step axis from step 0 to their last request's finish (not only the
    steps with a queue); the too-eager rule dashed in the paged colour; labels of 9 pt or more."""
    from kvlab.workbook import allocator_sim

    lengths = allocator_sim.request_lengths(30, 10, 512, seed=0)
    c = allocator_sim.simulate(lengths, "contiguous", 4096, 512)
    p = allocator_sim.simulate(lengths, "paged", 4096, 512)
    e = allocator_sim.simulate(lengths, "paged", 4096, 512, admission="one-block")
    fig = viz.plot_sim(c, p, e)
    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2]
        assert [len(ln.get_xdata()) for ln in lines] == [c.num_steps, p.num_steps, e.num_steps]
        assert all(list(ln.get_xdata()) == list(range(len(ln.get_xdata()))) for ln in lines)
        assert lines[1].get_color() == lines[2].get_color() != lines[0].get_color()
        assert lines[2].get_linestyle() == "--" and lines[1].get_linestyle() == "-"
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[2].startswith("paged, one-block rule")
        assert min(t.get_fontsize() for t in ax.get_legend().get_texts() + ax.texts) >= 9
        assert min(t.get_fontsize() for t in ax.get_xticklabels() + [ax.xaxis.label]) >= 9
    plt.close(fig)


def test_coinciding_savings_series_are_drawn_apart_and_named():
    rows = [{"kind": kind, "prompt_len": 32, "k": k, "saved": 0.1 * k}
            for kind in ("beam", "sampling") for k in (2, 4, 8)]
    fig = viz.plot_cow_savings(rows)
    (ax,) = fig.axes
    beam, sampling = ax.get_lines()
    assert beam.get_marker() != sampling.get_marker()
    assert beam.get_linestyle() != sampling.get_linestyle()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[1] == "sampling, prompt 32 (same as beam, prompt 32)"
    plt.close(fig)


def test_blocks_per_step_runs_have_their_own_marker_and_style():
    fig = viz.plot_blocks_per_step({"a": [1, 2, 2], "b": [1, 2, 3]})
    a, b = fig.axes[0].get_lines()
    assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())
    assert a.get_color() != b.get_color()
    plt.close(fig)


def test_parallel_sampling_plot_labels_every_bar():
    modes = ["fork", "child requests", "unshared"]
    rows = [{"prompt_len": L, "n": n, "mode": mode, "peak_blocks": L // 16 + i * n,
             "prompt_tokens_computed": L * (1 + i * (n - 1))}
            for L in (32, 512) for n in (2, 4) for i, mode in enumerate(modes)]
    fig = viz.plot_parallel_sampling(rows)
    assert len(fig.axes) == 4
    top_left = fig.axes[0]
    heights = sorted(round(p.get_height()) for p in top_left.patches)
    assert heights == sorted(r["peak_blocks"] for r in rows if r["prompt_len"] == 32)
    labels = [t.get_text() for t in top_left.texts]
    assert len(labels) == 6 and "2" in labels
    assert [t.get_text() for t in fig.legends[0].get_texts()] == modes
    plt.close(fig)

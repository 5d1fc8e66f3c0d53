"""Every figure is a pure function, and every slider's function works without a browser."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import ipywidgets  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab.workbook import allocator_sim, viz, widgets  # noqa: E402
from kvlab.kv_cache import KVCacheManager  # noqa: E402
from tests.helpers import assert_no_text_under  # noqa: E402


def test_figures_draw():
    lengths = allocator_sim.request_lengths(20, seed=1)
    c, p = allocator_sim.simulate(lengths, "contiguous", 2048, 512), allocator_sim.simulate(lengths, "paged", 2048, 512)
    m = KVCacheManager(num_blocks=8, block_size=4, max_model_len=16)
    m.allocate_slots("a", 6)
    figs = [
        viz.plot_kv_memory(46_080, [128, 256], [1, 4], budget_bytes=2**30),
        viz.plot_sim(c, p),
        viz.plot_block_size_tradeoff(lengths, 16),
        viz.draw_memory_map(m.memory_map({"a": 6}), 4, "paged").figure,
    ]
    for fig in figs:
        assert fig.axes
        plt.close(fig)
    assert "a:" in viz.format_block_tables({"a": m.get_block_ids("a")})
    m.fork("a", "b")
    refs = [b.ref_cnt for b in m.block_pool.blocks]
    # a's blocks are 1 and 2: block 0 is vLLM's null block, never handed out.
    assert "[1(x2), 2(x2)]" in viz.format_block_tables({"b": m.get_block_ids("b")}, ref_cnts=refs)
    rows = [{"kind": "beam", "prompt_len": 32, "k": k, "saved": 0.1 * k} for k in (2, 4)]
    for fig in (viz.plot_blocks_per_step({"x": [1, 3, 2]}), viz.plot_cow_savings(rows)):
        assert fig.axes
        plt.close(fig)
    assert viz.format_bytes(3 * 2**30) == "3.0 GiB"


def test_block_size_summary_changes_with_the_slider_value():
    lengths = allocator_sim.request_lengths(50, seed=0)
    assert viz.block_size_summary(lengths, 1) != viz.block_size_summary(lengths, 128)
    w = widgets.block_size_slider(lengths, value=16)
    slider = w.children[0]
    assert isinstance(slider, ipywidgets.IntSlider) and slider.value == 16
    slider.value = 32  # what dragging does: the controls redraw the outputs
    assert w.children[-1].value == ""  # no failure reported
    plt.close("all")


def test_scheduling_figures_draw():
    from kvlab.bench.scheduling import StallRun
    from kvlab.metrics import StepRecord

    steps = [StepRecord(i, ["a", "b"][: 1 + i % 2], 0, 2, 2, 0, 4, 10, 0, 0.1, 0.09)
             for i in range(1, 5)]
    rows = [{"server": "default", "concurrency": c, "tok_s": 10.0 * c, "tok_s_spread": [9.0 * c, 11.0 * c],
             "ttft_median_ms": 5.0 * c, "preemptions": 0} for c in (1, 4)]
    stall = [StallRun(b, [0.0, 0.1, 0.5, 0.6], 0.15, 0.4, 0.4, 3) for b in (64, None)]
    figs = [
        viz.plot_gantt({"static": steps, "continuous": steps}),
        viz.plot_concurrency(rows),
        viz.plot_capacity({"rows": rows, "predicted_knee": 2, "kv_tokens": 128}),
        viz.plot_stall(stall),
        viz.plot_gap_vs_budget(stall, 500.0, 0.03, fit=(0.01, 0.002, 0.99)),
    ]
    for fig in figs:
        assert fig.axes
        plt.close(fig)


def test_gantt_draws_a_run_of_steps_as_one_bar_and_labels_a_back_row_can_read():
    """A request that ran in consecutive steps is one bar as wide as its run, with no seam per
    step; a request that waited between two runs (preempted) is two bars."""
    from matplotlib.collections import PolyCollection

    from kvlab.metrics import StepRecord

    who = {1: ["a", "b"], 2: ["a", "b"], 3: ["a"], 4: ["a", "b"]}
    steps = [StepRecord(i, ids, 0, len(ids), len(ids), 0, 4, 10, 0, 0.1, 0.09)
             for i, ids in who.items()]
    fig = viz.plot_gantt({"run": steps})
    ax = fig.axes[0]
    bars = [c for c in ax.collections if isinstance(c, PolyCollection)]
    extents = [[(round(p.get_extents().x0, 6), round(p.get_extents().width, 6))
                for p in c.get_paths()] for c in bars]
    assert extents == [[(0, 4)], [(0, 2), (3, 1)]]
    plt.close(fig)


def test_chapter_03_and_04_figures_read_from_the_back_row():
    """Every text on the scheduling figures (03's Gantt chart, concurrency and capacity sweeps;
    04's decode gaps and gap against budget) is at least 9 pt."""
    from kvlab.bench.scheduling import StallRun

    from kvlab.metrics import StepRecord

    steps = [StepRecord(i, ["r0", "r1"][: 1 + i % 2], 0, 2, 2, 0, 4, 10, 0, 0.1, 0.09)
             for i in range(1, 9)]
    rows = [{"server": s, "concurrency": c, "tok_s": 10.0 * c, "tok_s_spread": [9.0 * c, 11.0 * c],
             "ttft_median_ms": 5.0 * c, "preemptions": 2 if c == 16 else 0}
            for s, cs in (("max_num_seqs=1", (1, 16)), ("default", (1, 4, 16))) for c in cs]
    default = [r for r in rows if r["server"] == "default"]
    figs = {"gantt": viz.plot_gantt({"static": steps, "continuous": steps}),
            "concurrency": viz.plot_concurrency(rows),
            "capacity": viz.plot_capacity({"rows": default, "predicted_knee": 4, "kv_tokens": 256},
                                          dict(default[-1], preemptions=0))}
    stall = [StallRun(b, [0.0, 0.1, 0.5, 0.6], 0.15, 0.4, 0.4, 3) for b in (64, 128, None)]
    figs["stall"] = viz.plot_stall(stall)
    figs["gap"] = viz.plot_gap_vs_budget(stall, 500.0, 0.03, fit=(0.01, 0.002, 0.99))
    assert_no_text_under(figs)


def test_prefix_figures_and_text():
    text = viz.format_hash_chain({"A": list(range(10)), "B": list(range(9)) + [99]}, 4,
                                 salts={"B": "s"})
    assert "partial block" in text and "=" not in text.split("\n")[1]  # salted: nothing shared
    same = viz.format_hash_chain({"A": list(range(10)), "B": list(range(9)) + [99]}, 4)
    assert same.split("\n")[1].count("=") == 2  # 9 shared tokens: two full blocks
    rows = [{"a_sent": i % 2 == 0, "ttft_ms": 10.0 + 100 * (i % 2), "cached": 0} for i in range(4)]
    ax = viz.plot_ttft_attack({"rows": rows, "threshold_ms": 50.0, "salted": True,
                               "accuracy": 0.5})
    assert ax.figure.axes
    plt.close(ax.figure)
    w = widgets.hash_chain_slider({"A": [1, 2, 3], "B": [1, 2, 4]})
    w.children[0].value = 2
    assert w.children[-1].value == ""


def test_peers_figure_labels_every_bar():
    peers = {"rows": {"kvlab": {"useful_tok_s": 220.0}, "transformers generate": {
        "useful_tok_s": 130.0}}, "useful_tokens": 1800}
    ceiling = {"ceiling": {"batch": 16, "context": 128, "compute_bound_tok_s": 700.0,
                           "memory_bound_tok_s": 2000.0}, "kvlab_decode_tok_s": 420.0,
               "fraction_of_ceiling": 0.6}
    fig = viz.plot_peers(peers, ceiling)
    left, right = fig.axes
    assert [t.get_text() for t in left.get_yticklabels()] == list(peers["rows"])
    assert [round(b.get_height()) for b in right.patches] == [700, 2000, 420]
    assert "60% of the lower limit" in right.get_title()
    plt.close(fig)


def _log_tick_labels(fig) -> list[str]:
    """The visible tick labels of every log-scaled axis of a drawn figure."""
    fig.canvas.draw()
    labels = []
    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                lo, hi = sorted(axis.get_view_interval())
                labels += [t.get_text() for t in axis.get_ticklabels()
                           if t.get_text() and lo <= t.get_position()[axis is ax.yaxis] <= hi]
    return labels


def test_log_axes_are_labelled_in_plain_numbers():
    """No 10^n or 2^n on any log axis a chapter shows: the labels read as numbers, and each
    log axis has at least two of them, so a reader can place a point without counting decades."""
    from kvlab.bench.scheduling import StallRun

    lengths = allocator_sim.request_lengths(100, 10, 512, seed=0)
    rows = [{"server": "default", "concurrency": c, "tok_s": 10.0 * c,
             "tok_s_spread": [9.0 * c, 11.0 * c], "ttft_median_ms": 5.0 * c, "preemptions": 0}
            for c in (1, 4, 16)]
    stall = [StallRun(b, [0.0, 0.1, 0.5, 0.6, 2.4, 2.5], 0.15, 2.3, 1.8, 3) for b in (64, None)]
    attack = [{"a_sent": i % 2 == 0, "ttft_ms": 30.0 + 300 * (i % 2), "cached": 0}
              for i in range(6)]
    cold_warm = [{"enable_prefix_caching": on, "prefix_len": 2048, "tail_len": 32,
                  "cold_ttft_ms": 2332.2, "warm_ttft_ms": 69.2 if on else 2242.1,
                  "warm_ttft_ms_range": [60.0, 80.0] if on else [2200.0, 2300.0],
                  "speedup": 33.7 if on else 1.04} for on in (True, False)]
    figs = {"block size": viz.plot_block_size_tradeoff(lengths, 16),
            "concurrency": viz.plot_concurrency(rows), "stall": viz.plot_stall(stall),
            "attack": viz.plot_ttft_attack({"rows": attack, "threshold_ms": 100.0,
                                            "salted": False, "accuracy": 1.0}).figure}
    bars = viz.plot_cold_warm_ttft(cold_warm)
    assert bars.get_yscale() == "linear"  # a bar chart: a bar's length is its value
    plt.close(bars.figure)
    for name, fig in figs.items():
        labels = _log_tick_labels(fig)
        assert len(labels) >= 2, (name, labels)
        for label in labels:
            assert "$" not in label and "^" not in label, (name, label)
            float(label.replace(",", ""))  # a plain number
        plt.close(fig)


def _boxes(artists, renderer):
    return [a.get_window_extent(renderer) for a in artists if a.get_visible() and a.get_text()]


def _any_overlap(boxes) -> bool:
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_api_figure_reads_at_a_glance():
    """Chapter 07's API figure: the salt table's x labels do not overlap, the TTFT line's points
    sit inside the frame, and no legend covers a bar's label."""
    salts = [("tenant-a", 0, 977.0), ("tenant-a", 224, 246.0), ("tenant-b", 0, 1085.0),
             ("tenant-b", 224, 314.0), ("none", 0, 1130.0)]
    results = {
        "concurrency": [{"concurrency": 1, "tok_s": 4.6, "ttft_median_ms": 408.6},
                        {"concurrency": 2, "tok_s": 6.3, "ttft_median_ms": 683.5}],
        "prefix-cache": [{"prompt_tokens": 252, "cold_ttft_ms": 1056.8, "warm_ttft_ms": 306.7,
                          "after_reset_ttft_ms": 968.7}],
        "cache-salt": [{"experiment": "salt table", "order": i + 1, "cache_salt": s,
                        "cached_tokens": c, "ttft_ms": t} for i, (s, c, t) in enumerate(salts)]}
    fig = viz.plot_api_run(results)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    conc, twin = fig.axes[0], fig.axes[-1]  # twinx() adds its axes last
    salt_ax = fig.axes[2]
    assert not _any_overlap(_boxes(salt_ax.get_xticklabels(), renderer))
    assert max(twin.lines[0].get_ydata()) < twin.get_ylim()[1]  # not on the frame
    assert max(b.get_height() for b in conc.patches) < conc.get_ylim()[1]
    # The bars' labels sit clear of the TTFT line: no point along it falls inside one.
    xy = twin.transData.transform(twin.lines[0].get_xydata())
    along = [xy[i] + t * (xy[i + 1] - xy[i]) for i in range(len(xy) - 1)
             for t in [k / 50 for k in range(51)]]
    labels = _boxes(conc.texts, renderer)
    assert len(labels) == 2 and all("tok/s" in t.get_text() for t in conc.texts)
    assert not any(box.contains(x, y) for box in labels for x, y in along)
    legend = salt_ax.get_legend().get_window_extent(renderer)
    assert not any(legend.overlaps(b) for b in _boxes(salt_ax.texts, renderer))
    # The hatched bar is named, and its legend covers no bar's label either.
    prefix_ax = fig.axes[1]
    assert [t.get_text() for t in prefix_ax.get_legend().get_texts()] == [
        "same prompt after\nreset_prefix_cache"]
    legend = prefix_ax.get_legend().get_window_extent(renderer)
    assert not any(legend.overlaps(b) for b in _boxes(prefix_ax.texts, renderer))
    colours = {b.get_facecolor() for b in salt_ax.patches}
    assert len(colours) == 2  # hits and misses told apart
    plt.close(fig)


def test_roofline_legend_covers_no_bar_label():
    rows = [{"batch": b, "context": 128, "step_ms": 10.0 * b, "tok_s": 100.0,
             "ceiling_ms_mm": 3.7 * b, "ceiling_ms_peak": 3.1 * b, "fraction_mm": 0.37,
             "fraction_peak": 0.31} for b in (1, 4, 16, 64)]
    fig = viz.plot_roofline_sweep({"context": 128, "rows": rows})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax2 = fig.axes[1]
    legend = ax2.get_legend().get_window_extent(renderer)
    assert not any(legend.overlaps(b) for b in _boxes(ax2.texts, renderer))
    plt.close(fig)


def test_attack_plots_share_one_scale_with_labelled_ticks():
    attack = {"rows": [{"a_sent": i % 2 == 0, "ttft_ms": 120.0 if i % 2 == 0 else 640.0,
                        "cached": 0} for i in range(6)],
              "threshold_ms": 380.0, "salted": False, "accuracy": 1.0}
    defended = {"rows": [{"a_sent": i % 2 == 0, "ttft_ms": 600.0 + 10 * i, "cached": 0}
                         for i in range(6)], "threshold_ms": 380.0, "salted": True,
                "accuracy": 0.5}
    ax = viz.plot_ttft_attack(defended, same_scale_as=attack)
    lo, hi = ax.get_ylim()
    assert lo < 120.0 and hi > 650.0  # the unsalted run's hits are on this scale too
    ax.figure.canvas.draw()
    ticks = [t for t in ax.get_yticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert len(ticks) >= 3  # a log axis with one labelled tick reads as no scale
    plt.close(ax.figure)


def test_capacity_figure_draws_the_control_beside_the_sweep():
    rows = [{"concurrency": c, "tok_s": t, "ttft_median_ms": m, "preemptions": p}
            for c, t, m, p in ((4, 33.0, 520.0, 0), (16, 63.0, 1800.0, 0), (32, 57.0, 2500.0, 5))]
    control = {"concurrency": 32, "tok_s": 75.0, "ttft_median_ms": 3300.0, "preemptions": 0}
    fig = viz.plot_capacity({"rows": rows, "predicted_knee": 16, "kv_tokens": 1024}, control)
    tok_ax, ttft_ax = fig.axes
    for ax, value in ((tok_ax, 75.0), (ttft_ax, 3300.0)):
        (mark,) = [l for l in ax.lines if l.get_label().startswith("control")]
        assert list(mark.get_xdata()) == [32] and list(mark.get_ydata()) == [value]
        lo, hi = ax.get_ylim()
        assert value < hi - 0.05 * (hi - lo)  # the marker clear of the frame, not cut by it
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "KV budget 1,024 tokens" in labels and "control: KV for every request" in labels
    plt.close(fig)


def test_concurrency_legend_covers_no_point_or_whisker():
    """03's figure: the legend once sat over the top point's whisker ("best" does not count
    error bars as data). Every marker and whisker end stays outside both panels' legends."""
    rows = [{"server": "max_num_seqs=1", "concurrency": c, "tok_s": t, "tok_s_spread": [t, t],
             "ttft_median_ms": m} for c, t, m in ((1, 16.3, 120.0), (16, 20.5, 6100.0))]
    rows += [{"server": "default", "concurrency": c, "tok_s": t, "tok_s_spread": [t - d, t + d],
              "ttft_median_ms": m}
             for c, t, d, m in ((1, 21.0, 0.5, 110.0), (4, 61.0, 1.0, 300.0),
                                (16, 74.5, 14.0, 1900.0))]
    fig = viz.plot_concurrency(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        points = [ax.transData.transform(xy) for line in ax.lines for xy in line.get_xydata()]
        points += [ax.transData.transform(xy) for coll in ax.collections
                   for seg in coll.get_segments() for xy in seg]  # the whiskers' ends
        assert points and not any(legend.contains(x, y) for x, y in points), ax.get_ylabel()
    plt.close(fig)


def test_roofline_draws_one_ceiling_where_torch_mm_was_the_fastest_matmul():
    """Where torch.mm itself was the fastest matmul measured, the two ceilings coincide: one
    line and one set of bars, labelled so, not a dotted line hidden under a dashed one."""
    def rows(peak_factor):
        return [{"batch": b, "context": 64, "step_ms": 10.0 * b, "tok_s": 100.0,
                 "ceiling_ms_mm": 3.7 * b, "ceiling_ms_peak": 3.7 * b * peak_factor,
                 "fraction_mm": 0.37, "fraction_peak": 0.37 * peak_factor} for b in (1, 16, 64)]
    for factor, lines, bar_sets in ((1.0, 1, 1), (0.8, 2, 2)):
        fig = viz.plot_roofline_sweep({"context": 64, "rows": rows(factor)})
        ax1, ax2 = fig.axes[:2]
        ceilings = [l for l in ax1.get_lines() if l.get_label().startswith("ceiling")]
        assert len(ceilings) == lines and len(ax2.containers) == bar_sets, factor
        if lines == 1:
            assert "fastest matmul here" in ceilings[0].get_label()
            # One set of bars: named by the axis, no legend repeating it.
            assert ax2.get_legend() is None and "fastest matmul here" in ax2.get_ylabel()
        plt.close(fig)


def test_figures_say_what_their_marks_mean():
    """Each mark a cold reader asked about is explained on the figure itself: a series measured
    at fewer levels is dashed and names them, the whiskers are in the legend, the simulation
    marks where each layout finished and where its queue emptied, the free queue's colours have
    a legend, KL ticks are plain decimals, block ids stay readable on a dark block."""
    from kvlab.workbook.viz.snapshot import _ink_on

    rows = [{"server": "max_num_seqs=1", "concurrency": c, "tok_s": 20.0, "tok_s_spread": [20, 20],
             "ttft_median_ms": 100.0 * c} for c in (1, 16)]
    rows += [{"server": "default", "concurrency": c, "tok_s": 10.0 * c,
              "tok_s_spread": [9.0 * c, 11.0 * c], "ttft_median_ms": 5.0 * c} for c in (1, 4, 16)]
    fig = viz.plot_concurrency(rows)
    left = fig.axes[0]
    labels = [t.get_text() for t in left.get_legend().get_texts()]
    assert labels[0] == "max_num_seqs=1 (measured at 1, 16 only)", labels
    assert "whiskers" in labels[1] and "measured at" not in labels[1], labels
    assert left.lines[0].get_linestyle() == "--"
    plt.close(fig)

    lengths = allocator_sim.request_lengths(100, 10, 512, seed=0)
    c, p = (allocator_sim.simulate(lengths, layout) for layout in ("contiguous", "paged"))
    fig = viz.plot_sim(c, p)
    for ax in fig.axes:
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any(f"none waits after step {p.steps[-1]:,}" in t for t in texts), texts
        assert sum("all done" in t.get_text() for t in ax.texts) == 2
        assert ax.get_xlim()[1] >= max(c.num_steps, p.num_steps)
    plt.close(fig)

    snaps = [{"label": "a finished", "queue": [4, 5, 3], "in_use": [0],
              "keys": {3: "a3", 0: "b0"}}]
    ax = viz.draw_free_queue(snaps)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == ["free, still holds a block of prefix a", "free, still holds a block of prefix b",
                     "free, no prefix key", "in use by a request"]
    plt.close(ax.figure)

    from kvlab.workbook.viz import precision_plots
    kl_rows = [{"kv_cache_dtype": d, "requests_fit": n, "request_len": 512,
                "kv_cache_memory_bytes": 2**26, "bytes_per_token": b, "mean_kl": kl}
               for d, n, b, kl in (("auto", 2, 46080, 0.0), ("bfloat16", 5, 23040, 2.9e-5),
                                   ("int4", 20, 6480, 5.2e-2))]
    fig = precision_plots.plot_precision_tradeoff(kl_rows)
    kl_ticks = _log_tick_labels(fig)
    assert "0.0001" in kl_ticks and not any("e" in t for t in kl_ticks), kl_ticks
    plt.close(fig)

    assert _ink_on((0.12, 0.47, 0.71)) == "white"  # tab:blue, solid: a held block's fill
    assert _ink_on((1.0, 1.0, 1.0)) != "white"


def _contrast(a, b) -> float:
    """WCAG's contrast ratio of two colours (1 to 21; 4.5 is its floor for body text)."""
    def lum(c):
        lin = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4
               for x in matplotlib.colors.to_rgb(c)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_chapter_07_figures_read_from_the_back_row():
    """Every text on chapter 07's four figures (peers, roofline, serving peers, API run) is at
    least 9 pt, a label drawn on a bar reads against the bar's colour, and no legend runs out of
    its panel."""
    from matplotlib.text import Text

    peers = {"rows": {"kvlab": {"useful_tok_s": 72.0, "useful_tok_s_spread": [68.0, 75.0]},
                      "transformers generate": {"useful_tok_s": 41.0,
                                                "useful_tok_s_spread": [39.0, 44.0]}},
             "useful_tokens": 192, "repeats": 3}
    ceiling = {"ceiling": {"batch": 16, "context": 104, "compute_bound_tok_s": 700.0,
                           "memory_bound_tok_s": 900.0}, "kvlab_decode_tok_s": 260.0,
               "fraction_of_ceiling": 0.37}
    roof = [{"batch": b, "context": 64, "step_ms": 10.0 * b, "tok_s": 100.0,
             "ceiling_ms_mm": 3.7 * b, "ceiling_ms_peak": 3.1 * b, "fraction_mm": 0.37,
             "fraction_peak": 0.31, "bound_mm": "memory", "bound_peak": "memory"}
            for b in (1, 4, 16, 64)]
    serve = [{"server": s, "concurrency": c, "output_tok_s": t, "ttft_median_ms": 100.0 * c,
              "ttft_p90_ms": 120.0 * c, "itl_median_ms": 40.0, "itl_p90_ms": 45.0}
             for s, t in (("kvlab serve", 60.0), ("transformers serve", 45.0)) for c in (1, 8)]
    salts = [("tenant-a", 0, 977.0), ("tenant-a", 224, 246.0), ("none", 0, 1130.0)]
    api = {"concurrency": [{"concurrency": 1, "tok_s": 19.8, "ttft_median_ms": 131.7},
                           {"concurrency": 2, "tok_s": 33.3, "ttft_median_ms": 192.1}],
           "prefix-cache": [{"prompt_tokens": 252, "cold_ttft_ms": 379.3, "warm_ttft_ms": 80.1,
                             "after_reset_ttft_ms": 293.6}],
           "cache-salt": [{"experiment": "salt table", "order": i + 1, "cache_salt": s,
                           "cached_tokens": c, "ttft_ms": t}
                          for i, (s, c, t) in enumerate(salts)]}
    figs = {"peers": viz.plot_peers(peers, ceiling),
            "roofline": viz.plot_roofline_sweep({"context": 64, "rows": roof}),
            "serve peers": viz.plot_serve_peers(serve), "api run": viz.plot_api_run(api)}
    for name, fig in figs.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < 9]
        assert not small, (name, small)
        for ax in fig.axes:
            if ax.get_legend() is not None:  # a legend stays inside its panel, over no tick
                legend = ax.get_legend().get_window_extent(renderer)
                frame = ax.get_window_extent(renderer)
                assert frame.x0 - 1 <= legend.x0 and legend.x1 <= frame.x1 + 1, (name, ax.get_title())
            bars = [p for p in ax.patches if p.get_height() > 0 and p.get_width() > 0]
            for t in ax.texts:
                box = t.get_window_extent(renderer)
                x, y = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2
                for bar in bars:
                    if bar.get_window_extent(renderer).contains(x, y):
                        assert _contrast(t.get_color(), bar.get_facecolor()) >= 4.5, (
                            name, t.get_text(), t.get_color(), bar.get_facecolor())
        plt.close(fig)
    # The peers' whiskers reach each contender's slowest and fastest run.
    left = viz.plot_peers(peers, ceiling).axes[0]
    ends = sorted(x for coll in left.collections for seg in coll.get_segments()
                  for x in seg[:, 0])
    assert ends == [39.0, 44.0, 68.0, 75.0]
    plt.close(left.figure)


def test_hybrid_figure_and_table_read_at_a_glance():
    """Chapter 09: one line per kind of group, a legend of both, whole-number axes; the
    capacity table has a row per model and the columns it names."""
    rows = [{"tokens": t, "full": -(-t // 8), "window": min(-(-t // 8), 5), "window_table": []}
            for t in range(40, 100)]
    fig = viz.plot_blocks_per_group({"rows": rows, "window": 32, "block_size": 8})
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 2
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("full-attention" in s for s in labels) and any("window 32" in s for s in labels)
    assert all(float(t.get_text().replace("−", "-")).is_integer()
               for t in ax.get_yticklabels() if t.get_text())
    assert_no_text_under({"hybrid": fig})
    plt.close(fig)
    table = viz.format_capacity([
        {"model": "every layer full", "groups": 1, "num_blocks": 129, "kv_bytes": 2**20,
         "vllm_tokens": 1032, "vllm_concurrency": 4.03, "mean_running": 7.9, "preemptions": 7,
         "steps": 130}])
    head, row = table.splitlines()
    assert "preemptions" in head and "1,032" in row and "4.03x" in row


def test_offload_figures_read_at_a_glance():
    """Chapter 10: the sweep's two panels, the load-against-recompute lines and the pair's
    timeline each carry a legend of what is drawn and plain numbers on their axes."""
    rows = [{"tier_blocks": b, "hit_rate": h, "median_ttft_ms": t, "ceiling": 0.9}
            for b, h, t in ((0, 0.0, 340.0), (30, 0.0, 330.0), (60, 0.5, 170.0))]
    fig = viz.plot_tier_sweep(rows, doc_blocks=15)
    assert len(fig.axes) == 2 and all(ax.get_legend() for ax in fig.axes)
    assert "a document is 15" in fig.axes[0].get_xlabel()
    assert_no_text_under({"sweep": fig})
    plt.close(fig)
    fig = viz.plot_load_vs_recompute([
        {"prompt_len": n, "recompute_ttft_ms": n * 1.5, "load_ttft_ms": 40.0 + n / 100}
        for n in (16, 64, 256, 1024)])
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 2 and len(ax.get_legend().get_texts()) == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "64", "256", "1,024"]
    plt.close(fig)
    run = {"arrivals": [10.0, 11.0], "token_times": [[10.5, 10.6], [11.4, 11.5, 11.6]]}
    result = {"one_engine": run, "pair": {"arrivals": [50.0, 51.0],
                                          "token_times": [[50.9, 51.0], [51.8, 51.9, 52.0]]},
              "median_ttft_ms": {"one_engine": 450.0, "pair": 850.0},
              "median_gap_ms": {"one_engine": 100.0, "pair": 100.0},
              "p99_gap_ms": {"one_engine": 100.0, "pair": 100.0}}
    fig = viz.plot_pair_timeline(result)
    # each run from its own first arrival: both start at 0
    for ax in fig.axes:
        first = min(line.get_xdata()[0] for line in ax.get_lines())
        assert first == pytest.approx(0.0)
    assert fig.axes[0].get_legend() is not None
    plt.close(fig)
    table = viz.format_pair(result)
    assert "850 ms" in table and "one engine (2 cores)" in table

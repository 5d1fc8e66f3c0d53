"""Chapter 08's figures: one colour per dtype in every figure, axes that fill their panel, and
text a back row can read."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from kvlab.workbook.viz import precision_plots as viz  # noqa: E402
from tests.helpers import assert_no_text_under  # noqa: E402

# The chapter's names as its cells pass them: the bfloat16 row is relabelled (a bfloat16 cache
# comes with a bfloat16 model), and the weights' figure names the model's dtype.
BF16 = "bf16 model + bf16 KV"
KL_ROWS = [{"kv_cache_dtype": d, "bytes_per_token": b, "requests_fit": n, "mean_kl": kl,
            "request_len": 512, "kv_cache_memory_bytes": 2**26}
           for d, b, n, kl in (("auto", 46080, 2, 0.0), (BF16, 23040, 5, 1.4e-3),
                               ("fp8_e4m3", 11520, 11, 7.4e-3), ("fp8_e5m2", 11520, 11, 3.1e-2),
                               ("fp8_per_token_head", 12240, 10, 4.5e-3),
                               ("int8_per_token_head", 12240, 10, 8.5e-4),
                               ("int4_per_token_head", 6480, 20, 5.2e-2))]
# The capacity run passes fewer dtypes, in another order: index i is not the same dtype here.
CAP_ROWS = [{"kv_cache_dtype": d, "tok_s": t, "preemptions": p, "fit_at_once": f,
             "concurrency": 12, "memory_bytes": 37 * 2**18}
            for d, t, p, f in (("auto", 46.1, 1, 3), (BF16, 119.7, 2, 6),
                               ("int8_per_token_head", 97.5, 0, 12),
                               ("int4_per_token_head", 84.1, 0, 23))]
WEIGHTS = {"rows": [{"dtype": d, "batch": b, "step_ms": s, "ceiling_ms": c}
                    for d, rows in (("float32", ((1, 39.7, 25.4), (16, 69.9, 27.5), (64, 170.3, 76.3))),
                                    ("bfloat16", ((1, 39.9, 11.9), (16, 58.3, 12.8), (64, 98.5, 22.0))))
                    for b, s, c in rows]}
# What each figure's name stands for: the float32 model's "auto" cache is float32.
SAME_DTYPE = {BF16: "bfloat16", "float32": "auto"}


def _rgb(c) -> tuple:
    return tuple(round(x, 3) for x in mcolors.to_rgb(c))


def _colours_drawn() -> dict[str, dict[str, tuple]]:
    """{figure: {dtype: colour}}, read off the marks each figure draws, as a reader sees them."""
    out = {}
    fig = viz.plot_precision_tradeoff(KL_ROWS)
    left, right = fig.axes
    bars = [p for p in left.patches if isinstance(p, Rectangle) and p.get_width() > 0]
    out["requests that fit"] = {t.get_text(): _rgb(b.get_facecolor())
                                for t, b in zip(left.get_yticklabels(), bars)}
    names = {tuple(t.xy): t.get_text() for t in right.texts}  # each point's annotation
    out["accuracy paid"] = {names[tuple(c.get_offsets()[0])]: _rgb(c.get_facecolor()[0])
                            for c in right.collections if isinstance(c, PathCollection)}
    plt.close(fig)
    fig = viz.plot_capacity_by_dtype(CAP_ROWS)
    bars = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_height() > 0]
    out["capacity"] = {r["kv_cache_dtype"]: _rgb(b.get_facecolor()) for r, b in zip(CAP_ROWS, bars)}
    plt.close(fig)
    fig = viz.plot_weights_dtype(WEIGHTS)
    out["weights"] = {}
    for line in fig.axes[0].get_lines():
        d = line.get_label().split(":")[0]
        assert out["weights"].setdefault(d, _rgb(line.get_color())) == _rgb(line.get_color()), (
            f"the weights' figure draws {d}'s step and ceiling in two colours")
    plt.close(fig)
    return out


def test_every_figure_gives_a_dtype_the_same_colour():
    drawn = _colours_drawn()
    assert set(drawn["accuracy paid"]) == {r["kv_cache_dtype"] for r in KL_ROWS[1:]}
    assert set(drawn["capacity"]) == {r["kv_cache_dtype"] for r in CAP_ROWS}
    seen: dict[str, tuple[str, tuple]] = {}
    for figure, colours in drawn.items():
        for name, colour in colours.items():
            dtype = SAME_DTYPE.get(name, name)
            first = seen.setdefault(dtype, (figure, colour))
            assert first[1] == colour, (f"{dtype} is {first[1]} in the {first[0]} figure and "
                                        f"{colour} in the {figure} figure")
    # ... and two dtypes never share one colour.
    by_colour: dict[tuple, str] = {}
    for dtype, (_, colour) in seen.items():
        assert by_colour.setdefault(colour, dtype) == dtype, (dtype, by_colour[colour])


def test_the_check_catches_a_figure_that_colours_by_position(monkeypatch):
    """The capacity bars coloured by their index (auto, bf16, int8, int4 as 0-3) would give
    int8 fp8_e4m3's colour from the accuracy figure: the test above must see it."""
    order = [r["kv_cache_dtype"] for r in KL_ROWS]
    positions = {r["kv_cache_dtype"]: order[i] for i, r in enumerate(CAP_ROWS)}
    real = viz.dtype_colour

    def by_position(name):
        return real(positions[name]) if name in positions and name not in ("auto", BF16) else real(name)

    monkeypatch.setattr(viz, "dtype_colour", by_position)
    with pytest.raises(AssertionError, match="int8_per_token_head"):
        test_every_figure_gives_a_dtype_the_same_colour()


def test_kv_heads_take_no_dtype_colour():
    fig = viz.plot_head_scales(torch.rand(20, 3) * 10, layer=10)
    dtype_colours = {_rgb(c) for c in viz.DTYPE_COLOURS.values()}
    heads = {_rgb(line.get_color()) for line in fig.axes[0].get_lines()}
    assert len(heads) == 3 and not heads & dtype_colours
    plt.close(fig)


def test_the_accuracy_panel_spans_its_points_on_plain_log_axes():
    fig = viz.plot_precision_tradeoff(KL_ROWS)
    right = fig.axes[1]
    fig.canvas.draw()
    assert right.get_xscale() == right.get_yscale() == "log"
    drawn = [r["bytes_per_token"] for r in KL_ROWS if r["mean_kl"] > 0]
    lo, hi = right.get_xlim()
    # No empty half: the axis ends within a factor of two of the outermost points.
    assert min(drawn) / 2 < lo < min(drawn) and max(drawn) < hi < max(drawn) * 2
    labels = [t.get_text() for t in right.get_xticklabels() + right.get_yticklabels()
              if t.get_visible() and t.get_text()]
    assert labels and not any("e" in t or "^" in t for t in labels), labels
    plt.close(fig)


def test_every_text_is_at_least_9_points():
    figs = {"tradeoff": viz.plot_precision_tradeoff(KL_ROWS),
            "capacity": viz.plot_capacity_by_dtype(CAP_ROWS),
            "weights": viz.plot_weights_dtype(WEIGHTS),
            "head scales": viz.plot_head_scales(torch.rand(20, 3) * 10, layer=10)}
    assert_no_text_under(figs)


def test_an_unknown_dtype_has_no_colour_rather_than_a_borrowed_one():
    with pytest.raises(KeyError, match="nvfp4"):
        viz.dtype_colour("nvfp4")
    assert viz.dtype_colour("fp8") == viz.dtype_colour("fp8_e4m3")

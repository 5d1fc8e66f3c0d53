"""The roofline bench's pieces: its arithmetic, its measurements on a tiny engine, and
its plot."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from tests.helpers import assert_no_blocks_held  # noqa: E402

from kvlab import LLM  # noqa: E402
from kvlab.workbook import viz
from kvlab.bench import roofline  # noqa: E402


def test_context_token_cost_is_the_slope_per_sequence_token():
    rows = [{"batch": 16, "context": 32, "step_ms": 30.0},
            {"batch": 16, "context": 256, "step_ms": 40.0},
            {"batch": 16, "context": 512, "step_ms": 54.0},
            {"batch": 64, "context": 32, "step_ms": 99.0}]
    cost = roofline.context_token_cost(rows, 16, kv_bytes_per_token=46080, bandwidth=46.08e9)
    # (54 - 30) ms over 16 sequences x 480 more tokens; one token's K/V read once: 1 us.
    assert cost["contexts"] == [32, 512]
    assert cost["per_context_token_us"] == pytest.approx(24_000 / (16 * 480), abs=1e-3)
    assert cost["kv_read_once_us"] == pytest.approx(1.0)
    assert cost["ratio"] == pytest.approx(3.12, abs=0.01)


def test_against_ceiling_divides_the_ceiling_by_the_step(loaded):
    rates = {"matmul_flops": 1e11, "peak_matmul_flops": 4e11, "bandwidth_bytes": 1e10}
    row = roofline.against_ceiling({"batch": 64, "context": 100, "step_ms": 1000.0}, rates, None)
    # A faster matmul can only lower the ceiling's time, so the share of it too.
    assert row["ceiling_ms_peak"] <= row["ceiling_ms_mm"]
    assert row["fraction_mm"] == pytest.approx(row["ceiling_ms_mm"] / 1000.0, abs=1e-3)
    assert row["fraction_peak"] <= row["fraction_mm"]
    assert row["bound_mm"] == "compute"


def test_decode_steps_and_mixed_step_on_a_tiny_engine():
    llm = LLM(max_model_len=96, max_num_seqs=4, kv_cache_tokens=512, max_num_batched_tokens=256)
    row = roofline.decode_steps(llm, batch=3, context=40, steps=4, warmup=1)
    assert row["batch"] == 3 and abs(row["context"] - 40) <= 3
    assert 0 < row["forward_ms"] <= row["step_ms"] and 0 <= row["overhead_fraction"] < 1
    assert_no_blocks_held(llm)  # the bench's requests are gone after it
    mixed = roofline.mixed_step(batch=2, context=24, chunk=16, long_prompt=64)
    assert mixed["mixed_steps"] == 4  # 64 prompt tokens in chunks of 16, beside 2 decodes
    assert mixed["mixed_over_parts"] > 0


def test_plot_roofline_sweep_draws_the_measured_points_and_both_ceilings():
    def row(batch, context, step_ms, mm, peak):
        return {"batch": batch, "context": context, "step_ms": step_ms,
                "tok_s": round(1000 * batch / step_ms, 1), "ceiling_ms_mm": mm,
                "ceiling_ms_peak": peak, "fraction_mm": round(mm / step_ms, 3),
                "fraction_peak": round(peak / step_ms, 3)}

    rows = [row(1, 256, 16.0, 8.0, 8.0), row(4, 256, 20.0, 8.0, 8.0),
            row(16, 256, 35.0, 21.0, 10.0), row(16, 32, 28.0, 20.0, 9.0)]
    fig = viz.plot_roofline_sweep({"context": 256, "rows": rows})
    ax1, ax2 = fig.axes
    measured = ax1.lines[0]
    assert list(measured.get_xdata()) == [1, 4, 16]
    assert list(measured.get_ydata()) == [62.5, 200.0, 457.1]
    ceiling_mm = ax1.lines[1]
    assert list(ceiling_mm.get_ydata()) == pytest.approx([125.0, 500.0, 761.9], abs=0.1)
    assert [l.get_label() for l in ax1.lines][-1] == "kvlab, context 32"
    labels = [t.get_text() for t in ax2.texts]
    assert "60%" in labels and "29%" in labels  # batch 16: 21/35 and 10/35
    plt.close(fig)

"""Chapter 05's pictures: pure functions over numbers or a pool reading, drawn without a browser."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab import SamplingParams  # noqa: E402
from kvlab.workbook import viz
from kvlab.kv_cache import KVCacheManager  # noqa: E402
from kvlab.metrics import RequestMetrics  # noqa: E402
from kvlab.request import Request  # noqa: E402


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_cold_warm_bars_carry_the_printed_medians():
    runs = [
        {"enable_prefix_caching": True, "prefix_len": 2048, "tail_len": 32, "cold_ttft_ms": 2332.2,
         "warm_ttft_ms": 69.2, "warm_ttft_ms_range": [60.0, 80.0], "speedup": 33.7},
        {"enable_prefix_caching": False, "prefix_len": 2048, "tail_len": 32,
         "cold_ttft_ms": 2339.4, "warm_ttft_ms": 2242.1, "warm_ttft_ms_range": [2200.0, 2300.0],
         "speedup": 1.04},
    ]
    ax = viz.plot_cold_warm_ttft(runs)
    labels = texts(ax)
    assert {"2,332 ms", "69.2 ms", "2,339 ms", "2,242 ms"} <= set(labels)
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["caching on\nfirst / later = 33.7x", "caching off\nfirst / later = 1.04x"]
    heights = sorted(round(p.get_height(), 1) for p in ax.patches)
    assert heights == [69.2, 2242.1, 2332.2, 2339.4]
    plt.close(ax.figure)


def test_prefix_hits_stacks_cached_and_computed_and_ends_at_the_hit_rate():
    cached = [0, 256, 256, 240]
    ax = viz.plot_prefix_hits(cached, 288)
    bars = [p for p in ax.patches]
    assert [p.get_height() for p in bars[:4]] == cached  # cached, bottom
    assert [p.get_height() for p in bars[4:]] == [288, 32, 32, 48]  # computed, on top
    rate = 100 * sum(cached) / (4 * 288)
    assert ax.get_title() == f"hit rate after 4 requests: {rate:.1f}%"
    line = ax.figure.axes[1].lines[0]
    assert line.get_ydata()[0] == 0 and line.get_ydata()[-1] == pytest.approx(rate)
    with pytest.raises(ValueError, match="3 prompt lengths for 4 requests"):
        viz.plot_prefix_hits(cached, [288] * 3)
    plt.close("all")


def request(rid, tokens):
    return Request(rid, None, list(tokens), SamplingParams(), frozenset(),
                   RequestMetrics(arrival_time=0.0))


def admit(m, req):
    hits, n = m.get_computed_blocks(req)
    assert m.allocate_slots(req.request_id, req.num_tokens, n, hits)
    req.num_computed_tokens = req.num_tokens
    m.cache_blocks(req)


def test_free_queue_snapshot_reads_head_first_and_names_keys():
    # Chapter 05's pool: block 0 + 6 usable (1..6). Block 0 is vLLM's null block, never free
    # and never in use, so no reading lists it.
    m = KVCacheManager(7, 2, 32, enable_prefix_caching=True)
    a = request("a", range(10, 18))  # 4 full blocks
    admit(m, a)
    names = {h: f"a{i}" for i, h in enumerate(a.block_hashes)}
    running = viz.free_queue_snapshot(m.block_pool, "a runs", names)
    m.free("a")
    done = viz.free_queue_snapshot(m.block_pool, "a finished", names)
    assert running == {"label": "a runs", "queue": [5, 6], "in_use": [1, 2, 3, 4],
                       "keys": {1: "a0", 2: "a1", 3: "a2", 4: "a3"}}
    # Freed last block first: a's tail sits nearest the head, behind the never-used blocks.
    assert done["queue"] == [5, 6, 4, 3, 2, 1] and done["in_use"] == []
    assert viz.free_queue_snapshot(m.block_pool, "x")["keys"][1] == "key"  # no name given

    ax = viz.draw_free_queue([running, done])
    drawn = texts(ax)
    assert "a runs" in drawn and "a finished" in drawn and "4\na3" in drawn and "5" in drawn
    # One box per queued or used block in each row: 2 + 4, then 6 + 0 (the null block in none).
    assert len(ax.patches) == (2 + 4) + (6 + 0)
    plt.close(ax.figure)

"""The allocator simulation reproduces the classic result's shape."""

from __future__ import annotations

import pytest

from kvlab.sim import block_table_entries, internal_waste, request_lengths, simulate


def test_contiguous_vs_paged_admission():
    lengths = request_lengths(100, seed=0)
    contiguous = simulate(lengths, "contiguous")
    paged = simulate(lengths, "paged")
    # 10,000 slots / 512 reserved per request = 19 regions, never more.
    assert contiguous.max_running == 19
    assert contiguous.mean_running == pytest.approx(19, abs=0.5)
    # Paged holds only real tokens (+ under one block each): several times more run at once.
    assert paged.mean_running > 2.5 * contiguous.mean_running
    assert paged.mean_utilisation > 0.85 > 0.45 > contiguous.mean_utilisation


def test_block_size_tradeoff():
    lengths = [17, 100, 250]
    assert internal_waste(lengths, 1) == 0
    assert internal_waste(lengths, 16) == pytest.approx((15 + 12 + 6) / 3)
    assert block_table_entries(lengths, 16) == pytest.approx((2 + 7 + 16) / 3)
    assert internal_waste(lengths, 128) > internal_waste(lengths, 16)


def test_bad_layout():
    with pytest.raises(ValueError, match="layout"):
        simulate([10], "buddy")

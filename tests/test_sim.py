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


def test_waste_breakdown_adds_up():
    from kvlab.sim import waste_breakdown

    # One request holding a 16-slot region, 5 tokens now, 9 at the end; 8 free slots, 0 usable.
    w = waste_breakdown({"a": 16}, {"a": 5}, {"a": 9}, free_slots=8, usable_free_slots=0)
    assert w == {"tokens": 5, "reservation": 4, "internal": 7, "external": 8, "free (usable)": 0}
    assert sum(w.values()) == 16 + 8

"""The allocator simulation reproduces the classic result's shape."""

from __future__ import annotations

import pytest

from kvlab.workbook.allocator_sim import block_table_entries, internal_waste, request_lengths, simulate


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
    from kvlab.workbook.allocator_sim import waste_breakdown

    # One request holding a 16-slot region, 5 tokens now, 9 at the end; 8 free slots, 0 usable.
    w = waste_breakdown({"a": 16}, {"a": 5}, {"a": 9}, free_slots=8, usable_free_slots=0)
    assert w == {"tokens": 5, "reservation": 4, "internal": 7, "external": 8, "free (usable)": 0}
    assert sum(w.values()) == 16 + 8


def test_simulation_counts_preemption_work_and_records_steps_on_one_axis():
    """Paged admits everyone while a block is free, then preempts: the recomputed tokens are
    counted; the recorded entries carry their own step numbers (increasing, within the run)."""
    from kvlab.workbook import allocator_sim

    lengths = allocator_sim.request_lengths(100, 10, 512, seed=0)
    c, p = allocator_sim.simulate(lengths, "contiguous"), allocator_sim.simulate(lengths, "paged")
    assert c.num_preemptions == 0 and c.num_recomputed_tokens == 0
    assert p.num_preemptions > 0 and 0 < p.num_recomputed_tokens < p.num_preemptions * 512
    for res in (c, p):
        assert len(res.steps) == len(res.running_per_step) == len(res.utilisation_per_step)
        assert res.steps == sorted(set(res.steps)) and res.steps[-1] < res.num_steps
    assert c.steps == list(range(len(c.steps)))  # contiguous waits from step 0, without a gap
    assert p.steps[0] > 0  # paged admits all 100 at step 0: its queue fills only by preemption

"""The allocator simulation: contiguous reservation against paged blocks under vLLM's rules."""

from __future__ import annotations

import pytest

from kvlab.workbook.allocator_sim import block_table_entries, internal_waste, request_lengths, simulate


def test_paged_finishes_the_same_workload_in_fewer_steps():
    lengths = request_lengths(100, seed=0)
    contiguous = simulate(lengths, "contiguous")
    paged = simulate(lengths, "paged")
    # 10,000 slots / 512 reserved per request = 19 regions, never more, never preempted.
    assert contiguous.max_running == 19 and contiguous.num_preemptions == 0
    assert contiguous.mean_running_while_waiting == pytest.approx(19, abs=0.5)
    # Paged holds only real tokens (+ under one block each): the same 100 requests finish in
    # about half the steps, with about twice as many running per step on average.
    assert contiguous.num_steps > 1.8 * paged.num_steps
    assert paged.mean_running > 1.8 * contiguous.mean_running
    assert paged.mean_utilisation > 0.5 > 0.35 > contiguous.mean_utilisation
    # Every step is recorded, for both layouts, from step 0 to the last request's finish.
    for res in (contiguous, paged):
        assert len(res.running_per_step) == len(res.waiting_per_step) == res.num_steps
        assert len(res.utilisation_per_step) == res.num_steps and res.running_per_step[-1] >= 1
    assert contiguous.steps[0] == 0 and paged.steps[0] > 0  # paged admits all 100 at step 0


def test_vllm_admission_needs_the_blocks_of_the_whole_prompt():
    """Two 9-token prompts in a pool of 4 blocks of 4: the first takes 3 blocks; one is left,
    and vLLM's rule does not admit the second on it (its prompt needs 3), so it waits."""
    res = simulate([10, 10], "paged", total_slots=16, max_len=16, block_size=4, prompt_lens=[9, 9])
    assert (res.running_per_step[0], res.waiting_per_step[0]) == (1, 1)
    assert res.num_preemptions == 0
    # The first runs tokens 1-9 in step 0 and token 10 in step 1, then frees its 3 blocks; the
    # second is admitted at step 2 and finishes at step 3.
    assert res.running_per_step == [1, 1, 1, 1] and res.waiting_per_step == [1, 1, 0, 0]


def test_a_preempted_request_returns_only_when_all_its_tokens_fit_and_recomputes_them():
    """4 blocks of 2 slots, two requests growing to 6 tokens from one-token prompts. At step 4
    the older needs a third block and none is free: the newer (4 tokens computed) is preempted.
    It needs 3 blocks for its 5 tokens to come back, waits until the older finishes, then
    computes all 5 in one step."""
    res = simulate([6, 6], "paged", total_slots=8, max_len=8, block_size=2)
    assert res.num_preemptions == 1 and res.num_recomputed_tokens == 4
    assert res.running_per_step == [2, 2, 2, 2, 1, 1, 1, 1]
    assert res.waiting_per_step == [0, 0, 0, 0, 1, 1, 0, 0]
    # The too-eager rule readmits it on the one free block and it starts over, token by token.
    eager = simulate([6, 6], "paged", total_slots=8, max_len=8, block_size=2, admission="one-block")
    assert eager.num_steps > res.num_steps and eager.waiting_per_step[5] == 0


def test_the_one_block_rule_thrashes_where_vllms_rule_does_not():
    lengths = request_lengths(100, 10, 512, seed=0)
    vllm = simulate(lengths, "paged")
    eager = simulate(lengths, "paged", admission="one-block")
    assert eager.admission == "one-block" and vllm.admission == "vllm"
    assert eager.num_preemptions > 4 * vllm.num_preemptions > 0
    assert eager.num_steps > vllm.num_steps
    assert 0 < eager.num_recomputed_tokens < eager.num_preemptions * 512


def test_block_size_tradeoff():
    lengths = [17, 100, 250]
    assert internal_waste(lengths, 1) == 0
    assert internal_waste(lengths, 16) == pytest.approx((15 + 12 + 6) / 3)
    assert block_table_entries(lengths, 16) == pytest.approx((2 + 7 + 16) / 3)
    assert internal_waste(lengths, 128) > internal_waste(lengths, 16)


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout"):
        simulate([10], "buddy")
    with pytest.raises(ValueError, match="admission"):
        simulate([10], "paged", admission="greedy")
    with pytest.raises(ValueError, match="prompt"):
        simulate([10], "paged", prompt_lens=[11])
    with pytest.raises(ValueError, match="one-block"):
        simulate([10], "contiguous", admission="one-block")


def test_waste_breakdown_adds_up():
    from kvlab.workbook.allocator_sim import waste_breakdown

    # One request holding a 16-slot region, 5 tokens now, 9 at the end; 8 free slots, 0 usable.
    w = waste_breakdown({"a": 16}, {"a": 5}, {"a": 9}, free_slots=8, usable_free_slots=0)
    assert w == {"tokens": 5, "reservation": 4, "internal": 7, "external": 8, "free (usable)": 0}
    assert sum(w.values()) == 16 + 8

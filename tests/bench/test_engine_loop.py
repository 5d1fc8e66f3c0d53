"""Chapter 03's measurements of vLLM's defaults: preemption with and without the prefix cache,
and the two engine loops, at small sizes."""

from __future__ import annotations

from kvlab.bench import engine_loop


def test_with_the_prefix_cache_a_preempted_request_finds_its_blocks_again():
    off, on = engine_loop.preemption_cost(num_requests=8, min_len=30, max_len=60, max_tokens=16,
                                          kv_cache_tokens=160)
    for row in (off, on):
        assert row["preemptions"] > 0 and row["identical_to_roomy"] and row["leaked_blocks"] == 0
    # Off: nothing is found again, and every preempted token is computed again.
    assert off["tokens_found_again"] == 0 and off["tokens_recomputed"] > 0
    # On: re-admissions hit their own full blocks, so less is computed again.
    assert on["tokens_found_again"] > 0
    assert on["tokens_recomputed"] < off["tokens_recomputed"]


def test_async_scheduling_reads_each_step_one_call_later_with_the_same_tokens():
    orders = engine_loop.loop_orders(num_requests=2, prompt_len=12, max_tokens=3)
    sync, asyn = orders["synchronous"]["calls"], orders["async scheduling"]["calls"]
    # Synchronous: call k schedules step k and reads it.
    assert [(c["scheduled"], c["read"]) for c in sync] == [(1, 1), (2, 2), (3, 3)]
    # Async: call k schedules step k and reads step k - 1; one more call reads the last step,
    # and no fourth step is scheduled (its max_tokens token is in flight).
    assert [(c["scheduled"], c["read"]) for c in asyn] == [(1, None), (2, 1), (3, 2), (None, 3)]
    assert orders["synchronous"]["tokens"] == orders["async scheduling"]["tokens"]


def test_a_request_stopped_by_a_stop_token_is_given_one_more_slot_under_async_scheduling():
    sync, asyn = engine_loop.stop_slots(prompt_len=13, stop_after=4, block_size=4)
    assert sync["finish_reason"] == asyn["finish_reason"] == "stop"
    assert sync["output_tokens"] == asyn["output_tokens"]
    assert sync["slots_given"] == sync["p_plus_n_minus_1"]
    assert asyn["slots_given"] == asyn["p_plus_n_minus_1"] + 1


def test_the_long_prefill_threshold_lets_a_short_request_overtake_a_long_prefill():
    from kvlab.bench.scheduling import head_of_line

    off, on = head_of_line(thresholds=(0, 32), long_len=256, short_len=16, budget=64,
                           repeats=1)
    # Without the cap the short request waits for the long prompt's chunks; with it, it is
    # scheduled beside the next chunk.
    assert on["short_steps_waited"] < off["short_steps_waited"]


def test_the_extra_slot_takes_a_block_more_when_the_last_block_is_full():
    sync, asyn = engine_loop.stop_slots(prompt_len=13, stop_after=4, block_size=4)
    assert sync["p_plus_n_minus_1"] % 4 == 0  # the stop was chosen so the last block is full
    assert asyn["blocks_needed"] == sync["blocks_needed"] + 1

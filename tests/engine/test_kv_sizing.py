"""kvlab/kv_sizing.py, the one rule every chapter and challenge sizes pools with, held to what the
engine really allocates: the most K/V slots a request is given, in each loop and each way to end.
"""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.bench.engine_loop import stop_slots
from kvlab.kv_sizing import blocks_held, pool_bytes, requests_at_once, tokens_held, usable_blocks
from kvlab.step_log import StepObserver


class _PeakSlots(StepObserver):
    """The most positions any scheduled step gave a request K/V slots for."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}

    def on_schedule(self, engine, sched) -> None:
        for r, n in sched.scheduled:
            rid = r.request_id
            self.peak[rid] = max(self.peak.get(rid, 0), sched.num_computed_tokens[rid] + n)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_that_ends_on_max_tokens_is_given_p_plus_n_minus_1_slots(async_scheduling):
    llm = LLM(block_size=4, max_model_len=96, kv_cache_tokens=1024, max_num_seqs=4,
              async_scheduling=async_scheduling)
    seen = _PeakSlots()
    llm.llm_engine.add_observer(seen)
    cases = [(7, 1), (7, 2), (12, 5), (31, 9)]  # one output: the prefill alone
    outs = llm.generate([{"prompt_token_ids": list(range(100, 100 + p))} for p, _ in cases],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                         for _, n in cases])
    for (p, n), out in zip(cases, outs):
        assert len(out.outputs[0].token_ids) == n
        assert seen.peak[out.request_id] == tokens_held(p, n, async_scheduling=async_scheduling)


def test_a_request_that_ends_on_a_stop_token_gets_one_slot_more_only_under_async():
    for row in stop_slots(prompt_len=31, stop_after=6, block_size=4):
        assert row["finish_reason"] == "stop"
        want = tokens_held(31, row["output_tokens"], ends_on_stop=True,
                           async_scheduling=row["async_scheduling"])
        assert row["slots_given"] == want, row


def test_pool_arithmetic_matches_the_engines_pool():
    # kv_cache_tokens=T: ceil(T / block_size) usable blocks, the null block beside them.
    for tokens, bs in [(256, 16), (250, 16), (17, 16), (1, 4)]:
        llm_pool = LLM(block_size=bs, max_model_len=16, kv_cache_tokens=max(tokens, 16),
                       max_num_seqs=1).llm_engine.scheduler.kv_cache_manager.block_pool
        assert llm_pool.get_num_free_blocks() == usable_blocks(max(tokens, 16), bs)
    # Bytes pay for the null block too: pool_bytes(n) gives exactly n usable blocks.
    llm = LLM(block_size=16, max_model_len=64, kv_cache_dtype="auto",
              kv_cache_memory_bytes=pool_bytes(9, 16, 46080))
    assert llm.llm_engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 9
    assert blocks_held(20, 20, 16) == 3 and blocks_held(20, 13, 16) == 2
    assert requests_at_once(16, 20, 20, 16) == 5


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="at least one prompt and one output token"):
        tokens_held(0, 3)
    with pytest.raises(ValueError, match="at least one prompt and one output token"):
        tokens_held(5, 0)

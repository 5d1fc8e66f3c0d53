"""Scheduling: every schedule gives the same greedy tokens; aborts and preemption leak nothing."""

from __future__ import annotations

import pytest
from tests.helpers import assert_no_blocks_held

from kvlab import LLM, SamplingParams
from kvlab.bench.scheduling import chunked_prefill_stall, fit_line, percentile

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def workload(text_ids):
    return [{"prompt_token_ids": text_ids[i : i + 20 + 37 * i]} for i in range(6)]


@pytest.fixture(scope="module")
def reference(text_ids):
    llm = LLM(block_size=16, max_model_len=512, kv_cache_tokens=4096, backend="reference")
    return [o.outputs[0].token_ids for o in llm.generate(workload(text_ids), SP)]


@pytest.mark.parametrize("kwargs", [
    dict(scheduling="static", max_num_seqs=2),
    dict(scheduling="continuous", max_num_seqs=1),
    dict(max_num_batched_tokens=32),  # long prompts in chunks, mixed with decodes
    dict(max_num_batched_tokens=7, block_size=4),  # chunks that cross block boundaries
    dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    dict(kv_cache_tokens=512, block_size=8),  # preemption: 6 requests do not fit at once
])
def test_every_schedule_gives_the_same_tokens(text_ids, reference, kwargs):
    base = dict(block_size=16, max_model_len=512, kv_cache_tokens=4096)
    llm = LLM(**{**base, **kwargs})
    outs = llm.generate(workload(text_ids), SP)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if "kv_cache_tokens" in kwargs:
        assert llm.stats()["num_preemptions"] > 0
    if kwargs.get("scheduling") == "static":
        # Static: nobody is admitted until the whole batch has left.
        trace = list(llm.llm_engine.step_trace)
        for prev, cur in zip(trace, trace[1:]):
            new = set(cur.request_ids) - set(prev.request_ids)
            assert not new or prev.num_running == 0
    assert_no_blocks_held(llm)


def test_step_budget_and_seats_are_respected(text_ids):
    llm = LLM(block_size=16, max_model_len=512, kv_cache_tokens=4096, max_num_seqs=3,
              max_num_batched_tokens=40)
    llm.generate(workload(text_ids), SP)
    for rec in llm.llm_engine.step_trace:
        assert rec.num_prefill_tokens + rec.num_decode_tokens <= 40
        assert len(rec.request_ids) <= 3


def test_abort_mid_prefill_and_mid_decode(text_ids):
    llm = LLM(block_size=8, max_model_len=512, kv_cache_tokens=2048, max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": text_ids[:200]}, SP)
    engine.add_request("short", {"prompt_token_ids": text_ids[:10]}, SP)
    engine.step()
    assert 0 < engine.requests["long"].num_computed_tokens < 200  # mid-prefill
    engine.abort_request("long")
    for _ in range(3):
        engine.step()
    assert len(engine.requests["short"].output_token_ids) >= 2  # mid-decode
    engine.abort_request("short")
    assert_no_blocks_held(llm)
    # The engine still answers as before.
    out = llm.generate({"prompt_token_ids": text_ids[:10]}, SP)[0]
    fresh = LLM(block_size=8, max_model_len=512, kv_cache_tokens=2048)
    assert out.outputs[0].token_ids == fresh.generate({"prompt_token_ids": text_ids[:10]}, SP)[0].outputs[0].token_ids


def test_a_request_that_can_never_fit_is_refused_not_hung(text_ids):
    llm = LLM(block_size=8, max_model_len=64, kv_cache_tokens=256, max_num_seqs=2,
              parallel_sampling="fork")
    # Forked samples must run together: three of them can never fit two seats.
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate({"prompt_token_ids": text_ids[:10]}, SamplingParams(n=3))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": text_ids[:64]}, SP)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        LLM(max_model_len=512, kv_cache_tokens=256)
    assert_no_blocks_held(llm)


def test_arrivals_while_running_and_metrics(text_ids):
    # b repeats a's prompt: with no prefix cache its whole prompt runs beside a's decode.
    llm = LLM(block_size=16, max_model_len=512, kv_cache_tokens=4096,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": text_ids[:30]}, SP)
    engine.step()
    engine.step()
    engine.add_request("b", {"prompt_token_ids": text_ids[:30]}, SP)  # arrives mid-stream
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    a, b = done["a"].metrics, done["b"].metrics
    assert b.arrival_time > a.first_token_time and b.time_in_queue >= 0
    assert done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids
    steps = list(engine.step_trace)
    assert all(0 <= r.forward_time <= r.step_time for r in steps)
    assert any(r.num_prefill_tokens == 30 and r.num_decode_tokens == 1 for r in steps)


def test_chunked_prefill_shortens_the_stall():
    chunked = chunked_prefill_stall(64, long_len=256, insert_after=3, tail_tokens=2)
    assert chunked.chunks == 5  # 63 prompt tokens a step: the decode token takes one
    unchunked = chunked_prefill_stall(None, long_len=256, insert_after=3, tail_tokens=2)
    assert unchunked.chunks == 1
    assert chunked.inserted_ttft > 0 and unchunked.inserted_ttft > 0


def test_helpers():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    a, b, r2 = fit_line([1, 2, 3], [3, 5, 7])
    assert (round(a, 6), round(b, 6), round(r2, 6)) == (1, 2, 1)


def test_the_concurrency_table_takes_repeats_per_server_and_refuses_a_stray_name():
    from kvlab.bench import scheduling

    servers = {"max_num_seqs=1": ({"max_num_seqs": 1}, (1,)), "default": ({}, (2,))}
    with pytest.raises(ValueError, match="the servers are"):
        scheduling.continuous_batching_table(servers, repeats={"default": 3})
    rows = scheduling.continuous_batching_table(servers, input_len=8, output_len=3,
                                                repeats={"max_num_seqs=1": 1, "default": 2})
    assert [(r["server"], r["concurrency"]) for r in rows] == [("max_num_seqs=1", 1),
                                                                ("default", 2)]


def _everything_on(text_ids, async_scheduling, params, pressure=True):
    """Shared prefixes (prefix hits), a 24-token budget (chunks) and a pool too small for the
    burst (preemption, re-admission hitting its own blocks), in one loop or the other."""
    prompts = [{"prompt_token_ids": text_ids[:32] + text_ids[100 + 9 * i: 110 + 9 * i]}
               for i in range(5)]
    llm = LLM(block_size=8, max_model_len=96, kv_cache_tokens=96, max_num_batched_tokens=24,
              async_scheduling=async_scheduling)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions"] > 0 or not pressure  # early stops may leave room
    assert_no_blocks_held(llm)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_both_loops_give_transformers_greedy_tokens_with_everything_on(text_ids, hf_greedy,
                                                                       async_scheduling):
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts, tokens = _everything_on(text_ids, async_scheduling, sp)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(prompt["prompt_token_ids"], 16)


def test_async_scheduling_gives_the_synchronous_loops_seeded_samples_and_stops(text_ids):
    """Seeded sampling, and requests that end on a stop token (found one step late under
    async scheduling, its extra slot freed): the same tokens in both loops."""
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    assert (_everything_on(text_ids, False, seeded)[1]
            == _everything_on(text_ids, True, seeded)[1])
    _, free = _everything_on(text_ids, False, SamplingParams(max_tokens=16, temperature=0,
                                                            ignore_eos=True))
    stops = sorted({t[5] for t in free})[:3]
    stopped = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=stops)
    sync, asyn = (_everything_on(text_ids, a, stopped, pressure=False)[1] for a in (False, True))
    assert sync == asyn and any(len(t) < 16 for t in sync)

"""Where kvlab claims vLLM v1's behaviour, it has it: seats with n > 1, prefix-cache keying at
allocation, duplicate cached blocks, preempted-request counters, stop tokens and strings,
numeric edges, incremental detokenization, beam search through the scheduler, and no tensor
created without a device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.helpers import assert_no_blocks_held, llm_fixture

from kvlab import LLM, BeamSearchParams, SamplingParams
from kvlab.block_pool import BlockPool
from kvlab.sampling import RequestOutputKind

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


llm = llm_fixture(block_size=8, max_model_len=256, kv_cache_tokens=2048)


def test_forked_samples_never_exceed_max_num_seqs(text_ids):
    # The n=3 request first: its two forks come after the other two prompts were admitted.
    llm = LLM(block_size=8, max_model_len=128, kv_cache_tokens=2048, max_num_seqs=3)
    prompts = [{"prompt_token_ids": text_ids[i * 20:(i + 1) * 20]} for i in range(3)]
    params = [SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True), GREEDY, GREEDY]
    out = llm.generate(prompts, params)
    assert [len(o.outputs) for o in out] == [3, 1, 1]
    trace = llm.llm_engine.step_trace
    assert max(r.num_running for r in trace) <= 3, [r.num_running for r in trace]
    assert_no_blocks_held(llm)


def test_prompts_submitted_together_share_their_prefix_in_the_same_step(text_ids):
    system = text_ids[:64]  # eight full 8-token blocks
    prompts = [{"prompt_token_ids": system + text_ids[100 + 10 * i:105 + 10 * i]}
               for i in range(4)]
    cached = LLM(block_size=8, max_model_len=256, kv_cache_tokens=2048,
                 enable_prefix_caching=True)
    out = cached.generate(prompts, GREEDY)
    stats = cached.stats()
    # The first prompt's blocks are keyed when they are allocated, so the three admitted after
    # it in the same step find all eight blocks.
    assert stats["prefix_cache_hits"] == 3 * 64, stats
    assert [o.num_cached_tokens for o in out] == [0, 64, 64, 64]
    assert cached.llm_engine.num_steps == 8  # one prefill step, then decodes
    cold = LLM(block_size=8, max_model_len=256, kv_cache_tokens=2048).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in cold]
    assert_no_blocks_held(cached)


def test_identical_blocks_both_stay_findable_when_one_is_evicted():
    pool = BlockPool(5)  # block 0, the null block, and 1-4
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"same prefix")
    pool.cache_block(b, b"same prefix")  # computed by two requests before either was keyed
    pool.free_blocks([a])  # free queue: 3, 4, then a
    assert a in pool.get_new_blocks(3)  # a is reused: its copy of the prefix is gone
    assert a.block_hash is None
    assert pool.get_cached_block(b"same prefix") is b  # b is still held and still found
    pool.check_invariants()


@pytest.mark.slow
def test_preempted_requests_count_apart_from_the_hit_rate(text_ids):
    # 18 blocks of 4 for four 30-token prompts growing to 54: someone is preempted.
    tight = LLM(block_size=4, max_model_len=64, kv_cache_tokens=72, enable_prefix_caching=True)
    prompts = [{"prompt_token_ids": text_ids[40 * i:40 * i + 30]} for i in range(4)]
    out = tight.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    s = tight.stats()
    assert s["num_preemptions"] > 0
    # First admissions only: each prompt counted once, no shared prefix, so no hits.
    assert s["prefix_cache_queries"] == 4 * 30 and s["prefix_cache_hits"] == 0
    assert s["prefix_cache_hit_rate"] == 0.0
    assert s["prefix_cache_preempted_queries"] > 0
    roomy = LLM(block_size=4, max_model_len=64, kv_cache_tokens=1024).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in roomy]
    assert_no_blocks_held(tight)


def test_stop_token_stays_in_token_ids_not_in_text(llm):
    prompt = "The capital of France is"
    free = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    stop_id = free.token_ids[1]
    tok = llm.get_tokenizer()
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0,
                                              stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:2] and out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert out.text == tok.decode(free.token_ids[:1], skip_special_tokens=True)
    kept = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == tok.decode(free.token_ids[:2], skip_special_tokens=True)


def test_stop_strings_offline_and_streamed(llm):
    prompt = "Count: one, two, three, four, five,"
    free = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert len(free.text) > 6
    stop = free.text[3:6]  # a piece of text in the middle of the answer
    cut = free.text.index(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == free.text[:cut]
    assert len(o.token_ids) < len(free.token_ids)
    kept = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, stop=stop,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[:cut + len(stop)]
    # Streamed (DELTA): the pieces add up to the same text, the stop string never shows.
    engine = llm.llm_engine
    engine.add_request("stream-stop", prompt, SamplingParams(
        max_tokens=16, temperature=0, stop=[stop], output_kind=RequestOutputKind.DELTA))
    pieces = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces += [c.text for c in out.outputs]
    assert "".join(pieces) == o.text and stop not in "".join(pieces)
    assert_no_blocks_held(llm)


def test_streamed_deltas_add_up_and_offline_decodes_once(llm, monkeypatch):
    import kvlab.output_processor as op

    calls = []
    real = op.detokenize
    monkeypatch.setattr(op, "detokenize", lambda *a, **k: calls.append(1) or real(*a, **k))
    chat = [{"role": "user", "content": "Write three emoji and the word 漢字."}]
    sp = SamplingParams(max_tokens=40, temperature=0)
    final = llm.chat(chat, sp)[0].outputs[0]
    assert len(calls) == 1  # offline: the text is built once, when the request finishes
    engine = llm.llm_engine
    engine.add_request("stream", {"prompt_token_ids": llm.apply_chat_template(chat)},
                       dataclasses.replace(sp, output_kind=RequestOutputKind.DELTA))
    pieces, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces += [c.text for c in out.outputs]
            tokens += [t for c in out.outputs for t in c.token_ids]
    assert len(calls) == 1  # streaming never re-decodes the whole output
    assert "".join(pieces) == final.text and tokens == final.token_ids
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in final.text


def test_numeric_edges(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=1e-40, seed=1))
    assert len(out[0].outputs[0].token_ids) == 4  # clamped to 0.01 as vLLM does: no NaN
    big = llm.generate("Hello", SamplingParams(n=2, max_tokens=3, temperature=1.0,
                                               seed=2**63 - 1))[0]
    assert len(big.outputs) == 2
    assert SamplingParams(seed=-1).seed is None  # vLLM: -1 means no seed
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=2.5)  # vLLM's range is [0, 2]
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    # A parameter broken after it was built is caught before anything is queued.
    bad = SamplingParams(max_tokens=4)
    bad.temperature = -1.0
    before = llm.stats()
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=4), bad])
    assert llm.stats() == before and not llm.llm_engine.has_unfinished_requests()


def test_beam_search_goes_through_the_scheduler(text_ids):
    prompt = {"prompt_token_ids": text_ids[:21]}
    bp = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    roomy = LLM(block_size=4, max_model_len=64, kv_cache_tokens=1024)
    ref = roomy.beam_search(prompt, bp)[0].sequences
    # A 4-token step budget: the prompt is chunked. (max_num_seqs, not given, is lowered to the
    # budget as vLLM lowers it: 4 seats, one per beam.)
    slow = LLM(block_size=4, max_model_len=64, kv_cache_tokens=1024, max_num_batched_tokens=4)
    assert slow.llm_engine.config.max_num_seqs == 4
    got = slow.beam_search(prompt, bp)[0].sequences
    assert [s.tokens for s in got] == [s.tokens for s in ref]
    trace = slow.llm_engine.step_trace
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in trace) <= 4
    # Too few seats for the beams: refused up front.
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(block_size=4, max_model_len=64, kv_cache_tokens=1024, max_num_seqs=2).beam_search(
            prompt, bp)
    # Tight memory beside an older request: beams are preempted (the newest go first) and
    # recomputed, their shared prefix found again in the prefix cache; the result is the same.
    tight = LLM(block_size=4, max_model_len=64, kv_cache_tokens=64, enable_prefix_caching=True)
    tight.llm_engine.add_request("older", {"prompt_token_ids": text_ids[100:130]},
                                 SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    got = tight.beam_search(prompt, bp)[0].sequences
    while tight.llm_engine.has_unfinished_requests():
        tight.llm_engine.step()
    assert tight.stats()["num_preemptions"] > 0
    assert [s.tokens for s in got] == [s.tokens for s in ref]
    for x in (roomy, slow, tight):
        assert_no_blocks_held(x)


def test_no_tensor_is_created_without_a_device(text_ids):
    """Under a meta default device, any tensor created without `device=` breaks the step: on a
    GPU machine the same line would put a CPU tensor beside CUDA ones."""
    llm = LLM(block_size=4, max_model_len=64, kv_cache_tokens=96, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    system = text_ids[:24]
    prompts = [{"prompt_token_ids": system + text_ids[50 + 7 * i:56 + 7 * i]} for i in range(4)]
    sp = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)]
    expected = LLM(block_size=4, max_model_len=96, kv_cache_tokens=1024).generate(prompts[:1], sp[0])
    torch.set_default_device("meta")
    try:
        out = llm.generate(prompts, sp)
        beams = llm.beam_search(prompts[0], BeamSearchParams(beam_width=2, max_tokens=6))
    finally:
        torch.set_default_device(None)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert out[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert beams[0].sequences
    assert_no_blocks_held(llm)


def test_a_stop_string_on_the_last_allowed_token_wins_over_length(llm):
    prompt = "Here is a list of fruits:\n-"
    free = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
    assert "\n" in free.text  # the third token completes a newline
    out = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, stop=["\n"]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "\n"
    assert out.outputs[0].text == free.text[:free.text.index("\n")]


def test_offline_logprobs_come_back_per_token(llm):
    out = llm.generate("The capital of France is",
                       SamplingParams(max_tokens=5, temperature=0, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and 2 <= len(lp) <= 3 and all(v <= 0 for v in lp.values())
        assert lp[token] == max(lp.values())  # greedy takes the most likely token
    plain = llm.generate("The capital of France is", SamplingParams(max_tokens=5, temperature=0))
    assert plain[0].outputs[0].logprobs is None


def test_a_failed_step_leaves_no_cached_block_without_kv(text_ids):
    """Blocks are keyed when they are allocated, before the forward writes them: a step that
    fails must forget those keys, or the next request with the same prefix reads garbage."""
    from kvlab.engine import EngineStepError

    llm = LLM(block_size=8, max_model_len=128, kv_cache_tokens=1024, enable_prefix_caching=True)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": text_ids[:40]}  # five full blocks
    real = engine.model_runner.execute_model

    def broken(sched):
        engine.model_runner.execute_model = real
        raise RuntimeError("injected: the kernel failed")

    engine.model_runner.execute_model = broken
    engine.add_request("doomed", prompt, GREEDY)
    with pytest.raises(EngineStepError) as err:
        engine.step()
    assert err.value.request_ids == ["doomed"]
    assert_no_blocks_held(llm)
    again = llm.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens == 0  # nothing was found: the keys are gone
    cold = LLM(block_size=8, max_model_len=128, kv_cache_tokens=1024).generate(prompt, GREEDY)
    assert again.outputs[0].token_ids == cold[0].outputs[0].token_ids
    assert_no_blocks_held(llm)

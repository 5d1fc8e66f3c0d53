"""The engine's API on the real model: sampling, chat, LLMEngine steps, stats, layouts."""

from __future__ import annotations

from tests.helpers import assert_no_blocks_held, llm_fixture

from kvlab import LLM, SamplingParams


llm = llm_fixture(block_size=16, max_model_len=256, kv_cache_tokens=2048)


def test_weights_are_loaded_once_and_shared(llm):
    other = LLM(block_size=4, max_model_len=64, kv_cache_tokens=256)
    assert other.llm_engine.loaded is llm.llm_engine.loaded
    assert other.llm_engine.kv_cache is not llm.llm_engine.kv_cache


def test_kv_bytes_per_token_and_capacity(llm):
    s = llm.stats()
    # SmolLM2-135M: 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (fp32).
    assert s["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4 == 46_080
    assert s["num_blocks"] == 2048 // 16 + 1 and s["kv_capacity_tokens"] == 2048
    assert s["kv_cache_bytes"] == (2048 + 16) * 46_080  # block 0, the null block, included


def test_chat_template_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=20, temperature=0))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # it ended with EOS, not the limit


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=123, n=3)
    alone = llm.generate("Once upon a time", sp)[0]
    crowd = llm.generate(["Hello there", "Once upon a time", "A B C"], sp)[1]
    assert len(alone.outputs) == 3 and [o.index for o in alone.outputs] == [0, 1, 2]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in crowd.outputs]
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1  # the samples differ
    other_seed = llm.generate("Once upon a time", SamplingParams(
        max_tokens=12, temperature=0.9, seed=124))[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    assert_no_blocks_held(llm)


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("The sky is", SamplingParams(max_tokens=10, temperature=0))
    topk1 = llm.generate("The sky is", SamplingParams(max_tokens=10, temperature=1.5, top_k=1))
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids


def test_stop_token_ids_and_max_model_len(llm):
    tok = llm.get_tokenizer()
    free = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=8, temperature=0))[0]
    stop_at = free.outputs[0].token_ids[2]
    stopped = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=8, temperature=0,
                                                          stop_token_ids=[stop_at]))[0]
    first = free.outputs[0].token_ids.index(stop_at)
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    long_prompt = tok("word " * 250).input_ids[:250]
    out = llm.generate({"prompt_token_ids": long_prompt},
                       SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 256 - 250  # stopped by max_model_len
    assert out.outputs[0].finish_reason == "length"


def test_llm_engine_steps_with_arrivals_and_metrics(llm):
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("a", "First request", sp)
    # Async scheduling (vLLM's default): the first call schedules and runs a step but does not
    # read its token; the second schedules the next step first, then reads the first.
    assert engine.step() == []
    outs = engine.step()
    assert [o.request_id for o in outs] == ["a"] and len(outs[0].outputs[0].token_ids) == 1
    engine.add_request("b", {"prompt": "Second request", "cache_salt": "tenant-b"}, sp)
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert set(finished) == {"a", "b"}
    m = finished["b"].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 4 and len(m.itl) == 3 and m.ttft > 0
    trace = list(engine.step_trace)[-5:]
    assert trace[-1].num_running == 0 and any(r.num_decode_tokens == 2 for r in trace)
    assert_no_blocks_held(llm)


def test_contiguous_admits_fewer_requests_in_the_same_budget(text_ids):
    prompts = [{"prompt_token_ids": text_ids[i : i + 40]} for i in range(12)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    running = {}
    for layout in ("paged", "contiguous"):
        llm = LLM(block_size=16, kv_layout=layout, max_model_len=256, kv_cache_tokens=1024)
        outs = llm.generate(prompts, sp)
        running[layout] = max(r.num_running for r in llm.llm_engine.step_trace)
        assert_no_blocks_held(llm)
        assert len(outs) == 12
    assert running["contiguous"] == 1024 // 256  # four max-length regions
    assert running["paged"] == 12  # 12 x 3 blocks fit in 64 blocks

"""Bad input is refused with a clear error before it touches engine state; afterwards the engine
answers exactly as before and holds no blocks."""

from __future__ import annotations

import pytest
from tests.helpers import assert_no_blocks_held, llm_fixture

from kvlab import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=-4), ValueError, "block_size"),
        (dict(block_size=1.5), TypeError, "block_size"),
        (dict(block_size="16"), TypeError, "block_size"),
        (dict(block_size=True), TypeError, "block_size"),
        (dict(kv_layout="tree"), ValueError, "kv_layout"),
        (dict(kv_cache_tokens=0), ValueError, "kv_cache_tokens"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), ValueError, "max_num_batched_tokens"),
        (dict(max_model_len=1), ValueError, "max_model_len"),
        (dict(kv_cache_tokens=100, max_model_len=200), ValueError, "kv_cache_tokens"),
        (dict(enable_chunked_prefill="yes"), TypeError, "enable_chunked_prefill"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128),
         ValueError, "max_num_batched_tokens"),
        (dict(scheduling="fifo"), ValueError, "scheduling"),
        (dict(device="tpu"), ValueError, "device"),
        (dict(dtype="int8"), ValueError, "dtype"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(model=""), ValueError, "model"),
        (dict(model=3), TypeError, "model"),
        (dict(enable_prefix_caching=True, kv_layout="contiguous"), ValueError, "enable_prefix_caching"),
        (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching"),
        (dict(prefix_caching_hash_algo="md5"), ValueError, "prefix_caching_hash_algo"),
        # vLLM's kv_cache_dtype and kv_cache_memory_bytes
        (dict(kv_cache_dtype="int3"), ValueError, "kv_cache_dtype='int3'.*int8_per_token_head"),
        (dict(kv_cache_dtype="nvfp4"), ValueError, "not supported by kvlab"),
        (dict(kv_cache_dtype=8), TypeError, "kv_cache_dtype"),
        (dict(kv_cache_memory_bytes=0), ValueError, "kv_cache_memory_bytes"),
        (dict(kv_cache_memory_bytes=2**20, kv_cache_tokens=256), ValueError,
         "both size the KV pool"),
        (dict(kv_cache_memory_bytes=1000), ValueError, "smaller than two KV blocks.*737280"),
        (dict(kv_cache_memory_bytes=4 * 2**20, max_model_len=256), ValueError,
         "holds 64 tokens.*max_model_len=256"),
    ],
)
def test_bad_engine_knobs(kwargs, error, words):
    with pytest.raises(error, match=words):
        LLM(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(max_tokens=2.0), TypeError, "max_tokens"),
        (dict(temperature=-0.1), ValueError, "temperature"),
        (dict(temperature="hot"), TypeError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_k=-2), ValueError, "top_k"),
        (dict(n=0), ValueError, "n must"),
        (dict(seed=2**63), ValueError, "seed"),
        (dict(ignore_eos=1), TypeError, "ignore_eos"),
        (dict(stop_token_ids=[1, "2"]), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, error, words):
    with pytest.raises(error, match=words):
        SamplingParams(**kwargs)


llm = llm_fixture(block_size=16, max_model_len=128, kv_cache_tokens=1024)


BAD_PROMPTS = [
    ("", ValueError, "empty"),
    ({"prompt": ""}, ValueError, "empty"),
    ({"prompt_token_ids": []}, ValueError, "no tokens"),
    ({"prompt_token_ids": [1, 2, 49152]}, ValueError, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -1]}, ValueError, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2.0]}, TypeError, "ints"),
    ({"prompt_token_ids": [1, True]}, TypeError, "ints"),
    ({"prompt_token_ids": "1 2 3"}, TypeError, "list of ints"),
    ({"prompt_token_ids": [5] * 128}, ValueError, "max_model_len"),
    ({"cache_salt": "a"}, ValueError, "exactly one of"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, ValueError, "exactly one of"),
    ({"prompt": "hi", "cache_salt": 7}, TypeError, "cache_salt"),
    ({"prompt": "hi", "salt": "a"}, ValueError, "unknown prompt keys"),
    ({"prompt": 42}, TypeError, "'prompt' must be a str"),
    (42, TypeError, "a prompt must be"),
    (["hi"], TypeError, "a prompt must be"),
]


@pytest.mark.parametrize("bad, error, words", BAD_PROMPTS)
def test_bad_prompt_changes_nothing(llm, bad, error, words):
    good = {"prompt": "The capital of France is"}
    before = llm.generate(good, GREEDY)[0].outputs[0].token_ids
    stats_before = llm.stats()
    # The bad prompt sits after a good one: nothing of the batch may be admitted.
    with pytest.raises(error, match=words):
        llm.generate([good, bad], GREEDY)
    assert llm.stats() == stats_before
    assert_no_blocks_held(llm)
    assert llm.generate(good, GREEDY)[0].outputs[0].token_ids == before


@pytest.mark.parametrize(
    "prompts, params, error, words",
    [
        ([], GREEDY, ValueError, "empty"),
        ("hi", "greedy", TypeError, "SamplingParams"),
        (["a", "b"], [GREEDY], ValueError, "2 prompts"),
        (["a"], [None], TypeError, "SamplingParams"),
        (object(), GREEDY, TypeError, "prompts"),
    ],
)
def test_bad_generate_arguments(llm, prompts, params, error, words):
    with pytest.raises(error, match=words):
        llm.generate(prompts, params)
    assert_no_blocks_held(llm)


def test_engine_request_ids(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="unknown request_id"):
        engine.abort_request("nope")
    engine.add_request("r1", "Hello", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r1", "Hello again", GREEDY)
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(7, "Hello", GREEDY)
    engine.step()
    assert llm.stats()["num_used_blocks"] > 0
    engine.abort_request("r1")
    assert_no_blocks_held(llm)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(beam_width=0, max_tokens=4), ValueError, "beam_width"),
        (dict(beam_width=2.0, max_tokens=4), TypeError, "beam_width"),
        (dict(beam_width=2, max_tokens=0), ValueError, "max_tokens"),
        (dict(beam_width=2, max_tokens=4, ignore_eos="no"), TypeError, "ignore_eos"),
        (dict(beam_width=2, max_tokens=4, length_penalty="long"), TypeError, "length_penalty"),
    ],
)
def test_bad_beam_search_params(kwargs, error, words):
    from kvlab import BeamSearchParams

    with pytest.raises(error, match=words):
        BeamSearchParams(**kwargs)


def _engine_entry_points():
    """(name, call(llm), error, words): every other public way in, with bad input."""
    from kvlab import BeamSearchParams

    beams = BeamSearchParams(beam_width=2, max_tokens=4)
    return [
        ("beam_search empty prompt", lambda llm: llm.beam_search("", beams), ValueError, "empty"),
        ("beam_search oversized", lambda llm: llm.beam_search(
            {"prompt_token_ids": [5] * 200}, beams), ValueError, "max_model_len"),
        ("beam_search bad salt", lambda llm: llm.beam_search(
            {"prompt": "hi", "cache_salt": 1}, beams), TypeError, "cache_salt"),
        ("beam_search no prompts", lambda llm: llm.beam_search([], beams), TypeError, "prompts"),
        ("chat not messages", lambda llm: llm.chat(["hello"]), TypeError, "conversation"),
        ("add_request bad params", lambda llm: llm.llm_engine.add_request(
            "x", "hi", {"max_tokens": 3}), TypeError, "SamplingParams"),
        ("add_request bad prompt", lambda llm: llm.llm_engine.add_request(
            "x", {"prompt_token_ids": [-5]}, GREEDY), ValueError, "vocabulary"),
        ("add_request empty id", lambda llm: llm.llm_engine.add_request("", "hi", GREEDY),
         TypeError, "request_id"),
        ("abort unknown id", lambda llm: llm.llm_engine.abort_request("ghost"), ValueError,
         "unknown request_id"),
        ("abort non-str id", lambda llm: llm.llm_engine.abort_request(3), ValueError,
         "unknown request_id"),
    ]


@pytest.mark.parametrize("name, call, error, words", _engine_entry_points(),
                         ids=[e[0] for e in _engine_entry_points()])
def test_every_entry_point_refuses_bad_input_and_changes_nothing(llm, name, call, error, words):
    good = {"prompt": "The capital of France is"}
    before = llm.generate(good, GREEDY)[0].outputs[0].token_ids
    stats_before = llm.stats()
    with pytest.raises(error, match=words):
        call(llm)
    assert llm.stats() == stats_before
    assert_no_blocks_held(llm)
    assert llm.generate(good, GREEDY)[0].outputs[0].token_ids == before

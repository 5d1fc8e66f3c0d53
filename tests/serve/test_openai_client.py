"""Every endpoint and option `kvlab serve` has, driven through the official `openai` client, as a
participant would drive vLLM: completions and chat (plain, streamed, n, seed, stop, vLLM's
extras through `extra_body`), logprobs in both shapes, echo, prompt logprobs (and vLLM's rule
that they skip reading the prefix cache), the role chunk, 404 for another model, 400s,
`/metrics` under vLLM's names (the KV block residency histograms too), the dev route, and a
disconnect storm that leaks no block and logs one line per hang-up.

Prompt logprobs are also checked offline against transformers' own forward.
"""

from __future__ import annotations

import logging
import math
import urllib.request

import pytest
import torch
from tests.helpers import assert_no_blocks_held, parse_metrics, wait_idle

from kvlab import LLM, SamplingParams
from kvlab.serve import BackgroundServer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served():
    # A small pool (32 blocks), so later tests evict blocks and the residency histograms fill.
    llm = LLM(max_model_len=256, kv_cache_tokens=512, enable_prefix_caching=True,
              max_num_batched_tokens=64)
    server = BackgroundServer(llm, enable_prompt_tokens_details=True, dev_mode=True)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield server, llm, client, client.models.list().data[0].id
    server.stop()


@pytest.fixture(scope="module")
def offline():
    return LLM(max_model_len=256, kv_cache_tokens=512)


def metrics(server) -> dict[str, float]:
    """/metrics as {series (with labels): value}."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        return parse_metrics(resp.read().decode())


def metric(values: dict, name: str) -> float:
    """The one series of `name` (kvlab serves one model, engine "0")."""
    (value,) = [v for k, v in values.items() if k.split("{")[0] == name]
    return value


PARIS = "The capital of France is"
HI = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_health_and_404_for_another_model(served):
    server, _, client, name = served
    assert [m.id for m in client.models.list().data] == [name]
    with urllib.request.urlopen(server.url + "/health", timeout=30) as resp:
        assert resp.status == 200
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt=PARIS, max_tokens=2)
    assert "The model `gpt-4o` does not exist." in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)


def test_completions_options_equal_offline(served, offline):
    _, llm, client, name = served
    r = client.completions.create(model=name, prompt=PARIS, max_tokens=8, temperature=0,
                                  logprobs=2)
    want = offline.generate(PARIS, SamplingParams(max_tokens=8, temperature=0, logprobs=2))[0]
    choice = r.choices[0]
    assert choice.text == want.outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(want.outputs[0].token_ids) == r.usage.completion_tokens
    for got, entry, tok in zip(lp.token_logprobs, want.outputs[0].logprobs,
                               want.outputs[0].token_ids):
        assert math.isclose(got, entry[tok], abs_tol=1e-4)
    assert all(len(top) <= 3 for top in lp.top_logprobs)  # logprobs + 1, as OpenAI's
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    # n, seed, stop, vLLM's extras through extra_body, token ids as the prompt.
    r = client.completions.create(model=name, prompt=PARIS, max_tokens=6, temperature=1.0,
                                  n=2, seed=7, stop=["\n"],
                                  extra_body={"top_k": 20, "ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    ids = llm.get_tokenizer()(PARIS)["input_ids"]
    r = client.completions.create(model=name, prompt=ids, max_tokens=3, temperature=0)
    assert r.choices[0].text == offline.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].text
    wait_idle(llm)


def test_echo_and_prompt_logprobs(served, offline):
    _, llm, client, name = served
    r = client.completions.create(model=name, prompt=PARIS, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1)
    choice = r.choices[0]
    n_prompt = r.usage.prompt_tokens
    assert choice.text.startswith(PARIS)
    assert choice.logprobs.token_logprobs[0] is None  # nothing predicts the first token
    assert len(choice.logprobs.tokens) == n_prompt + r.usage.completion_tokens
    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per prompt token.
    r = client.completions.create(model=name, prompt=PARIS, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    want = offline.generate(PARIS, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert plp[0] is None and len(plp) == len(want.prompt_token_ids)
    for entry, token, expected in zip(plp[1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
        own = entry[str(token)]
        assert math.isclose(own["logprob"], expected[token].logprob, abs_tol=1e-4)
        assert own["rank"] == expected[token].rank >= 1
        assert isinstance(own["decoded_token"], str)
    # Chat has it at the response level.
    r = client.chat.completions.create(model=name, messages=HI, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    assert r.model_extra["prompt_logprobs"][0] is None
    with pytest.raises(openai.BadRequestError, match="not available"):  # as vLLM
        client.completions.create(model=name, prompt=PARIS, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    wait_idle(llm)


def test_prompt_logprobs_skip_reading_the_prefix_cache(served, text_ids):
    """vLLM's skip_reading_prefix_cache (vllm/sampling_params.py): a request asking for prompt
    logprobs computes its whole prompt (no hit, not counted as a query) but still writes the
    cache for the next one."""
    server, llm, client, name = served
    prompt = text_ids[:100]
    client.completions.create(model=name, prompt=prompt, max_tokens=1)  # cached now
    before = metrics(server)
    r = client.completions.create(model=name, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 0})
    after = metrics(server)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(after, "vllm:prefix_cache_queries_total") == metric(
        before, "vllm:prefix_cache_queries_total")
    assert len(r.choices[0].model_extra["prompt_logprobs"]) == 100
    r = client.completions.create(model=name, prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens == 96
    wait_idle(llm)


def test_chat_logprobs_and_the_role_chunk(served, offline):
    _, llm, client, name = served
    r = client.chat.completions.create(model=name, messages=HI, max_completion_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the sampled is top

    events = list(client.chat.completions.create(
        model=name, messages=HI, max_tokens=6, temperature=0, n=2, stream=True,
        logprobs=True, stream_options={"include_usage": True}))
    firsts = events[:2]
    assert [(e.choices[0].index, e.choices[0].delta.role, e.choices[0].delta.content)
            for e in firsts] == [(0, "assistant", ""), (1, "assistant", "")]
    text = "".join(e.choices[0].delta.content or "" for e in events
                   if e.choices and e.choices[0].index == 0)
    assert text == r.choices[0].message.content[:len(text)] and text
    tokens = sum(len(e.choices[0].logprobs.content) for e in events[2:]
                 if e.choices and e.choices[0].index == 0 and e.choices[0].logprobs)
    assert tokens == 6
    assert events[-1].usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=name, messages=HI, max_tokens=1, top_logprobs=2)
    wait_idle(llm)


def test_streamed_completion_with_echo_and_logprobs(served):
    _, llm, client, name = served
    plain = client.completions.create(model=name, prompt=PARIS, max_tokens=5, temperature=0,
                                      echo=True, logprobs=0)
    events = list(client.completions.create(model=name, prompt=PARIS, max_tokens=5,
                                            temperature=0, echo=True, logprobs=0, stream=True))
    assert "".join(e.choices[0].text for e in events) == plain.choices[0].text
    offsets = [o for e in events for o in e.choices[0].logprobs.text_offset]
    assert offsets == plain.choices[0].logprobs.text_offset
    wait_idle(llm)


def test_cache_salt_cached_tokens_and_the_reset_route(served, text_ids):
    server, llm, client, name = served
    prompt = text_ids[200:300]
    cached = [client.completions.create(model=name, prompt=prompt, max_tokens=1,
                                        extra_body={"cache_salt": salt}
                                        ).usage.prompt_tokens_details.cached_tokens
              for salt in ("a", "a", "b")]
    assert cached == [0, 96, 0]
    wait_idle(llm)
    req = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.read() == b'{"success": true}'
    r = client.completions.create(model=name, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": "a"})
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    wait_idle(llm)


def test_bad_bodies_get_a_400_before_touching_the_engine(served):
    _, llm, client, name = served
    before = llm.llm_engine.num_requests_added
    for kwargs in ({"logprobs": 99}, {"extra_body": {"frequency_penalty": 1.0}},
                   {"extra_body": {"max_token": 3}}, {"temperature": 5}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=name, prompt=PARIS, max_tokens=2, **kwargs)
    assert llm.llm_engine.num_requests_added == before
    assert_no_blocks_held(llm)


def test_metrics_under_vllm_names(served, text_ids):
    server, llm, client, name = served
    # Distinct prompts through a 32-block pool: blocks are evicted and reused.
    for i in range(6):
        client.completions.create(model=name, prompt=text_ids[i * 60:(i + 1) * 60 + 40],
                                  max_tokens=4)
    wait_idle(llm)
    values = metrics(server)
    stats = llm.stats()
    assert metric(values, "vllm:prefix_cache_queries_total") == stats["prefix_cache_queries"]
    assert metric(values, "vllm:prefix_cache_hits_total") == stats["prefix_cache_hits"]
    assert metric(values, "vllm:num_preemptions_total") == stats["num_preemptions"]
    assert metric(values, "vllm:num_requests_running") == 0
    assert metric(values, "vllm:num_requests_waiting") == 0
    assert metric(values, "vllm:kv_cache_usage_perc") == 0
    assert metric(values, "vllm:prompt_tokens_total") > 0
    assert metric(values, "vllm:generation_tokens_total") > 0
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds"):
        assert metric(values, histogram + "_count") > 0, histogram
    assert "vllm:kv_block_reuse_gap_seconds_count" in "".join(values)
    # vLLM registers its KV connector prefix-cache counters on every server (loggers.py), at 0
    # without a connector; the offloading connector's own families only where it runs.
    assert metric(values, "vllm:external_prefix_cache_queries_total") == 0
    assert metric(values, "vllm:external_prefix_cache_hits_total") == 0
    assert not any(k.startswith(("vllm:kv_offload", "kvlab:kv_offload", "kvlab:kv_load"))
                   for k in values)
    labels = next(k for k in values if k.startswith("vllm:num_requests_running"))
    assert f'model_name="{name}"' in labels and 'engine="0"' in labels


@pytest.mark.slow
def test_disconnect_storm_leaks_nothing_and_logs_one_line_each(served, caplog):
    _, llm, client, name = served
    import asyncio

    aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        stream = await aclient.completions.create(
            model=name, prompt=f"Story {i}: once upon a time", max_tokens=40,
            stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            if i % 2:
                await stream.close()  # hang up mid-stream
                return "closed"
        return "done"

    async def storm():
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await aclient.close()

    with caplog.at_level(logging.INFO):
        outcome = asyncio.run(storm())
        assert outcome.count("closed") == 8
        assert_no_blocks_held_soon(llm)
    assert not [r for r in caplog.records if r.exc_info], "a hang-up logged a traceback"
    went_away = [r for r in caplog.records if "client went away" in r.getMessage()]
    assert 1 <= len(went_away) <= 8


def assert_no_blocks_held_soon(llm):
    wait_idle(llm)
    assert_no_blocks_held(llm)


def test_prompt_logprobs_equal_transformers_chunked_and_cached(loaded, text_ids):
    """Offline: every prompt position's logprob equals transformers' forward, whether the
    prompt runs in one step or in chunks, and whether or not its prefix is cached."""
    prompt = text_ids[:150]
    with torch.inference_mode():
        ref = loaded.hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for kwargs in ({}, {"max_num_batched_tokens": 32, "enable_prefix_caching": True}):
        llm = LLM(max_model_len=256, kv_cache_tokens=1024, **kwargs)
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))  # cache it
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
        assert out.num_cached_tokens == 0  # skipped reading the cache
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-3
            assert len(entry) in (3, 4)  # the prompt token, then the top 3 (it may be one)
            top = ref[i - 1].topk(1).indices.item()
            assert entry[top].rank == 1 or abs(entry[top].logprob - ref[i - 1].max()) < 1e-4
        assert_no_blocks_held(llm)

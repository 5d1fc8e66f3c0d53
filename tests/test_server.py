"""`kvlab serve` on loopback: OpenAI-compatible completions and chat, streaming, cache_salt and
cached_tokens, /metrics, 4xx for bad requests, abort on disconnect, and the benchmark client."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from kvlab import LLM, SamplingParams
from kvlab.bench.client import run_benchmark
from kvlab.server import BackgroundServer


@pytest.fixture(scope="module")
def server():
    llm = LLM(max_model_len=256, kv_cache_tokens=4096, enable_prefix_caching=True)
    background = BackgroundServer(llm, enable_prompt_tokens_details=True)
    yield background.url, llm
    background.stop()


def post(url: str, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_idle(llm, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = llm.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_used_blocks"] == 0:
            return s
        time.sleep(0.1)
    raise AssertionError(llm.stats())


def test_completion_equals_offline_generate(server):
    base, llm = server
    status, text = post(base + "/v1/completions",
                        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert status == 200
    body = json.loads(text)
    offline = LLM(max_model_len=256, kv_cache_tokens=4096).generate(
        "The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
    assert body["choices"][0]["text"] == offline.outputs[0].text
    assert body["usage"]["completion_tokens"] == len(offline.outputs[0].token_ids)
    assert body["object"] == "text_completion"
    wait_idle(llm)


def test_streaming_and_chat(server):
    base, llm = server
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                         "max_tokens": 20, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"})
    pieces, usage = [], None
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = resp.read().decode().split("\n\n")
    assert lines[-2] == "data: [DONE]"
    for line in lines[:-2]:
        chunk = json.loads(line[len("data: "):])
        usage = chunk.get("usage") or usage
        pieces += [c["delta"]["content"] for c in chunk["choices"]]
    assert "Paris" in "".join(pieces) and len(pieces) > 2
    assert usage["completion_tokens"] > 0
    wait_idle(llm)


def test_cache_salt_and_cached_tokens(server):
    base, llm = server
    doc = list(range(1000, 1100))
    cached = []
    for salt in ("a", "a", "b", None):
        body = {"prompt": doc, "max_tokens": 1, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        status, text = post(base + "/v1/completions", body)
        assert status == 200
        cached.append(json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 96, 0, 0]
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    hits = next(line for line in metrics.splitlines()
                if line.startswith("kvlab:prefix_cache_hits_total"))
    assert float(hits.split()[1]) >= 96
    assert "kvlab:num_preemptions_total" in metrics


def test_serve_flags_map_onto_llm_knobs():
    from kvlab.cli import engine_kwargs, parser

    args = parser().parse_args(
        "serve --block-size 32 --max-num-seqs 8 --max-num-batched-tokens 256 --max-model-len 256 "
        "--enable-prefix-caching --no-enable-chunked-prefill --prefix-caching-hash-algo sha512 "
        "--enable-prompt-tokens-details".split())
    assert args.enable_prompt_tokens_details
    config = LLM(**engine_kwargs(args)).llm_engine.config
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_model_len) == (32, 8, 256, 256)
    assert config.enable_prefix_caching and not config.enable_chunked_prefill
    assert config.prefix_caching_hash_algo == "sha512"


def test_prompt_tokens_details_only_when_enabled():
    """As vLLM: `usage.prompt_tokens_details` appears only with --enable-prompt-tokens-details."""
    background = BackgroundServer(LLM(max_model_len=64, kv_cache_tokens=512))
    try:
        status, text = post(background.url + "/v1/completions",
                            {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    finally:
        background.stop()
    assert status == 200
    assert json.loads(text)["usage"]["total_tokens"] > 2
    assert "prompt_tokens_details" not in json.loads(text)["usage"]


@pytest.mark.parametrize("body, raw, words", [
    (None, b"{not json", "valid JSON"),
    ([1, 2], None, "JSON object"),
    ({"max_tokens": 4}, None, "'prompt'"),
    ({"prompt": "hi", "max_tokens": 0}, None, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, None, "temperature"),
    ({"prompt": [5] * 300}, None, "max_model_len"),
    ({"prompt": [99999999]}, None, "vocabulary"),
    ({"prompt": "hi", "cache_salt": 3}, None, "cache_salt"),
    ({"prompt": "", "max_tokens": 2}, None, "empty"),
    ({"prompt": "hi", "stream": "yes"}, None, "stream"),
])
def test_bad_requests_get_400_with_a_reason(server, body, raw, words):
    base, llm = server
    status, text = post(base + "/v1/completions", body, raw)
    assert status == 400 and words in json.loads(text)["error"]["message"]
    assert post(base + "/v1/chat/completions", {"messages": []})[0] == 400
    wait_idle(llm)


def test_oversized_body_is_refused(server):
    base, _ = server
    status, _ = post(base + "/v1/completions", None, b'{"prompt": "' + b"a" * 2_000_000 + b'"}')
    assert status == 413


def test_client_disconnect_aborts_and_frees_blocks(server):
    base, llm = server

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={
                "prompt": "Tell me a long story.", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}) as resp:
                async for _ in resp.content:
                    break  # one chunk, then hang up
        await asyncio.sleep(0.5)

    asyncio.run(go())
    s = wait_idle(llm)
    assert s["num_free_blocks"] == s["num_blocks"]


def test_benchmark_client_against_kvlab_serve(server):
    base, llm = server
    prompts = [f"Request {i}: count from one to ten." for i in range(6)]
    res = asyncio.run(run_benchmark(base, prompts, max_tokens=8, concurrency=3,
                                    request_rate=20.0))
    assert res["errors"] == 0 and res["requests"] == 6
    assert all(r.ttft is not None and len(r.itls) >= 1 for r in res["results"])
    assert res["output_tok_s"] > 0
    wait_idle(llm)

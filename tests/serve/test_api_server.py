"""`kvlab serve` on loopback: OpenAI-compatible completions and chat, streaming, cache_salt and
cached_tokens, /metrics, 4xx for bad requests, abort on disconnect, and the benchmark client;
stop strings, refused and unknown fields, and an engine loop that survives a failing step."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from tests.helpers import wait_idle

from kvlab import LLM, SamplingParams
from kvlab.bench.stream_client import run_benchmark
from kvlab.serve import BackgroundServer
from kvlab.serve.protocol import SUPPORTED_FIELDS, UNSUPPORTED_FIELDS


@pytest.fixture(scope="module")
def server():
    llm = LLM(max_model_len=256, kv_cache_tokens=4096, enable_prefix_caching=True)
    background = BackgroundServer(llm, enable_prompt_tokens_details=True)
    yield background.url, llm
    background.stop()


@pytest.fixture(scope="module")
def offline():
    """A second engine for the expected answers: the server's engine is stepped by its own
    thread, so it must never be driven by `generate` at the same time."""
    return LLM(max_model_len=256, kv_cache_tokens=4096)


def post(url: str, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_completion_equals_offline_generate(server, offline):
    base, llm = server
    status, text = post(base + "/v1/completions",
                        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert status == 200
    body = json.loads(text)
    offline = offline.generate(
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
                if line.startswith("vllm:prefix_cache_hits_total"))
    assert float(hits.split()[1]) >= 96
    assert "vllm:num_preemptions_total" in metrics


def test_serve_flags_map_onto_llm_knobs():
    from kvlab.serve.cli import engine_kwargs, parser

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
    assert (config.backend, config.enforce_eager) == ("auto", None)  # vLLM's defaults' meaning
    assert config.scheduler_reserve_full_isl and config.watermark == 0.0  # vLLM's defaults
    args = parser().parse_args("serve --no-scheduler-reserve-full-isl --watermark 0.25".split())
    config = LLM(**engine_kwargs(args)).llm_engine.config
    assert not config.scheduler_reserve_full_isl and config.watermark == 0.25
    args = parser().parse_args("serve --attention-backend flex --no-enforce-eager".split())
    config = LLM(**engine_kwargs(args)).llm_engine.config
    assert (config.backend, config.enforce_eager) == ("flex", False)
    with pytest.raises(SystemExit):  # argparse names the choices and exits 2
        parser().parse_args("serve --attention-backend FLASH_ATTN".split())
    assert config.policy == "fcfs"  # vLLM's default
    config = LLM(**engine_kwargs(parser().parse_args("serve --scheduling-policy priority".split()))
                 ).llm_engine.config
    assert config.policy == "priority"
    with pytest.raises(SystemExit):
        parser().parse_args("serve --scheduling-policy lifo".split())


def test_kv_cache_flags_map_onto_llm_knobs():
    """vLLM's --kv-cache-dtype and --kv-cache-memory-bytes (vllm/config/cache.py)."""
    from kvlab.serve.cli import engine_kwargs, parser

    args = parser().parse_args("serve --kv-cache-dtype fp8 --kv-cache-memory-bytes 8388608 "
                               "--max-model-len 64".split())
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    stats = LLM(**engine_kwargs(args)).stats()
    assert stats["kv_cache_dtype"] == "fp8_e4m3"  # vLLM's alias
    assert stats["num_blocks"] == 8388608 // (stats["kv_bytes_per_token"] * 16)
    defaults = engine_kwargs(parser().parse_args(["serve"]))
    assert (defaults["kv_cache_dtype"], defaults["kv_cache_memory_bytes"]) == ("auto", None)
    with pytest.raises(SystemExit):  # argparse names the choices and exits 2
        parser().parse_args("serve --kv-cache-dtype int3".split())


def test_reset_prefix_cache_route_in_dev_mode_only(text_ids):
    """vLLM's POST /reset_prefix_cache (vllm/entrypoints/serve/dev/cache/api_router.py): only
    with its dev routes on; answers {"success": bool}, false while blocks are held."""
    import urllib.error
    import urllib.request

    def post(url):
        req = urllib.request.Request(url, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    llm = LLM(max_model_len=64, kv_cache_tokens=512, enable_prefix_caching=True)
    plain = BackgroundServer(llm)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(plain.url + "/reset_prefix_cache")
        assert e.value.code in (404, 405)
    finally:
        plain.stop()
    llm.generate({"prompt_token_ids": text_ids[:40]}, SamplingParams(max_tokens=1))
    assert llm.llm_engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    engine = llm.llm_engine
    dev = BackgroundServer(llm, dev_mode=True)
    try:
        # Hold the server's worker idle, so "held" keeps its blocks while the routes run.
        engine.has_unfinished_requests = lambda: False
        with dev.engine.lock:
            engine.add_request("held", {"prompt_token_ids": text_ids[:20]},
                               SamplingParams(max_tokens=4))
            engine.step()
        assert post(dev.url + "/reset_prefix_cache") == {"success": False}
        assert engine.kv_cache_manager.block_pool.cached_block_hash_to_block  # untouched
        assert post(dev.url + "/reset_prefix_cache?reset_running_requests=true") == {
            "success": True}
        assert not engine.kv_cache_manager.block_pool.cached_block_hash_to_block
        assert engine.parents["held"][0].status.value == "preempted"
        del engine.has_unfinished_requests  # the worker runs "held" again, from scratch
        wait_idle(llm)
        assert "held" not in engine.parents
    finally:
        dev.stop()


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
    assert s["num_free_blocks"] == s["num_usable_blocks"]


def test_request_sent_during_a_decode_joins_it(server):
    """Continuous batching through the API: a request sent while another decodes is admitted at
    the next step, so it finishes long before the decode does. (When handlers took the engine's
    lock themselves, the worker took it again after every step and the new request waited for
    the decode to end.)"""
    base, llm = server

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={
                "prompt": "Tell me a long story.", "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True}) as resp:
                chunks, joined, short_done_at = 0, None, None
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        chunks += 1
                    if chunks == 4 and joined is None:
                        joined = asyncio.create_task(session.post(base + "/v1/completions", json={
                            "prompt": "Hi", "max_tokens": 2, "temperature": 0,
                            "ignore_eos": True}))
                    if short_done_at is None and joined is not None and joined.done():
                        short_done_at = chunks  # decode tokens streamed when it was answered
                short = await joined
                assert short.status == 200
                return chunks, short_done_at

    decode_chunks, short_done_at = asyncio.run(go())
    assert decode_chunks >= 100
    # The short request was answered while the decode still had most of its tokens to go.
    assert short_done_at is not None and short_done_at < 40, (short_done_at, decode_chunks)
    wait_idle(llm)


def test_benchmark_client_against_kvlab_serve(server):
    base, llm = server
    prompts = [f"Request {i}: count from one to ten." for i in range(6)]
    res = asyncio.run(run_benchmark(base, prompts, max_tokens=8, concurrency=3,
                                    request_rate=20.0))
    assert res["errors"] == 0 and res["requests"] == 6
    assert all(r.ttft is not None and len(r.itls) >= 1 for r in res["results"])
    assert res["output_tok_s"] > 0
    wait_idle(llm)


# ---- helpers for the tests below ----------------------------------------------------------------
def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream(url: str, body: dict):
    """POST a streaming request; returns its events (parsed JSON), having checked the [DONE]."""
    status, text = post(url, {**body, "stream": True})
    assert status == 200, text
    lines = text.split("\n\n")
    assert lines[-2:] == ["data: [DONE]", ""]
    return [json.loads(line[len("data: "):]) for line in lines[:-2]]


def streamed_text(events, chat: bool, index: int = 0) -> str:
    return "".join((c["delta"]["content"] if chat else c["text"])
                   for e in events for c in e.get("choices", []) if c["index"] == index)


def assert_all_blocks_free(llm):
    s = wait_idle(llm)
    assert s["num_free_blocks"] == s["num_usable_blocks"]


def fail_model_call(monkeypatch, llm, on_call: int, exc=None):
    """Make the model raise (once) on its `on_call`-th call from now; later calls run normally."""
    runner = llm.llm_engine.model_runner
    real, calls = runner.execute_model, []

    def flaky(sched):
        calls.append(sched)
        if len(calls) == on_call:
            raise exc or RuntimeError("injected failure inside the model")
        return real(sched)

    monkeypatch.setattr(runner, "execute_model", flaky)
    return calls


PARIS = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def assert_serves_correctly(base, offline):
    status, text = post(base + "/v1/completions", PARIS)
    assert status == 200, text
    expected = offline.generate(PARIS["prompt"], SamplingParams(max_tokens=8, temperature=0))
    assert json.loads(text)["choices"][0]["text"] == expected[0].outputs[0].text
    assert get(base + "/health")[0] == 200


# ---- the engine loop never dies -----------------------------------------------------------------
def test_failed_step_gets_500_and_the_server_goes_on(server, offline, monkeypatch):
    base, llm = server
    wait_idle(llm)
    calls = fail_model_call(monkeypatch, llm, on_call=1)
    status, text = post(base + "/v1/completions", {**PARIS, "max_tokens": 20})
    assert len(calls) >= 1
    assert status == 500
    error = json.loads(text)["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert "injected failure" in error["message"]
    assert_all_blocks_free(llm)  # the engine ended the request and returned its blocks
    assert_serves_correctly(base, offline)


def test_failed_step_mid_stream_sends_an_error_event(server, offline, monkeypatch):
    base, llm = server
    wait_idle(llm)
    fail_model_call(monkeypatch, llm, on_call=4)  # after the prompt and a few tokens
    events = stream(base + "/v1/completions", {"prompt": "Tell me a long story.",
                                               "max_tokens": 40, "temperature": 0,
                                               "ignore_eos": True})
    *chunks, last = events
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert last["error"]["type"] == "InternalServerError" and last["error"]["code"] == 500
    assert_all_blocks_free(llm)
    assert_serves_correctly(base, offline)


def test_engine_bug_fails_every_request_in_flight(server, offline, monkeypatch):
    """Not an EngineStepError: the server cannot know which requests are intact, so it ends them
    all itself (abort_request) and fails them, and keeps serving."""
    base, llm = server
    wait_idle(llm)
    scheduler = llm.llm_engine.scheduler
    real, fired = scheduler.update_from_output, []

    def buggy(sched, result):  # raises once, when both requests below are in the same step
        if not fired and len({r.parent_id for r, _ in sched.scheduled}) >= 2:
            fired.append(True)
            raise KeyError("injected scheduler bug")
        return real(sched, result)

    monkeypatch.setattr(scheduler, "update_from_output", buggy)
    # Hold the engine idle until both requests are queued, so that they share the first step
    # however slowly the second one arrives (on a loaded CI machine the first could finish alone).
    engine, has_work = llm.llm_engine, llm.llm_engine.has_unfinished_requests
    monkeypatch.setattr(engine, "has_unfinished_requests", lambda: has_work() and (
        bool(fired) or len(scheduler.waiting) + len(scheduler.running) >= 2))
    body = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}

    async def go():
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def plain():
                async with session.post(base + "/v1/completions",
                                        json={**body, "prompt": "One two three"}) as resp:
                    return resp.status, await resp.json()

            async def streamed():
                async with session.post(base + "/v1/chat/completions", json={
                        **body, "stream": True,
                        "messages": [{"role": "user", "content": "Count to fifty."}]}) as resp:
                    return resp.status, (await resp.read()).decode()

            return await asyncio.gather(plain(), streamed())

    (status, plain_body), (stream_status, stream_text) = asyncio.run(go())
    assert fired
    assert status == 500 and plain_body["error"]["type"] == "InternalServerError"
    assert "injected scheduler bug" in plain_body["error"]["message"]
    assert stream_status == 200  # the headers were sent before the failure
    events = stream_text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3][len("data: "):])["error"]["code"] == 500
    assert_all_blocks_free(llm)
    assert_serves_correctly(base, offline)


def test_health_is_503_once_the_engine_loop_is_gone():
    llm = LLM(max_model_len=64, kv_cache_tokens=512)
    # Stopped: /health says so, and a new request is refused instead of waiting forever.
    background = BackgroundServer(llm)
    try:
        assert get(background.url + "/health") == (200, "ok")
        background.engine.stop()
        status, text = get(background.url + "/health")
        assert status == 503 and "stopped" in json.loads(text)["error"]["message"]
        status, text = post(background.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 500 and "not running" in json.loads(text)["error"]["message"]
    finally:
        background.stop()
    # Died (something no `except Exception` catches): the request in flight is ended and failed.
    background = BackgroundServer(llm)
    try:
        runner = llm.llm_engine.model_runner

        def dies(sched):
            raise SystemExit("injected")

        runner.execute_model = dies
        try:
            status, text = post(background.url + "/v1/completions",
                                {"prompt": "Hi", "max_tokens": 4})
        finally:
            del runner.execute_model  # back to the class's method
        assert status == 500
        background.engine.thread.join(10)
        status, text = get(background.url + "/health")
        assert status == 503 and "died" in json.loads(text)["error"]["message"]
        assert json.loads(text)["error"]["type"] == "ServiceUnavailableError"
        s = llm.stats()
        assert s["num_free_blocks"] == s["num_usable_blocks"] and s["num_running"] == 0
    finally:
        background.stop()


# ---- DELTA streaming, stop strings --------------------------------------------------------------
FRUITS_PROMPT = "Here is a list of fruits:\n-"
FRUITS_CHAT = [{"role": "user", "content": "List three fruits, one per line."}]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "stream"])
def test_stop_string_ends_the_text_as_offline(server, offline, chat, streamed):
    base, llm = server
    sp = SamplingParams(max_tokens=24, temperature=0, stop=["\n"])
    full = SamplingParams(max_tokens=24, temperature=0)
    if chat:
        url, body = base + "/v1/chat/completions", {"messages": FRUITS_CHAT}
        expected, unstopped = offline.chat(FRUITS_CHAT, sp)[0], offline.chat(FRUITS_CHAT, full)[0]
    else:
        url, body = base + "/v1/completions", {"prompt": FRUITS_PROMPT}
        expected = offline.generate(FRUITS_PROMPT, sp)[0]
        unstopped = offline.generate(FRUITS_PROMPT, full)[0]
    assert "\n" in unstopped.outputs[0].text  # without `stop`, it would run on
    body = {**body, "max_tokens": 24, "temperature": 0, "stop": ["\n"]}
    if streamed:
        events = stream(url, body)
        text = streamed_text(events, chat)
        finals = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
        assert len(finals) == 1
        choice = finals[0]
    else:
        status, raw = post(url, body)
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "\n"
    assert "\n" not in text and text == expected.outputs[0].text
    wait_idle(llm)


def test_stop_as_a_string_and_include_stop_str_in_output(server, offline):
    base, _ = server
    sp = SamplingParams(max_tokens=24, temperature=0, stop="\n", include_stop_str_in_output=True)
    expected = offline.generate(FRUITS_PROMPT, sp)[0].outputs[0].text
    status, raw = post(base + "/v1/completions", {
        "prompt": FRUITS_PROMPT, "max_tokens": 24, "temperature": 0, "stop": "\n",
        "include_stop_str_in_output": True})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected
    assert expected.endswith("\n")


def test_n_streamed_per_index_matches_plain(server):
    base, llm = server
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 3}
    status, raw = post(base + "/v1/completions", body)
    assert status == 200
    plain = {c["index"]: c for c in json.loads(raw)["choices"]}
    events = stream(base + "/v1/completions", body)
    for i in range(3):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        finals = [c for c in mine if c["finish_reason"] is not None]
        assert len(finals) == 1 and mine[-1] is finals[0]  # once, and last
        assert finals[0]["finish_reason"] == plain[i]["finish_reason"]
        assert "".join(c["text"] for c in mine) == plain[i]["text"]
    assert len({p["text"] for p in plain.values()}) > 1  # really three samples
    wait_idle(llm)


# ---- fields kvlab does not implement are refused, by name ---------------------------------------
REFUSED = [
    ("suffix", "x"),
    ("best_of", 3), ("frequency_penalty", 0.5), ("presence_penalty", -1),
    ("logit_bias", {"42": 10}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("functions", [{"name": "f"}]),
    ("response_format", {"type": "json_object"}), ("min_p", 0.1), ("repetition_penalty", 1.2),
    ("use_beam_search", True),
]
# Implemented on one endpoint only: refused by name on the other.
REFUSED_ON = [(True, "echo", True), (False, "top_logprobs", 2)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_unsupported_field_is_refused_by_name(server, chat, field, value):
    base, _ = server
    assert field in UNSUPPORTED_FIELDS
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    body = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    status, raw = post(url, {**body, "max_tokens": 2, field: value})
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "BadRequestError" and error["param"] == field
    assert f"'{field}'" in error["message"] and "not supported" in error["message"]


@pytest.mark.parametrize("chat, field, value", REFUSED_ON)
def test_field_of_the_other_endpoint_is_refused_by_name(server, chat, field, value):
    test_unsupported_field_is_refused_by_name(server, chat, field, value)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_fields_at_their_no_op_value_are_accepted(server, chat):
    base, llm = server
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    prompt = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    plain = {**prompt, "max_tokens": 3, "temperature": 0}
    status, raw = post(url, plain)
    assert status == 200
    answer = json.loads(raw)["choices"]
    tags = {"model": llm.llm_engine.loaded.name, "user": "u-1", "n": 2, "best_of": 2, "stop": None,
            "cache_salt": None, "stream": None, "seed": None, "top_k": -1}
    for round_ in range(2):  # every no-op value of every unsupported field, over two requests
        noops = {f: v[round_ % len(v)] for f, v in UNSUPPORTED_FIELDS.items()}
        status, raw = post(url, {**plain, **noops, **tags})
        assert status == 200, raw
        choices = json.loads(raw)["choices"]
        assert [c.get("text") or c["message"]["content"] for c in choices] == \
            [c.get("text") or c["message"]["content"] for c in answer] * 2  # greedy: the same
    wait_idle(llm)


@pytest.mark.parametrize("chat, field, hint", [
    (False, "max_token", "max_tokens"),
    (True, "temprature", "temperature"),
    (False, "messages", None),
    (True, "prompt", None),
    (True, "zzz_not_a_field", None),
])
def test_unknown_field_is_refused_by_name(server, chat, field, hint):
    base, _ = server
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    body = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    status, raw = post(url, {**body, field: 1})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == field
    assert f"unknown field '{field}'" in error["message"]
    if hint:
        assert f"did you mean '{hint}'" in error["message"]
    assert field not in SUPPORTED_FIELDS[url[len(base):]]


@pytest.mark.parametrize("body, words", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": "x"}, "stop_token_ids"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # only with stream (vLLM)
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "continuous_usage"),
    ({"stream": True, "stream_options": {"inclde_usage": True}}, "inclde_usage"),
    ({"logprobs": True}, "integer"),  # completions: a count, not a bool
    ({"logprobs": 21}, "between 0 and 20"),
    ({"prompt_logprobs": 1, "stream": True}, "not available"),  # as vLLM
    ({"best_of": 2, "n": 1}, "best_of"),
])
def test_more_bad_fields(server, body, words):
    base, _ = server
    status, raw = post(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})
    assert status == 400 and words in json.loads(raw)["error"]["message"]


def test_metrics_report_preempted_prefix_cache_counters(server):
    base, _ = server
    status, metrics = get(base + "/metrics")
    assert status == 200
    for name in ("kvlab:prefix_cache_preempted_queries_total",
                 "kvlab:prefix_cache_preempted_hits_total"):
        assert f"# TYPE {name} counter" in metrics
        assert any(line.startswith((name + " ", name + "{")) for line in metrics.splitlines())


def test_hybrid_flags_serve_a_windowed_model_through_the_openai_client(text_ids):
    """vLLM's --hf-overrides and --prefix-cache-retention-interval: the served windowed model
    answers what the offline one does (chapter 09)."""
    openai = pytest.importorskip("openai")
    from kvlab.serve import BackgroundServer
    from kvlab.serve.cli import engine_kwargs, parser

    overrides = '{"layer_types": ' + str(["sliding_attention", "full_attention"] * 15).replace(
        "'", '"') + ', "sliding_window": 32}'
    args = parser().parse_args(["serve", "--block-size", "8", "--kv-cache-tokens", "1024",
                                "--max-model-len", "256", "--hf-overrides", overrides,
                                "--prefix-cache-retention-interval", "none"])
    kwargs = engine_kwargs(args)
    assert kwargs["prefix_cache_retention_interval"] is None
    llm = LLM(**kwargs)
    assert llm.stats()["num_kv_cache_groups"] == 2
    prompt = text_ids[:80]
    offline = LLM(**kwargs).generate({"prompt_token_ids": prompt},
                                     SamplingParams(max_tokens=12, temperature=0))
    server = BackgroundServer(llm)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        got = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                        max_tokens=12, temperature=0)
    finally:
        server.stop()
    assert got.choices[0].text == offline[0].outputs[0].text
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--hf-overrides", "[1, 2]"])

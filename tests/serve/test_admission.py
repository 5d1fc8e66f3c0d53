"""vLLM's `--max-num-queued-reqs` in `kvlab serve` (vllm/config/scheduler.py; the check is
AsyncLLM.check_admission, vllm/v1/engine/async_llm.py): past the limit a request gets vLLM's 503
(QueueOverflowError's body) before it reaches the engine, n > 1 counts n, the admitted requests
answer as offline, and nothing is left behind.

Each test holds the worker's lock (`AsyncEngine.lock`) while it sends its burst: the worker can
neither add nor step, so no admitted request can finish and which requests are refused does not
depend on timing.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.helpers import assert_no_blocks_held, wait_idle

from kvlab import LLM, SamplingParams
from kvlab.serve import BackgroundServer
from kvlab.serve.protocol import QUEUE_OVERFLOW_MESSAGE

openai = pytest.importorskip("openai")

# vLLM's body for QueueOverflowError: its create_error_response sets `type` to the status' phrase.
OVERFLOW_BODY = {"error": {"message": QUEUE_OVERFLOW_MESSAGE, "type": "Service Unavailable",
                           "param": None, "code": 503}}
LIMIT = 4
PROMPTS = [f"Question {i}: the capital of France is" for i in range(8)]
CHATS = [[{"role": "user", "content": f"Name {i + 1} fruits."}] for i in range(8)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, kv_cache_tokens=1024)


@pytest.fixture(scope="module")
def offline():
    """The expected answers: the served engine is stepped by its own thread, never here."""
    return LLM(max_model_len=256, kv_cache_tokens=1024)


@pytest.fixture
def serve(llm):
    """A server over the module's engine with the given options; stopped at the test's end,
    after checking that it left no request, block or admission slot behind."""
    servers = []

    def start(**options):
        server = BackgroundServer(llm, **options)
        servers.append(server)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        return server, client

    yield start
    try:
        for server in servers:
            wait_idle(llm)
            assert_no_blocks_held(llm)
            engine = server.engine
            assert engine.num_unfinished == 0 and not engine.unfinished and not engine.queues
    finally:
        for server in servers:
            server.stop()


def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def rejections(server) -> dict[str, float]:
    """vllm:admission_rejections_total per reason, from /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:admission_rejections_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="')[1].split('"')[0]] = float(value)
    return out


def send(client, i: int, n: int = 1, prompts=None):
    """Request `i` of a burst, by kind (i % 4): completions, streamed completions, chat,
    streamed chat. Returns ("ok", [texts]) or ("503", the client's exception)."""
    chat, stream = i % 4 >= 2, i % 2 == 1
    common = {"model": "", "max_tokens": MAX_TOKENS, "temperature": 0, "n": n,
              "stream": stream, "extra_body": {"ignore_eos": True}}
    try:
        if chat:
            r = client.chat.completions.create(messages=CHATS[i], **common)
        else:
            r = client.completions.create(prompt=prompts or PROMPTS[i], **common)
        texts: dict[int, str] = {}
        for chunk in (r if stream else [r]):
            for c in chunk.choices:
                piece = ((c.delta.content if stream else c.message.content) if chat else c.text)
                texts[c.index] = texts.get(c.index, "") + (piece or "")
        return "ok", [texts[k] for k in sorted(texts)]
    except openai.InternalServerError as e:  # the openai client's class for any 5xx
        return "503", e


def assert_overflow(result) -> None:
    kind, e = result
    assert kind == "503", result
    assert e.status_code == 503 and e.response.json() == OVERFLOW_BODY


def test_overload_gets_vllm_503_and_the_admitted_answer_as_offline(serve, offline, caplog):
    """8 requests at once (completions and chat, streamed and not) against a limit of 4: 4 are
    admitted and answer as offline, 4 get vLLM's 503 at once, counted in
    vllm:admission_rejections_total, and the server goes on with its count back at 0."""
    server, client = serve(max_num_queued_reqs=LIMIT)
    engine = server.engine
    with caplog.at_level(logging.DEBUG, logger="kvlab"), ThreadPoolExecutor(8) as pool:
        with engine.lock:  # nothing is added or stepped: no admitted request can finish
            futures = [pool.submit(send, client, i) for i in range(8)]
            until(lambda: sum(f.done() for f in futures) == 8 - LIMIT)
            assert engine.num_unfinished == LIMIT
            assert not engine.llm.llm_engine.parents  # the admitted wait for the worker
        results = [f.result(timeout=120) for f in futures]
    refused = [r for r in results if r[0] == "503"]
    assert len(refused) == 8 - LIMIT
    for r in refused:
        assert_overflow(r)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, (kind, texts) in enumerate(results):
        if kind == "ok":
            want = (offline.chat(CHATS[i], sp) if i % 4 >= 2 else offline.generate(PROMPTS[i], sp))
            assert texts == [want[0].outputs[0].text], i
    assert rejections(server) == {"max_num_queued_reqs": 8 - LIMIT, "max_num_queued_tokens": 0}
    # An overload is no error: no warning, no traceback.
    assert not [r for r in caplog.records if r.name.startswith("kvlab.serve")
                and (r.levelno >= logging.WARNING or r.exc_info)]
    assert any("request queue full" in r.getMessage() for r in caplog.records)
    wait_idle(engine.llm)
    until(lambda: engine.num_unfinished == 0)
    # Usable afterwards: a burst of the limit is admitted whole.
    with ThreadPoolExecutor(LIMIT) as pool:
        again = list(pool.map(lambda i: send(client, i), range(LIMIT)))
    assert all(kind == "ok" for kind, _ in again), again


def test_n_counts_n_and_prompts_times_n(serve):
    """As vLLM: a request of n samples takes n slots (its child requests); a completions request
    with several prompts takes prompts x n. An exact fit is admitted."""
    server, client = serve(max_num_queued_reqs=LIMIT)
    engine = server.engine
    with ThreadPoolExecutor(4) as pool:
        with engine.lock:
            admitted = [pool.submit(send, client, 0, 3)]  # n=3: 3 of 4
            until(lambda: engine.num_unfinished == 3)
            assert_overflow(send(client, 1, 2))  # 3 + 2 > 4, streamed
            assert_overflow(send(client, 2, 2))  # chat too
            assert_overflow(send(client, 0, 1, prompts=PROMPTS[:2]))  # 2 prompts: 3 + 2 > 4
            admitted.append(pool.submit(send, client, 3))  # 3 + 1 = 4: admitted
            until(lambda: engine.num_unfinished == 4)
            assert_overflow(send(client, 0))  # full
        results = [f.result(timeout=120) for f in admitted]
        assert [len(texts) for _, texts in results] == [3, 1]
        assert rejections(server)["max_num_queued_reqs"] == 4
        wait_idle(engine.llm)
        until(lambda: engine.num_unfinished == 0)
        with engine.lock:
            admitted = [pool.submit(send, client, 0, 2, prompts=PROMPTS[:2])]  # 2 x 2 = 4
            until(lambda: engine.num_unfinished == 4)
            assert_overflow(send(client, 1))
        (kind, texts), = [f.result(timeout=120) for f in admitted]
        assert kind == "ok" and len(texts) == 4


def test_a_client_that_leaves_before_its_add_gives_its_slots_back(serve):
    """Admitted, then gone before the worker added it: its slots count until the worker has
    added and aborted it (it was handed over), then come back."""
    server, client = serve(max_num_queued_reqs=LIMIT)
    engine = server.engine
    with engine.lock:
        with pytest.raises(openai.APITimeoutError):
            send(client.with_options(timeout=0.5), 0, LIMIT)  # takes every slot, hangs up
        assert engine.num_unfinished == LIMIT
        assert_overflow(send(client, 1))
    until(lambda: engine.num_unfinished == 0)
    assert send(client, 0, LIMIT)[0] == "ok"


def test_unset_means_no_limit_and_zero_refuses_all(serve):
    server, client = serve()
    engine = server.engine
    assert engine.max_num_queued_reqs is None
    with ThreadPoolExecutor(8) as pool:
        with engine.lock:
            futures = [pool.submit(send, client, i, 2) for i in range(8)]
            until(lambda: engine.num_unfinished == 16)  # all admitted, n=2 each
            assert not any(f.done() for f in futures)
        assert all(f.result(timeout=120)[0] == "ok" for f in futures)
    assert rejections(server)["max_num_queued_reqs"] == 0
    server.stop()
    wait_idle(engine.llm)

    server, client = serve(max_num_queued_reqs=0)  # vLLM's ge=0: 0 admits nothing
    for i in range(4):
        assert_overflow(send(client, i))
    # The body is vLLM's on the wire too (not only as the openai client reads it).
    req = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "Hi", "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 503
    assert info.value.headers["Content-Type"].startswith("application/json")
    assert json.loads(info.value.read()) == OVERFLOW_BODY
    assert rejections(server)["max_num_queued_reqs"] == 5


def test_bad_values_are_refused_at_start(llm, capsys):
    from kvlab.serve.api_server import build_app
    from kvlab.serve.cli import main, parser, server_kwargs

    assert server_kwargs(parser().parse_args(["serve"]), environ={})["max_num_queued_reqs"] is None
    args = parser().parse_args(["serve", "--max-num-queued-reqs", "8"])
    assert server_kwargs(args, environ={})["max_num_queued_reqs"] == 8
    with pytest.raises(SystemExit) as info:  # before the model loads
        main(["serve", "--max-num-queued-reqs", "-1"])
    assert info.value.code == 2
    assert "--max-num-queued-reqs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--max-num-queued-reqs", "many"])
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="max_num_queued_reqs"):
            build_app(llm, max_num_queued_reqs=bad)

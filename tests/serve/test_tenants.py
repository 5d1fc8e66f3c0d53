"""`kvlab serve` in key mode: API keys name tenants, the server derives each tenant's cache salt.

The attack it defends against: a client that knows (or guesses) another client's `cache_salt`
shares that client's cached prefixes, and `cached_tokens` tells it which prompts were sent. In key
mode the salt is HMAC(server secret, tenant), never chosen by the client, so only another key of
the same tenant shares. Also: 401 without a valid key (adding nothing to the engine), /health and
/metrics open, keys never in a body, a header, /metrics or a log line, and the CLI's flags.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
import urllib.error
import urllib.request

import pytest
from tests.helpers import wait_idle

from kvlab import LLM
from kvlab.serve import BackgroundServer, build_app
from kvlab.serve.tenants import TenantKeys, parse_api_keys, tenant_salt

KEY_A1, KEY_A2, KEY_B = (secrets.token_urlsafe(32) for _ in range(3))
KEYS = {KEY_A1: "tenant-a", KEY_A2: "tenant-a", KEY_B: "tenant-b"}
SECRET = secrets.token_bytes(32)
SALT_A, SALT_B = tenant_salt(SECRET, "tenant-a"), tenant_salt(SECRET, "tenant-b")
SECRETS = (KEY_A1, KEY_A2, KEY_B, SALT_A, SALT_B)  # none of these may ever leave the server
BLOCK = 16  # LLM's default block size: a 100-token prompt has 96 tokens in full cacheable blocks


def new_llm() -> LLM:
    return LLM(max_model_len=256, kv_cache_tokens=4096, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def keyed():
    llm = new_llm()
    background = BackgroundServer(llm, enable_prompt_tokens_details=True, api_keys=KEYS,
                                  salt_secret=SECRET)
    yield background.url, llm
    background.stop()


def call(url: str, body=None, key: str | None = None, authorization: str | None = None):
    """(status, body text, headers); a POST when there is a body, else a GET."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if authorization is not None:
        headers["Authorization"] = authorization
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def cached(base: str, doc: list[int], key: str | None = None, salt: str | None = None) -> int:
    """cached_tokens of a one-token completion of `doc`."""
    body = {"prompt": doc, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    status, text, _ = call(base + "/v1/completions", body, key=key)
    assert status == 200, text
    return json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]


def doc(n: int) -> list[int]:
    """A 100-token document of its own per test (the servers' caches outlive each test)."""
    return list(range(1000 + 100 * n, 1100 + 100 * n))


# ---- isolation ----------------------------------------------------------------------------------
def test_tenants_are_isolated_and_keys_of_one_tenant_share(keyed):
    base, llm = keyed
    d = doc(1)
    assert cached(base, d, KEY_A1) == 0
    assert cached(base, d, KEY_A1) == 96  # tenant A's own cache
    assert cached(base, d, KEY_B) == 0  # the same document, another tenant: a miss
    assert cached(base, d, KEY_B) == 96
    assert cached(base, d, KEY_A2) == 96  # another key of tenant A shares A's cache
    d2 = doc(2)
    assert cached(base, d2, KEY_A2) == 0
    assert cached(base, d2, KEY_A1) == 96
    wait_idle(llm)


def test_chat_and_streaming_report_the_tenants_own_cache(keyed):
    base, llm = keyed
    messages = [{"role": "user", "content": "Summarise: " + "the cat sat on the mat. " * 20}]

    def chat_cached(key):
        status, text, _ = call(base + "/v1/chat/completions", {
            "messages": messages, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}, key=key)
        assert status == 200, text
        events = [json.loads(e[len("data: "):]) for e in text.split("\n\n")[:-2]]
        return events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert chat_cached(KEY_B) == 0
    first_hit = chat_cached(KEY_B)
    assert first_hit >= 5 * BLOCK
    assert chat_cached(KEY_A1) == 0
    assert chat_cached(KEY_A2) == first_hit
    wait_idle(llm)


# ---- the stolen salt ----------------------------------------------------------------------------
def test_without_key_mode_a_known_salt_is_the_attack():
    """Client-chosen salts: whoever sends the victim's salt gets the victim's cached prefix, and
    `cached_tokens` says the victim sent this very document. This is what key mode prevents."""
    llm = new_llm()
    background = BackgroundServer(llm, enable_prompt_tokens_details=True)
    try:
        victim_salt = "victim-" + secrets.token_hex(8)
        d = doc(3)
        assert cached(background.url, d, salt=victim_salt) == 0  # the victim
        assert cached(background.url, d, salt="attacker's own") == 0
        assert cached(background.url, d, salt=victim_salt) == 96  # the attacker, salt stolen
    finally:
        background.stop()


def test_in_key_mode_a_stolen_salt_is_refused(keyed):
    """Tenant B sending tenant A's derived salt gets a 400 (not A's cache): in key mode the
    server assigns salts and refuses any client-sent one, its own included."""
    base, llm = keyed
    d = doc(4)
    assert cached(base, d, KEY_A1) == 0
    wait_idle(llm)
    before = llm.stats()
    for key, salt in ((KEY_B, SALT_A), (KEY_A1, SALT_A), (KEY_B, "anything")):
        for path, body in (("/v1/completions", {"prompt": d}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi"}]})):
            status, text, _ = call(base + path, {**body, "max_tokens": 1, "cache_salt": salt},
                                   key=key)
            error = json.loads(text)["error"]
            assert status == 400 and error["param"] == "cache_salt"
            assert "assigns" in error["message"] and salt not in text
    assert llm.stats() == before  # nothing reached the engine
    assert cached(base, d, KEY_B) == 0  # and B still has no hit on A's document
    # `"cache_salt": null` is the field's "off" value: accepted, the tenant's salt applies.
    status, text, _ = call(base + "/v1/completions",
                           {"prompt": d, "max_tokens": 1, "cache_salt": None}, key=KEY_A2)
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 96
    wait_idle(llm)


# ---- authentication -----------------------------------------------------------------------------
BAD_AUTHORIZATIONS = {
    "missing": None,
    "empty bearer": "Bearer ",
    "wrong key": "Bearer " + secrets.token_urlsafe(32),
    "key plus a character": f"Bearer {KEY_A1}x",
    "key without its last character": f"Bearer {KEY_A1[:-1]}",
    "key then more words": f"Bearer {KEY_A1} {KEY_B}",
    "no scheme": KEY_A1,
    "basic scheme": f"Basic {KEY_A1}",
}


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS.values(),
                         ids=BAD_AUTHORIZATIONS.keys())
def test_bad_or_missing_key_gets_401_and_adds_nothing(keyed, authorization):
    base, llm = keyed
    wait_idle(llm)
    before = llm.stats()
    for path, body in (("/v1/completions", {"prompt": doc(5), "max_tokens": 4}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
                       ("/v1/models", None),
                       ("/v1/not-an-endpoint", None),
                       ("/v1/completions", None)):  # a GET: no route, still a 401 not a 405
        if authorization is None:
            status, text, headers = call(base + path, body)
        else:
            status, text, headers = call(base + path, body, authorization=authorization)
        assert status == 401, (path, text)
        error = json.loads(text)["error"]  # OpenAI's error shape, as every kvlab error
        assert error["code"] == 401 and error["type"] == "AuthenticationError"
        assert ("Authorization: Bearer" in error["message"]) == (authorization is None)
        assert headers.get("WWW-Authenticate") == "Bearer"
        assert not any(s in text or s in json.dumps(headers) for s in SECRETS)
    assert llm.stats() == before  # no request added, no block taken, no cache lookup
    assert not llm.llm_engine.has_unfinished_requests() and not llm.llm_engine.parents


def test_scheme_is_case_insensitive_as_in_vllm(keyed):
    base, llm = keyed
    status, _, _ = call(base + "/v1/models", authorization=f"bearer {KEY_B}")
    assert status == 200
    status, text, _ = call(base + "/v1/models", key=KEY_A1)
    assert status == 200 and json.loads(text)["object"] == "list"


def test_health_and_metrics_stay_open(keyed):
    base, _ = keyed
    status, text, _ = call(base + "/health")
    assert (status, text) == (200, "ok")
    status, text, _ = call(base + "/metrics")
    assert status == 200 and "vllm:prefix_cache_hits_total" in text
    status, _, _ = call(base + "/health", authorization="Bearer nonsense")  # ignored there
    assert status == 200
    status, text, _ = call(base + "/version")  # says only which kvlab runs
    assert status == 200 and "version" in json.loads(text)
    # The tokenizer routes cost the server work: behind the key, as every /v1 route.
    assert call(base + "/tokenize", {"prompt": "Hi"})[0] == 401
    status, text, _ = call(base + "/tokenize", {"prompt": "Hi"}, key=KEY_A1)
    assert status == 200 and json.loads(text)["count"] >= 1


def test_keys_and_salts_never_leave_the_server(keyed, caplog):
    base, llm = keyed
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="aiohttp.access")  # aiohttp's access log, on
    seen = []  # every status line, header and body a client got

    def record(result):
        status, text, headers = result
        seen.append(f"{status} {json.dumps(headers)} {text}")
        return status

    ok = {"prompt": "Hello there", "max_tokens": 2, "temperature": 0}
    assert record(call(base + "/v1/completions", ok, key=KEY_A1)) == 200
    assert record(call(base + "/v1/completions", {**ok, "stream": True}, key=KEY_A2)) == 200
    assert record(call(base + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, key=KEY_B)) == 200
    assert record(call(base + "/v1/completions", {**ok, "max_tokens": -1}, key=KEY_A1)) == 400
    assert record(call(base + "/v1/completions", {**ok, "cache_salt": SALT_A}, key=KEY_B)) == 400
    assert record(call(base + "/v1/completions", {"prompt": "x", "max_tokn": 1},
                       key=KEY_B)) == 400
    for authorization in BAD_AUTHORIZATIONS.values():
        if authorization is not None:
            assert record(call(base + "/v1/completions", ok, authorization=authorization)) == 401
    assert record(call(base + "/v1/models", key=KEY_A1)) == 200
    assert record(call(base + "/metrics")) == 200
    assert record(call(base + "/health")) == 200
    wait_idle(llm)
    # The access log line is written after the response is sent: wait for the last ones.
    deadline = time.time() + 10
    while time.time() < deadline and sum(
            r.name == "aiohttp.access" and "/health" in r.getMessage()
            for r in caplog.records) < 1:
        time.sleep(0.05)
    access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert any('"POST /v1/completions' in line for line in access), access  # it was captured
    assert any("refused" in r.getMessage() for r in caplog.records)  # and the 401s logged
    logs = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    for secret in SECRETS:
        assert not any(secret in s for s in seen)
        assert secret not in logs


# ---- the salts ----------------------------------------------------------------------------------
def test_salt_is_hmac_of_the_tenant_under_the_server_secret():
    expected = hmac.new(SECRET, b"tenant-a", hashlib.sha256).hexdigest()
    assert SALT_A == expected and len(SALT_A) == 64  # 256 bits, as vLLM's docs ask
    assert SALT_A != SALT_B != tenant_salt(secrets.token_bytes(32), "tenant-b")
    keys = TenantKeys(KEYS, SECRET)
    assert keys.salt_for("tenant-a") == SALT_A
    assert keys.tenant_for(f"Bearer {KEY_A2}") == "tenant-a"
    assert keys.tenant_for(f"Bearer {KEY_B}") == "tenant-b"
    assert keys.tenant_for(None) is None and keys.tenant_for(f"Token {KEY_B}") is None
    assert not any(k in repr(keys) or k in repr(vars(keys)) for k in SECRETS[:3])
    # No secret given: a random one each time, as at each server start.
    assert TenantKeys(KEYS).salt_for("tenant-a") != TenantKeys(KEYS).salt_for("tenant-a")


def test_random_secret_means_no_reuse_across_restarts_fixed_secret_reuses():
    llm = new_llm()  # one engine, so its prefix cache outlives the "restarts" below
    d = doc(6)
    for secret, second_run in ((None, 0), (SECRET, 96)):
        for run in range(2):
            background = BackgroundServer(llm, enable_prompt_tokens_details=True,
                                          api_keys=KEYS, salt_secret=secret)
            try:
                got = cached(background.url, d if secret is None else doc(7), KEY_A1)
            finally:
                background.stop()
            assert got == (0 if run == 0 else second_run)


@pytest.mark.parametrize("kwargs, words", [
    ({"api_keys": {}}, "empty"),
    ({"api_keys": {"has space": "t"}}, "printable ASCII"),
    ({"api_keys": {KEY_A1: ""}}, "tenant"),
    ({"api_keys": KEYS, "salt_secret": b"short"}, "32 bytes"),
    ({"api_keys": KEYS, "salt_secret": "a str, not bytes, of length > 32"}, "32 bytes"),
    ({"salt_secret": SECRET}, "only used with api_keys"),
])
def test_build_app_refuses_bad_key_settings(kwargs, words):
    llm = LLM(max_model_len=64, kv_cache_tokens=256)
    with pytest.raises(ValueError, match=words) as info:
        build_app(llm, **kwargs)
    assert not any(k in str(info.value) for k in (*SECRETS, "has space"))


# ---- the key map's format and the CLI -----------------------------------------------------------
def test_parse_api_keys_formats():
    as_json = json.dumps(KEYS)
    compact = ",".join(f"{k}={t}" for k, t in KEYS.items())
    lines = "# keys\n" + "\n".join(f"{k} = {t}" for k, t in KEYS.items()) + "\n\n"
    for text in (as_json, compact, lines, f"  {as_json}\n"):
        assert parse_api_keys(text) == KEYS
    assert parse_api_keys("c2VjcmV0==:=tenant-x") == {"c2VjcmV0==:": "tenant-x"}  # last '='
    for bad, words in ((f'{{"{KEY_A1}": "a", "{KEY_A1}": "b"}}', "repeats"),
                       (f"{KEY_A1}=a,{KEY_A1}=b", "repeats"),
                       (f"{KEY_A1}", "not key=tenant"),
                       (f'{{"{KEY_A1}": 3}}', "tenant"),
                       (f'["{KEY_A1}"]', "JSON object"),
                       (f'{{"{KEY_A1}": ', "not valid JSON"),
                       ("", "empty"), ("# nothing\n", "empty")):
        with pytest.raises(ValueError, match=words) as info:
            parse_api_keys(bad)
        assert KEY_A1 not in str(info.value)


# The server options that key mode leaves at their defaults.
SERVE_DEFAULTS = {"model_name": None, "kv_cache_metrics": True, "kv_cache_metrics_sample": 1.0,
                  "max_num_queued_reqs": None}


def test_serve_flags_build_the_key_map(tmp_path):
    from kvlab.serve.cli import engine_kwargs, parser, server_kwargs

    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET.hex().encode() + b"\n")
    args = parser().parse_args(["serve", "--enable-prefix-caching", "--api-keys-file",
                                str(keys_file), "--salt-secret-file", str(secret_file)])
    assert server_kwargs(args, environ={}) == {
        "enable_prompt_tokens_details": False, "api_keys": KEYS,
        "salt_secret": SECRET.hex().encode(), "dev_mode": False,  # the file's text, stripped
        **SERVE_DEFAULTS}
    assert engine_kwargs(args)["enable_prefix_caching"]  # the engine's flags are untouched

    # The environment, in the compact form; the flag wins over it (as --api-key over
    # VLLM_API_KEY); empty variables count as unset; no keys at all: plain mode.
    env = {"KVLAB_API_KEYS": f"{KEY_B}=tenant-b", "KVLAB_SALT_SECRET": "s" * 40}
    plain = parser().parse_args(["serve"])
    assert server_kwargs(plain, environ=env) == {
        "enable_prompt_tokens_details": False, "api_keys": {KEY_B: "tenant-b"},
        "salt_secret": b"s" * 40, "dev_mode": False, **SERVE_DEFAULTS}
    flagged = parser().parse_args(["serve", "--api-keys-file", str(keys_file)])
    assert server_kwargs(flagged, environ=env)["api_keys"] == KEYS
    assert server_kwargs(plain, environ={"KVLAB_API_KEYS": " "})["api_keys"] is None
    assert server_kwargs(plain, environ={}) == {
        "enable_prompt_tokens_details": False, "api_keys": None, "salt_secret": None,
        "dev_mode": False, **SERVE_DEFAULTS}
    assert server_kwargs(plain, environ={"VLLM_SERVER_DEV_MODE": "1"})["dev_mode"]

    for env, words in (({"KVLAB_SALT_SECRET": "s" * 40}, "only used with API keys"),
                       ({"KVLAB_API_KEYS": f"{KEY_A1}=a", "KVLAB_SALT_SECRET": "short"},
                        "32 bytes"),
                       ({"KVLAB_API_KEYS": f"{KEY_A1}=a,{KEY_A1}=b"}, "repeats")):
        with pytest.raises(ValueError, match=words) as info:
            server_kwargs(plain, environ=env)
        assert KEY_A1 not in str(info.value)


def test_serve_main_reports_a_bad_key_file_without_quoting_it(tmp_path, capsys):
    from kvlab.serve.cli import main

    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{KEY_A1}\n")  # no tenant
    with pytest.raises(SystemExit) as info:
        main(["serve", "--api-keys-file", str(keys_file)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "not key=tenant" in err and KEY_A1 not in err


def test_the_benchmark_client_sends_each_prompt_with_its_tenants_key(keyed):
    """`run_benchmark(api_keys=...)`: one key per prompt; two keys of tenant A share a document's
    blocks, tenant B's key finds none of them, and a request without a valid key is refused."""
    import asyncio

    from kvlab.bench.stream_client import run_benchmark

    base, llm = keyed
    doc = list(range(1000, 1100))  # 100 tokens: 96 in six full blocks
    first = asyncio.run(run_benchmark(base, [doc], max_tokens=2, api_keys=KEY_A1))
    after = asyncio.run(run_benchmark(base, [doc, doc], max_tokens=2, concurrency=1,
                                      api_keys=[KEY_A2, KEY_B]))
    assert first["errors"] == 0 and first["cached_tokens"] == 0
    assert [r.cached_tokens for r in after["results"]] == [96, 0]
    refused = asyncio.run(run_benchmark(base, [doc], max_tokens=2, model="m",
                                        api_keys=["not-a-key"]))
    assert refused["errors"] == 1 and refused["results"][0].error.startswith("401")
    with pytest.raises(ValueError, match="one per prompt"):
        asyncio.run(run_benchmark(base, [doc, doc], api_keys=[KEY_A1]))
    wait_idle(llm)

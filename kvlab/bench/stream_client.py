"""A streaming benchmark client for any OpenAI-compatible endpoint: `kvlab serve` here, a vLLM
server in production. It records TTFT and inter-token latencies per request.

    python -m kvlab.bench client --base-url http://127.0.0.1:8000 --num-requests 32 --concurrency 8
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from kvlab.bench.scheduling import percentile


@dataclass
class StreamResult:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # What the server reported besides the text: usage.prompt_tokens, and whether usage had
    # prompt_tokens_details at all (vLLM: only with --enable-prompt-tokens-details).
    prompt_tokens: int | None = None
    reports_cached_tokens: bool = False
    # perf_counter stamps: sent, each piece of text received, done (the API experiments).
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0


def auth_headers(api_key: str | None) -> dict | None:
    """The Authorization header an OpenAI client sends with `api_key` (None: no header)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key is not None else None


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict,
                     res: StreamResult | None = None, api_key: str | None = None) -> StreamResult:
    """Stream one request; `res`, when given, fills as the tokens arrive (a caller can watch).
    `api_key` goes in the Authorization header, as the OpenAI clients send it."""
    res = StreamResult() if res is None else res
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = last = res.start = time.perf_counter()
    try:
        return await _read_stream(session, url, body, res, t0, last, auth_headers(api_key))
    finally:
        res.end = time.perf_counter()


async def _read_stream(session, url, body, res, t0, last, headers=None) -> StreamResult:
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            res.error = f"{resp.status}: {await resp.text()}"
            return res
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the server failed mid-stream (an SSE error event, as vLLM's)
                res.error = f"{chunk['error'].get('code')}: {chunk['error'].get('message')}"
                continue  # [DONE] follows
            if chunk.get("usage"):
                res.completion_tokens = chunk["usage"]["completion_tokens"]
                res.prompt_tokens = chunk["usage"].get("prompt_tokens")
                # Present only when the server reports it (vLLM: --enable-prompt-tokens-details).
                details = chunk["usage"].get("prompt_tokens_details")
                res.reports_cached_tokens = isinstance(details, dict) and (
                    details.get("cached_tokens") is not None)
                res.cached_tokens = (details or {}).get("cached_tokens") or 0
            for choice in chunk["choices"]:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if not piece:
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                res.token_times.append(now)
                res.text += piece
    return res


async def send_all(url: str, bodies: list[dict], concurrency: int,
                   delays: list[float] | None = None, timeout: aiohttp.ClientTimeout | None = None,
                   errors_as_results: bool = False,
                   api_keys: list[str | None] | None = None) -> tuple[list[StreamResult], float]:
    """Stream every body to `url`, at most `concurrency` in flight, each sent `delays[i]`
    seconds after the start (default: all at once), with `api_keys[i]` if given; returns the
    per-request results, in order, and the wall time. With `errors_as_results`, a malformed
    event or a dropped connection fails its own request (the result's `error`) instead of the
    whole run."""
    sem = asyncio.Semaphore(concurrency)

    async def one(session, body, delay, key):
        await asyncio.sleep(delay)
        async with sem:
            try:
                return await stream_one(session, url, body, api_key=key)
            except Exception as e:
                if not errors_as_results:
                    raise
                return StreamResult(error=f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(**({} if timeout is None else {"timeout": timeout})) as session:
        results = await asyncio.gather(*(one(session, b, d, k) for b, d, k in zip(
            bodies, delays or [0.0] * len(bodies), api_keys or [None] * len(bodies))))
    return list(results), time.perf_counter() - t0


def pooled(results: list[StreamResult]):
    """The requests that succeeded, their TTFTs, every ITL of them pooled, their output tokens."""
    ok = [r for r in results if r.error is None]
    return (ok, [r.ttft for r in ok if r.ttft is not None], [x for r in ok for x in r.itls],
            [r.completion_tokens for r in ok])


async def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model a server lists at /v1/models (vLLM answers 404 to any other name)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url.rstrip("/") + "/v1/models",
                               headers=auth_headers(api_key)) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


async def run_benchmark(base_url: str, prompts: list, model: str | None = None,
                        max_tokens: int = 32, concurrency: int = 8,
                        request_rate: float | None = None, seed: int = 0,
                        extra: dict | None = None,
                        api_keys: str | list[str] | None = None) -> dict:
    """Send every prompt, at most `concurrency` in flight, arrivals Poisson at `request_rate` per
    second (None: all at once); summarise TTFT, ITL and throughput. A prompt is a string, token
    ids, or a dict of request fields (e.g. {"prompt": ..., "cache_salt": "tenant-a"}). `model`
    None: the one the server lists. `api_keys`: one key for every request, or one per prompt
    (a key-mode server, `kvlab serve --api-keys-file`, salts each by its key's tenant)."""
    if isinstance(api_keys, str):
        api_keys = [api_keys] * len(prompts)
    if api_keys is not None and len(api_keys) != len(prompts):
        raise ValueError(f"api_keys: {len(api_keys)} keys for {len(prompts)} prompts; give one "
                         f"key, or one per prompt")
    rng = random.Random(seed)
    if model is None:
        model = await served_model(base_url, api_keys[0] if api_keys else None)
    bodies = [{"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
               **(extra or {}), **(p if isinstance(p, dict) else {"prompt": p})} for p in prompts]
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if request_rate:
            t += rng.expovariate(request_rate)
    results, wall = await send_all(base_url.rstrip("/") + "/v1/completions", bodies,
                                   concurrency, delays, api_keys=api_keys)
    ok, ttfts, itls, tokens = pooled(results)
    return {
        "requests": len(prompts), "errors": len(results) - len(ok), "concurrency": concurrency,
        "output_tok_s": round(sum(tokens) / wall, 1),
        "ttft_median_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
        "itl_median_ms": round(1000 * percentile(itls, 50), 1) if itls else None,
        "itl_p99_ms": round(1000 * percentile(itls, 99), 1) if itls else None,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "results": results,
    }

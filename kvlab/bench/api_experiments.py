"""The chapters' experiments through the API, against any OpenAI-compatible server.

    python -m kvlab.bench reproduce --base-url http://127.0.0.1:8000 [--model NAME]

The method is [Remeasure]'s ("Continuous batching, chunked prefill, prefix caching and
cache_salt, re-measured on a small model", 2026-10-27, one 8 GB Ada laptop GPU, vLLM 0.31.0):
measure the server from outside, through its OpenAI API and `/metrics`, so the same command
measures `kvlab serve` on a laptop and a vLLM deployment on a GPU. Four experiments:

* `concurrency`: 2c requests at concurrency c in a closed loop (a request starts when one
  ends), the first batch of c a warm-up; throughput, TTFT and ITL medians and p99, the median
  of `repeats` runs (chapter 03).
* `generation-stall`: one streamed decode while long prompts arrive one after another; its
  worst gap while they run, its other gaps, and their TTFT (chapter 04). The token budget is the
  server's own flag: the report says what the server exposed of it, or that it exposed nothing.
* `prefix-cache`: cold and warm TTFT on a shared prefix with distinct tails, each request's
  `usage.prompt_tokens_details.cached_tokens`, and the server-wide hit rate from `/metrics`
  (chapter 05).
* `cache-salt`: the salt table (tenants a, a, b, b, none on one document) and the timing attack
  as an audit: can one client tell from TTFT alone that another sent a document, with and
  without per-tenant salts? (chapter 06)

Prompts are text of random words (any server takes text; `transformers serve` takes nothing
else), so each is distinct by construction; token counts are the server's `usage`. Before a
prefix experiment the cache is reset where the server offers vLLM's `POST /reset_prefix_cache`
(vllm/entrypoints/serve/dev/cache/api_router.py, with VLLM_SERVER_DEV_MODE=1); the prefixes
are fresh random ones either way. What a server does not offer (no `/metrics`, no
`cached_tokens`, no `cache_salt`) is a row "not measurable" with the reason, never a number.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm.auto import tqdm

from kvlab.bench import BENCH_TEXT
from kvlab.bench.stream_client import StreamResult, pooled, send_all, stream_one
from kvlab.bench.scheduling import percentile

NOT_MEASURABLE = "not measurable"
WORDS = sorted({w.strip(".,;:!?()\"'").lower() for w in BENCH_TEXT.split()} - {""})

# Sizes: "small" runs in a test on a laptop CPU, "full" is the closing note's run (minutes).
SIZES = {
    "small": {"concurrencies": (1, 2), "input_words": 24, "output_len": 8, "repeats": 1,
              "decode_len": 48, "insert_words": 300, "num_inserts": 2,
              "prefix_words": 200, "tail_words": 8, "num_warm": 2,
              "doc_words": 200, "trials": 6},
    "full": {"concurrencies": (1, 4, 16), "input_words": 128, "output_len": 64, "repeats": 3,
             "decode_len": 300, "insert_words": 700, "num_inserts": 3,
             "prefix_words": 700, "tail_words": 16, "num_warm": 3,
             "doc_words": 400, "trials": 20},
}


def random_text(rng: random.Random, num_words: int) -> str:
    """Random words: text that shares no prefix with anything, by construction."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def not_measurable(measure: str, why: str, **extra) -> dict:
    return {"measure": measure, "result": NOT_MEASURABLE, "why": why, **extra}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over its label sets} (one model per server)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, value = line.rsplit(" ", 1)
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def metric_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of `name`'s first series (info gauges carry their values as labels)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            inner = line[len(name) + 1 : line.rindex("}")]
            labels = {}
            for part in inner.split('",'):
                if "=" in part:
                    k, v = part.split("=", 1)
                    labels[k.strip()] = v.strip().strip('"')
            return labels
    return None


@dataclass
class Server:
    """What a client could learn about a server from outside, and how to talk to it."""

    base_url: str
    model: str
    extra: dict = field(default_factory=dict)  # fields every request carries (e.g. ignore_eos)
    ignore_eos: str = ""  # how outputs were kept from stopping early, or why they were not
    metrics_why: str | None = None  # None: /metrics has vLLM's prefix-cache counters
    reset_why: str | None = None  # None: POST /reset_prefix_cache works
    salt_why: str | None = None  # None: the server accepts cache_salt
    cache_config: dict | None = None  # vllm:cache_config_info's labels
    scheduler_config: dict | None = None  # kvlab:scheduler_config_info's labels (kvlab only)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"

    def describe(self) -> dict:
        return {"base_url": self.base_url, "model": self.model, "ignore_eos": self.ignore_eos,
                "metrics": self.metrics_why or "vLLM's names",
                "reset_prefix_cache": self.reset_why or "offered",
                "cache_salt": self.salt_why or "accepted",
                "cache_config": self.cache_config, "scheduler_config": self.scheduler_config}


async def _post(session, url: str, body: dict | None = None):
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.text()


async def probe(base_url: str, model: str | None = None, extra: dict | None = None) -> Server:
    """Ask the server what it serves and offers (one small request per question)."""
    base = base_url.rstrip("/")
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/v1/models") as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {base}/v1/models answered {resp.status}: is this an "
                                   "OpenAI-compatible server?")
            listed = [m["id"] for m in (await resp.json())["data"]]
        server = Server(base, model or listed[0], dict(extra or {}))
        one = {"model": server.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        if extra is not None:
            server.ignore_eos = f"the given extra fields {json.dumps(extra)}"
        else:
            status, text = await _post(session, server.url, {**one, "ignore_eos": True})
            if status == 200:
                server.extra, server.ignore_eos = {"ignore_eos": True}, "ignore_eos (vLLM's)"
            else:
                # transformers serve refuses vLLM's field but takes a generation config.
                gen = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
                status2, _ = await _post(session, server.url, {**one, **gen})
                if status2 == 200:
                    server.extra = gen
                    server.ignore_eos = ("generation_config with no EOS (ignore_eos refused: "
                                         f"{status} {text[:120]})")
                else:
                    server.ignore_eos = (f"none: ignore_eos refused ({status} {text[:120]}); "
                                         "outputs may stop early, tokens are counted from usage")
        status, text = await _post(session, server.url, {**one, **server.extra,
                                                         "cache_salt": "probe"})
        if status != 200:
            server.salt_why = f"a request with cache_salt answered {status}: {text[:160]}"
        async with session.get(base + "/metrics") as resp:
            text = await resp.text()
            if resp.status != 200:
                server.metrics_why = f"GET /metrics answered {resp.status}"
            elif "vllm:prefix_cache_queries" not in text:
                server.metrics_why = "/metrics has no vllm:prefix_cache_queries counter"
            else:
                server.cache_config = metric_labels(text, "vllm:cache_config_info")
                server.scheduler_config = metric_labels(text, "kvlab:scheduler_config_info")
        status, text = await _post(session, base + "/reset_prefix_cache")
        if status != 200:
            server.reset_why = (f"POST /reset_prefix_cache answered {status} (vLLM offers it "
                                "with VLLM_SERVER_DEV_MODE=1); fresh random prefixes only")
    return server


async def read_metrics(server: Server) -> dict[str, float] | None:
    if server.metrics_why:
        return None
    async with aiohttp.ClientSession() as session:
        async with session.get(server.base_url.rstrip("/") + "/metrics") as resp:
            return parse_metrics(await resp.text())


async def reset_cache(server: Server) -> bool:
    """vLLM's dev route; False when not offered or refused (requests still hold blocks)."""
    if server.reset_why:
        return False
    async with aiohttp.ClientSession() as session:
        status, text = await _post(session, server.base_url.rstrip("/") + "/reset_prefix_cache")
    return status == 200 and json.loads(text).get("success", False)


def body(server: Server, prompt: str, max_tokens: int, **fields) -> dict:
    return {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **server.extra, **fields}


async def one_request(server: Server, prompt: str, max_tokens: int = 1, **fields) -> StreamResult:
    async with aiohttp.ClientSession() as session:
        res = await stream_one(session, server.url, body(server, prompt, max_tokens, **fields))
    if res.error:
        raise RuntimeError(f"request failed: {res.error}")
    return res


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


# ---- chapter 03: the concurrency table --------------------------------------------------------
async def concurrency(server: Server, concurrencies=(1, 4, 16), input_words: int = 128,
                      output_len: int = 64, repeats: int = 3, seed: int = 0,
                      progress: bool = True, **_) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    runs = [(c, r) for c in concurrencies for r in range(repeats)]
    per_c: dict[int, list[dict]] = {}
    for c, _r in tqdm(runs, desc="concurrency", disable=not progress):
        bodies = [body(server, f"{i}. " + random_text(rng, input_words), output_len)
                  for i in range(2 * c)]
        results, _wall = await send_all(server.url, bodies, c)
        measured = results[c:]  # the first batch of c is the warm-up
        ok, ttfts, itls, tokens = pooled(measured)
        if len(ok) < len(measured):
            raise RuntimeError(f"{len(measured) - len(ok)} requests failed at concurrency {c}: "
                               f"{next(r.error for r in measured if r.error)}")
        wall = max(r.end for r in ok) - min(r.start for r in ok)
        per_c.setdefault(c, []).append({
            "tok_s": sum(tokens) / wall, "ttft": statistics.median(ttfts),
            "itl": percentile(itls, 50), "itl_p99": percentile(itls, 99),
            "input_tokens": statistics.median(r.prompt_tokens or 0 for r in ok),
            "output_tokens": statistics.median(tokens)})
    for c, got in per_c.items():
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        spread = [round(min(g["tok_s"] for g in got), 1), round(max(g["tok_s"] for g in got), 1)]
        rows.append({"concurrency": c, "requests": 2 * c, "measured": c,
                     "input_tokens": int(med["input_tokens"]),
                     "output_tokens": int(med["output_tokens"]),
                     "tok_s": round(med["tok_s"], 1), "tok_s_spread": spread,
                     "ttft_median_ms": ms(med["ttft"]), "itl_median_ms": ms(med["itl"]),
                     "itl_p99_ms": ms(med["itl_p99"])})
    return rows


# ---- chapter 04: the generation stall ---------------------------------------------------------
def budget_read(server: Server) -> str:
    """What the server exposed of its token budget (its own flag: the client cannot set it)."""
    if server.scheduler_config:
        sc = server.scheduler_config
        return (f"max_num_batched_tokens={sc.get('max_num_batched_tokens')}, "
                f"enable_chunked_prefill={sc.get('enable_chunked_prefill')} "
                "(kvlab:scheduler_config_info)")
    return ("not exposed through the API (the server's --max-num-batched-tokens; vLLM exports "
            "no scheduler config): note the flag the server was started with")


async def generation_stall(server: Server, decode_len: int = 300, insert_words: int = 700,
                           num_inserts: int = 3, repeats: int = 3, seed: int = 1,
                           progress: bool = True, **_) -> list[dict]:
    rng = random.Random(seed)
    await one_request(server, random_text(rng, insert_words))  # warm-up
    trials = []
    for _ in tqdm(range(repeats), desc="generation stall", disable=not progress):
        decode = StreamResult()
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(stream_one(
                session, server.url, body(server, random_text(rng, 16), decode_len), decode))
            while len(decode.token_times) < 8 and not task.done():
                await asyncio.sleep(0.005)
            window_start = time.perf_counter()
            inserted = []
            for _i in range(num_inserts):  # one after another, while the decode runs
                inserted.append(await stream_one(
                    session, server.url, body(server, random_text(rng, insert_words), 1)))
            window_end = time.perf_counter()
            await task
        for r in (decode, *inserted):
            if r.error:
                raise RuntimeError(f"request failed: {r.error}")
        times = decode.token_times
        # A gap belongs to the insertion window when it overlaps it.
        spans = [(a, b) for a, b in zip(times, times[1:])]
        inside = [b - a for a, b in spans if b >= window_start and a <= window_end]
        outside = [b - a for a, b in spans if b < window_start or a > window_end]
        trials.append({
            "max_gap": max(inside) if inside else None,
            "other_itl": statistics.median(outside) if outside else None,
            "ttft": statistics.median(r.ttft for r in inserted),
            "insert_tokens": statistics.median(r.prompt_tokens or 0 for r in inserted),
            "covered": times[-1] >= window_end if times else False})
    gaps = [t["max_gap"] for t in trials if t["max_gap"] is not None]
    others = [t["other_itl"] for t in trials if t["other_itl"] is not None]
    return [{"decode_tokens": decode_len, "inserts": num_inserts,
             "insert_tokens": int(statistics.median(t["insert_tokens"] for t in trials)),
             "server_budget": budget_read(server),
             "max_gap_ms": ms(statistics.median(gaps)) if gaps else None,
             "max_gap_ms_spread": [ms(min(gaps)), ms(max(gaps))] if gaps else None,
             "other_itl_median_ms": ms(statistics.median(others)) if others else None,
             "inserted_ttft_median_ms": ms(statistics.median(t["ttft"] for t in trials)),
             "decode_outlasted_inserts": all(t["covered"] for t in trials)}]


# ---- chapter 05: prefix caching ---------------------------------------------------------------
async def prefix_cache(server: Server, prefix_words: int = 700, tail_words: int = 16,
                       num_warm: int = 3, repeats: int = 3, seed: int = 2,
                       progress: bool = True, **_) -> list[dict]:
    rng = random.Random(seed)
    reset = await reset_cache(server)
    await one_request(server, random_text(rng, prefix_words + tail_words))  # warm-up
    before = await read_metrics(server)
    cold, warm, cold_cached, warm_cached, after_reset, reported = [], [], [], [], [], True
    for _ in tqdm(range(repeats), desc="prefix cache", disable=not progress):
        prefix = random_text(rng, prefix_words)  # fresh: nobody has sent it
        first = prefix + " " + random_text(rng, tail_words)
        r = await one_request(server, first)
        cold.append(r.ttft)
        cold_cached.append(r.cached_tokens)
        reported &= r.reports_cached_tokens
        for _i in range(num_warm):  # distinct tails: the cache, not a repeated prompt
            r = await one_request(server, prefix + " " + random_text(rng, tail_words))
            warm.append(r.ttft)
            warm_cached.append(r.cached_tokens)
            reported &= r.reports_cached_tokens
        if reset and await reset_cache(server):  # the same prompt, cold again
            r = await one_request(server, first)
            after_reset.append((r.ttft, r.cached_tokens))
    after = await read_metrics(server)
    row = {"prefix_words": prefix_words, "prompt_tokens": r.prompt_tokens,
           "cold_ttft_ms": ms(statistics.median(cold)),
           "warm_ttft_ms": ms(statistics.median(warm)),
           "warm_ttft_ms_range": [ms(min(warm)), ms(max(warm))],
           "speedup": round(statistics.median(cold) / statistics.median(warm), 2)}
    rows = [row]
    if reported:
        row["cold_cached_tokens"] = int(statistics.median(cold_cached))
        row["warm_cached_tokens"] = int(statistics.median(warm_cached))
    else:
        rows.append(not_measurable(
            "cached_tokens", "usage has no prompt_tokens_details.cached_tokens (vLLM reports it "
            "with --enable-prompt-tokens-details)"))
    if after_reset:
        row["after_reset_ttft_ms"] = ms(statistics.median(t for t, _ in after_reset))
        if reported:
            row["after_reset_cached_tokens"] = int(statistics.median(c for _, c in after_reset))
    else:
        rows.append(not_measurable("cold again after a reset", server.reset_why or
                                   "POST /reset_prefix_cache answered success: false"))
    if before is not None and after is not None:
        queries = after.get("vllm:prefix_cache_queries_total", 0) - before.get(
            "vllm:prefix_cache_queries_total", 0)
        hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get(
            "vllm:prefix_cache_hits_total", 0)
        row["server_hit_rate"] = round(hits / queries, 3) if queries else 0.0
        row["server_queries"] = int(queries)
    else:
        rows.append(not_measurable("server-wide hit rate", server.metrics_why))
    return rows


# ---- chapter 06: cache_salt -------------------------------------------------------------------
async def cache_salt(server: Server, doc_words: int = 400, trials: int = 20, seed: int = 3,
                     progress: bool = True, **_) -> list[dict]:
    rng = random.Random(seed)
    await reset_cache(server)
    await one_request(server, random_text(rng, doc_words))  # warm-up
    rows = []
    salted_ok = server.salt_why is None
    if salted_ok:
        doc = random_text(rng, doc_words)
        reported = True
        for order, salt in enumerate(("tenant-a", "tenant-a", "tenant-b", "tenant-b", None), 1):
            r = await one_request(server, doc, **({"cache_salt": salt} if salt else {}))
            reported &= r.reports_cached_tokens
            rows.append({"experiment": "salt table", "order": order,
                         "cache_salt": salt or "none",
                         "cached_tokens": r.cached_tokens if r.reports_cached_tokens
                         else NOT_MEASURABLE, "ttft_ms": ms(r.ttft)})
        if not reported:
            rows.append(not_measurable("cached_tokens", "usage has no "
                                       "prompt_tokens_details.cached_tokens (vLLM: "
                                       "--enable-prompt-tokens-details); TTFT only"))
        elif rows[2]["cached_tokens"]:
            rows.append({"experiment": "salt table", "result": "cache_salt accepted but not "
                         "honoured: tenant-b hit tenant-a's blocks"})
    else:
        rows.append(not_measurable("salt table", server.salt_why))
    for salted in tqdm((False, True), desc="cache_salt audit", disable=not progress):
        if salted and not salted_ok:
            rows.append(not_measurable("timing attack with salts", server.salt_why))
            continue
        rows.append(await timing_audit(server, rng, doc_words, trials, salted))
    return rows


async def timing_audit(server: Server, rng: random.Random, doc_words: int, trials: int,
                       salted: bool) -> dict:
    """Tenant B guesses, from TTFT alone, whether tenant A just sent a document: a fresh
    document each trial, sent by A with probability 1/2, then by B, who calls "A sent it" under
    a threshold calibrated on its own cold and warm requests."""

    async def send(doc: str, tenant: str) -> float:
        return (await one_request(server, doc, **({"cache_salt": tenant} if salted else {}))).ttft

    cal_cold, cal_warm = [], []
    for _ in range(3):
        doc = random_text(rng, doc_words)
        cal_cold.append(await send(doc, "tenant-b"))
        cal_warm.append(await send(doc, "tenant-b"))
    threshold = (statistics.median(cal_cold) + statistics.median(cal_warm)) / 2
    # A sends in half the trials exactly, in a shuffled order: over a few trials a coin per
    # trial can land so unevenly that a B ignoring the clock scores 83% (one sent in six).
    sends = [True] * (trials // 2) + [False] * (trials - trials // 2)
    rng.shuffle(sends)
    correct = 0
    for a_sent in sends:
        doc = random_text(rng, doc_words)
        if a_sent:
            await send(doc, "tenant-a")
        correct += (await send(doc, "tenant-b") < threshold) == a_sent
    accuracy, not_sent = correct / trials, sends.count(False) / trials
    return {"experiment": "timing attack", "cache_salt": "per tenant" if salted else "none",
            "trials": trials, "accuracy": round(accuracy, 3),
            "not_sent_share": round(not_sent, 3), "threshold_ms": ms(threshold),
            "verdict": audit_verdict(accuracy, not_sent)}


def audit_verdict(accuracy: float, not_sent_share: float) -> str:
    """What B's accuracy says, set beside the best B without a clock: one that always gives
    the more frequent answer, right in max(share not sent, share sent) of the trials."""
    blind = max(not_sent_share, 1 - not_sent_share)
    if accuracy >= 0.75 and accuracy > blind:
        return "B can tell: the prefix leaks"
    answer = "not sent" if not_sent_share >= 0.5 else "sent"
    return (f"B does no better than a guess without the clock (always '{answer}': "
            f"{blind:.0%} here)")


API_EXPERIMENTS = {
    "concurrency": ("03", "throughput, TTFT, ITL at concurrency c (closed loop)", concurrency),
    "generation-stall": ("04", "worst decode gap while long prompts arrive", generation_stall),
    "prefix-cache": ("05", "cold vs warm TTFT, cached_tokens, server hit rate", prefix_cache),
    "cache-salt": ("06", "salt table and the timing-attack audit", cache_salt),
}


def run_api_experiments(base_url: str, names: list[str] | None = None,
                        model: str | None = None, size: str = "full",
                        extra: dict | None = None, out_dir=None, progress: bool = True,
                        printer=print, **overrides) -> dict:
    """Probe the server, run the named experiments (default: all) at `size` (a key of SIZES;
    `overrides` change single sizes, e.g. trials=4), print each table, save NAME.json /
    NAME.csv (and server.json, what was read of the server) to `out_dir`."""
    from kvlab.bench.reproduce import format_table, save_rows
    from kvlab.bench.online_peers import _run_sync

    names = list(API_EXPERIMENTS) if not names else names
    unknown = [n for n in names if n not in API_EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; through the API: "
                         f"{list(API_EXPERIMENTS)}")
    unknown = sorted(set(overrides) - set(SIZES[size]))
    if unknown:
        raise ValueError(f"unknown size(s) {unknown}; choose from {list(SIZES[size])}")
    sizes = {**SIZES[size], **overrides}
    server = _run_sync(lambda: probe(base_url, model, extra))
    printer("server: " + json.dumps(server.describe()))
    results = {"server": server.describe()}
    for name in names:
        chapter, _, run = API_EXPERIMENTS[name]
        rows = _run_sync(lambda: run(server, progress=progress, **sizes))
        results[name] = rows
        printer(f"\n== {name} (chapter {chapter}, through the API) ==\n{format_table(rows)}")
        if out_dir is not None:
            save_rows(rows, out_dir, name)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "server.json").write_text(json.dumps(server.describe(), indent=2))
        try:  # the chapters' plots, where matplotlib is installed (the notebooks extra)
            import matplotlib.pyplot as plt

            from kvlab.workbook.viz import plot_api_run

            fig = plot_api_run(results)
            fig.savefig(out_dir / "api-run.png", dpi=120)
            plt.close(fig)
        except ImportError:
            pass
    return results

"""Prefix caching and cache_salt experiments (chapters 05-06)."""

from __future__ import annotations

import random
import statistics
import time

from kvlab.engine import LLM
from kvlab.sampling import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def random_prompt(rng: random.Random, length: int, vocab: int = 49152) -> list[int]:
    """Distinct random token ids: prompts that share no prefix with anything, by construction."""
    return [rng.randrange(100, vocab) for _ in range(length)]


def ttft(llm: LLM, prompt: dict) -> tuple[float, int]:
    """Send one request alone; its time to first token and its cached tokens."""
    out = llm.generate(prompt, ONE_TOKEN)[0]
    return out.metrics.ttft, out.num_cached_tokens


def cold_warm_ttft(prefix_len: int = 2048, tail_len: int = 32, num_prefixes: int = 3,
                   warm_per_prefix: int = 3, enable_prefix_caching: bool = True,
                   seed: int = 0, model: str | None = None) -> dict:
    """Per prefix: the first request (cold) and `warm_per_prefix` more with other tails, then
    the first prompt once more after `reset_prefix_cache()` (vLLM's way to get a cold cache
    without a new engine): cold again, on the very same tokens.

    A warm-up request with an unrelated prompt goes first and is excluded. Tails are distinct,
    so the warm requests measure the shared prefix, not a repeated prompt.
    """
    rng = random.Random(seed)
    llm = LLM(model, max_model_len=prefix_len + tail_len + 16,
              max_num_batched_tokens=prefix_len + tail_len + 16,
              enable_prefix_caching=enable_prefix_caching)
    ttft(llm, {"prompt_token_ids": random_prompt(rng, prefix_len + tail_len)})  # warm-up
    cold, warm, cached, cached_after_reset = [], [], [], []
    for _ in range(num_prefixes):
        prefix = random_prompt(rng, prefix_len)
        first = {"prompt_token_ids": prefix + random_prompt(rng, tail_len)}
        for i in range(1 + warm_per_prefix):
            t, n = ttft(llm, first if i == 0 else
                        {"prompt_token_ids": prefix + random_prompt(rng, tail_len)})
            (cold if i == 0 else warm).append(t)
            if i:
                cached.append(n)
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: a request still holds blocks")
        t, n = ttft(llm, first)
        cold.append(t)
        cached_after_reset.append(n)
    return {
        "enable_prefix_caching": enable_prefix_caching,
        "prefix_len": prefix_len, "tail_len": tail_len,
        "cold_ttft_ms": round(1000 * statistics.median(cold), 1),
        "warm_ttft_ms": round(1000 * statistics.median(warm), 1),
        "warm_ttft_ms_range": [round(1000 * min(warm), 1), round(1000 * max(warm), 1)],
        "speedup": round(statistics.median(cold) / statistics.median(warm), 2),
        "warm_cached_tokens": sorted(set(cached)),
        "cached_tokens_after_reset": sorted(set(cached_after_reset)),  # [0]: cold indeed
    }


def no_shared_prefix_cost(num_requests: int = 16, input_len: int = 256, output_len: int = 32,
                          repeats: int = 3, seed: int = 0, model: str | None = None) -> dict:
    """Throughput with caching on and off when nothing is shared: the cost of hashing and
    bookkeeping alone. Runs interleaved (on, off, on, off, ...) after one warm-up each."""
    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engines = {on: LLM(model, max_model_len=input_len + output_len + 16,
                       enable_prefix_caching=on) for on in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(repeats + 1):
        for on, llm in engines.items():
            prompts = [{"prompt_token_ids": random_prompt(rng, input_len)}
                       for _ in range(num_requests)]
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            if r:  # the first round is the warm-up
                times[on].append(time.perf_counter() - t0)
    tok_s = {on: num_requests * output_len / statistics.median(t) for on, t in times.items()}
    runs = {on: sorted(round(num_requests * output_len / x, 1) for x in t)
            for on, t in times.items()}
    return {
        "tok_s_on": round(tok_s[True], 1), "tok_s_off": round(tok_s[False], 1),
        "cost": round(1 - tok_s[True] / tok_s[False], 4),
        # every counted run's tok/s, lowest first: the spread the median cost sits in
        "tok_s_on_runs": runs[True], "tok_s_off_runs": runs[False],
        "hits_on": engines[True].stats()["prefix_cache_hits"],
    }


def system_prompt_hit_rate(system_len: int = 256, user_len: int = 32, num_requests: int = 16,
                           output_len: int = 8, seed: int = 0, model: str | None = None) -> dict:
    """A shared system prompt in front of distinct user turns: the hit rate approaches
    system / (system + user), less the first request and the part of a block past the prefix."""
    rng = random.Random(seed)
    llm = LLM(model, max_model_len=system_len + user_len + output_len + 16,
              enable_prefix_caching=True)
    system = random_prompt(rng, system_len)
    prompts = [{"prompt_token_ids": system + random_prompt(rng, user_len)}
               for _ in range(num_requests)]
    outs = [llm.generate(p, SamplingParams(max_tokens=output_len, temperature=0))[0]
            for p in prompts]
    s = llm.stats()
    return {"hit_rate": round(s["prefix_cache_hit_rate"], 4),
            "cached_tokens": [o.num_cached_tokens for o in outs],
            "ideal": round((num_requests - 1) * system_len / (num_requests * (system_len + user_len)), 4)}


# A RAG service's three parts, as English text (a tokenizer's counts, not round numbers): one
# system prompt for every request, a document per question, and the question itself.
RAG_SYSTEM = ("You are a careful assistant for a library. Answer from the document below, "
              "quote it where you can, and say so when the document does not say.")
RAG_DOCUMENTS = (
    "The city library opens at nine on weekdays and at ten on Saturdays. It is closed on "
    "Sundays and public holidays. Members may borrow up to twelve books for three weeks, and "
    "renew each loan twice online unless another member has reserved the book. Late returns "
    "cost twenty cents a day per book, capped at the price of the book.",
    "The reading room on the second floor is reserved for quiet study. Laptops are welcome, "
    "phone calls are not. Lockers near the entrance take a one euro coin, returned when the "
    "locker is opened again. Group study rooms can be booked for two hours at a time, up to a "
    "week ahead, at the front desk or on the library's website.",
)
RAG_QUESTIONS = ("When does it open on Saturday?", "How long is a loan?",
                 "What does a locker cost?")
RAG_ORDERS = (("system", "document", "question"), ("system", "question", "document"),
              ("question", "system", "document"))


def rag_layouts(orders=RAG_ORDERS, block_size: int = 16, model: str | None = None) -> dict:
    """Each question about each document (a document's three questions one after another),
    sent one at a time with the parts in each order: every request's cached prompt tokens."""
    llm = LLM(model, max_model_len=512, block_size=block_size, kv_cache_tokens=4096,
              enable_prefix_caching=True)
    encode = lambda text: llm.get_tokenizer()(text).input_ids  # noqa: E731
    system = encode(RAG_SYSTEM)
    docs = [encode(d) for d in RAG_DOCUMENTS]
    questions = [encode(q) for q in RAG_QUESTIONS]
    cached, prompt_tokens = {}, {}
    for order in orders:
        assert llm.reset_prefix_cache()  # each order starts from a cold cache
        prompts = [sum((dict(system=system, document=d, question=q)[part] for part in order), [])
                   for d in docs for q in questions]
        cached[order] = [llm.generate({"prompt_token_ids": p}, ONE_TOKEN)[0].num_cached_tokens
                         for p in prompts]
        prompt_tokens[order] = sum(map(len, prompts))
    return {"lengths": {"system": len(system), "documents": [len(d) for d in docs],
                        "questions": [len(q) for q in questions]},
            "cached": cached, "prompt_tokens": prompt_tokens}


def calibration_ttfts(num_docs: int = 3, doc_len: int = 512, seed: int = 1,
                      model: str | None = None) -> dict:
    """What tenant B can measure before any attack: TTFTs (ms) of documents of its own, each
    sent twice, cold (first time) then warm (the second, a prefix-cache hit)."""
    rng = random.Random(seed)
    llm = LLM(model, max_model_len=doc_len + 32, max_num_batched_tokens=doc_len + 32,
              enable_prefix_caching=True)
    ttft(llm, {"prompt_token_ids": random_prompt(rng, doc_len)})  # warm-up
    cold, warm = [], []
    for _ in range(num_docs):
        doc = {"prompt_token_ids": random_prompt(rng, doc_len)}
        cold.append(round(1000 * ttft(llm, doc)[0], 1))
        warm.append(round(1000 * ttft(llm, doc)[0], 1))
    return {"cold_ms": cold, "warm_ms": warm}


def timing_attack(trials: int = 20, doc_len: int = 512, salted: bool = False, seed: int = 0,
                  model: str | None = None) -> dict:
    """Tenant B guesses, from TTFT alone, whether tenant A just sent a document.

    Each trial: a fresh document; with probability 1/2 tenant A sends it; then B sends it and
    calls "A sent it" when its TTFT is under a threshold B calibrated beforehand on its own
    cold and warm requests. With `salted`, each tenant sends its own `cache_salt`.
    """
    rng = random.Random(seed)
    llm = LLM(model, max_model_len=doc_len + 32, max_num_batched_tokens=doc_len + 32,
              enable_prefix_caching=True)

    def send(doc, tenant):
        prompt = {"prompt_token_ids": doc}
        if salted:
            prompt["cache_salt"] = tenant
        return ttft(llm, prompt)

    send(random_prompt(rng, doc_len), "tenant-b")  # warm-up
    # B calibrates on documents of its own: sent twice, cold then warm.
    cal_cold, cal_warm = [], []
    for _ in range(3):
        doc = random_prompt(rng, doc_len)
        cal_cold.append(send(doc, "tenant-b")[0])
        cal_warm.append(send(doc, "tenant-b")[0])
    threshold = (statistics.median(cal_cold) + statistics.median(cal_warm)) / 2
    correct, rows = 0, []
    for _ in range(trials):
        doc = random_prompt(rng, doc_len)
        a_sent = rng.random() < 0.5
        if a_sent:
            send(doc, "tenant-a")
        t, cached = send(doc, "tenant-b")
        guess = t < threshold
        correct += guess == a_sent
        rows.append({"a_sent": a_sent, "ttft_ms": round(1000 * t, 1), "cached": cached,
                     "guess": guess})
    return {"salted": salted, "trials": trials, "accuracy": correct / trials,
            "threshold_ms": round(1000 * threshold, 1), "rows": rows}


def salt_table(doc_len: int = 512, seed: int = 0, model: str | None = None) -> list[dict]:
    """The seed's order: salt a, a, b, b, none on the same document."""
    rng = random.Random(seed)
    llm = LLM(model, max_model_len=doc_len + 32, max_num_batched_tokens=doc_len + 32,
              enable_prefix_caching=True)
    ttft(llm, {"prompt_token_ids": random_prompt(rng, doc_len)})  # warm-up
    doc = random_prompt(rng, doc_len)
    rows = []
    for order, salt in enumerate(("tenant-a", "tenant-a", "tenant-b", "tenant-b", None), 1):
        prompt = {"prompt_token_ids": doc, **({"cache_salt": salt} if salt else {})}
        t, cached = ttft(llm, prompt)
        rows.append({"order": order, "cache_salt": salt or "none", "cached_tokens": cached,
                     "ttft_ms": round(1000 * t, 1)})
    return rows

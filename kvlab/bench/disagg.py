"""Disaggregated prefill on one machine (chapter 10): two engines in two processes, one that
prefills (the producer) and one that decodes (the consumer), the KV handed over through the
ExampleConnector's shared folder; against one engine doing both, under the same arrivals.

The proxy (this process) sends each request to the producer with max_tokens=1, as vLLM's
disaggregated-serving proxies do; when the producer has finished it, the request goes to the
consumer with its real max_tokens, and the consumer loads the prompt's blocks and decodes.
The client's first token is the consumer's. Times are `time.perf_counter()`, one clock for
every process on this machine (CLOCK_MONOTONIC on Linux).

The pair's two processes get one core each; the one engine gets both (torch threads), so the
machine is the same. Nothing else should run meanwhile.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import statistics
import tempfile
import time

from kvlab.bench.prefix import random_prompt
from kvlab.sampling import SamplingParams


def _serve(role: str, llm_kwargs: dict, threads: int, inbox, outbox, ready) -> None:
    """One engine's loop: take what arrived, step, pass finished requests on."""
    import torch

    from kvlab.engine import LLM

    torch.set_num_threads(threads)
    llm = LLM(**llm_kwargs)
    llm.generate({"prompt_token_ids": random_prompt(random.Random(123), 48)},
                 SamplingParams(max_tokens=2))  # warm-up
    engine = llm.llm_engine
    ready.put(role)
    jobs: dict[str, tuple] = {}
    while True:
        while True:  # everything that has arrived; wait for work only when idle
            try:
                msg = inbox.get(block=not engine.has_unfinished_requests())
            except queue.Empty:
                break
            if msg is None:
                return
            rid, token_ids, max_tokens, arrival = msg
            jobs[rid] = msg
            engine.add_request(rid, {"prompt_token_ids": token_ids}, SamplingParams(
                max_tokens=1 if role == "producer" else max_tokens, temperature=0,
                ignore_eos=True), arrival_time=arrival)
        for out in engine.step():
            if not out.finished:
                continue
            rid, token_ids, max_tokens, arrival = jobs.pop(out.request_id)
            if role == "producer":
                outbox.put((rid, token_ids, max_tokens, arrival))  # to the consumer
            else:
                outbox.put((rid, list(out.outputs[0].token_ids), list(out.metrics.token_times),
                            arrival, out.num_cached_tokens))


def _arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _run(roles: list[tuple[str, dict, int]], prompts, offsets, max_tokens: int) -> list[tuple]:
    """Start the engines (a chain: each one's outbox is the next one's inbox), wait until all
    are ready, send the requests at their offsets, collect the last engine's results."""
    ctx = multiprocessing.get_context("spawn")
    boxes = [ctx.Queue() for _ in range(len(roles) + 1)]
    ready = ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(role, kw, threads, boxes[i], boxes[i + 1], ready),
                         daemon=True)
             for i, (role, kw, threads) in enumerate(roles)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=300)
        t0 = time.perf_counter()
        for i, (p, off) in enumerate(zip(prompts, offsets)):
            time.sleep(max(0.0, t0 + off - time.perf_counter()))
            boxes[0].put((f"r{i}", p, max_tokens, time.perf_counter()))
        results = [boxes[-1].get(timeout=600) for _ in prompts]
    finally:
        for b in boxes[:-1]:
            b.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return sorted(results, key=lambda r: int(r[0][1:]))


def _summary(results: list[tuple]) -> dict:
    ttfts = [times[0] - arrival for _, _, times, arrival, _ in results]
    gaps = [b - a for _, _, times, _, _ in results for a, b in zip(times, times[1:])]
    return {"ttfts": ttfts, "gaps": gaps,
            "tokens": [tokens for _, tokens, _, _, _ in results],
            "cached": [c for *_, c in results],
            "first_token_at": [times[0] for _, _, times, _, _ in results],
            "token_times": [times for _, _, times, _, _ in results],
            "arrivals": [arrival for _, _, _, arrival, _ in results]}


def disaggregated_pair(num_requests: int = 8, prompt_len: int = 512, max_tokens: int = 32,
                       rate: float = 2.0, block_size: int = 16, seed: int = 0,
                       model: str | None = None) -> dict:
    """The same Poisson arrivals (`rate` requests per second) through one engine (two
    threads) and through a producer-consumer pair (one thread each). Returns, for each, the
    per-request TTFT and every inter-token gap (seconds), the tokens, the cached tokens the
    consumer found (its external hit), and the token timelines."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, prompt_len) for _ in range(num_requests)]
    offsets = _arrivals(num_requests, rate, seed)
    kw = dict(model=model, block_size=block_size, max_model_len=prompt_len + max_tokens + 1,
              max_num_batched_tokens=prompt_len + max_tokens + 1,
              kv_cache_tokens=num_requests * (prompt_len + max_tokens + block_size))
    one = _summary(_run([("both", kw, 2)], prompts, offsets, max_tokens))
    with tempfile.TemporaryDirectory(prefix="kvlab-pd-") as folder:
        def side(role: str) -> dict:
            return dict(kw, kv_transfer_config={
                "kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": folder}})
        pair = _summary(_run([("producer", side("kv_producer"), 1),
                              ("consumer", side("kv_consumer"), 1)],
                             prompts, offsets, max_tokens))
    return {"one_engine": one, "pair": pair, "offsets": offsets,
            "identical": one["tokens"] == pair["tokens"],
            "median_ttft_ms": {k: 1000 * statistics.median(v["ttfts"])
                               for k, v in (("one_engine", one), ("pair", pair))},
            "p99_gap_ms": {k: 1000 * sorted(v["gaps"])[int(0.99 * (len(v["gaps"]) - 1))]
                           for k, v in (("one_engine", one), ("pair", pair))},
            "median_gap_ms": {k: 1000 * statistics.median(v["gaps"])
                              for k, v in (("one_engine", one), ("pair", pair))}}

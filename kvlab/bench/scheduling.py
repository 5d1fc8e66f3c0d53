"""The scheduling experiments of chapters 03-04, as functions the notebooks and the CLI call.

Protocol as the articles chapters 03-04 reproduce: a warm-up batch excluded, then `repeats` batches; medians are
reported with their spread. Every batch uses fresh prompts.

Every engine here runs without a prefix cache (vLLM's default has one): prompts from
`make_prompts` repeat across warm-ups, repeats and long bursts, and a hit would turn these
measurements of scheduling into chapter 05's of caching.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from kvlab import kv_sizing
from kvlab.bench.common import make_prompts, mixed_workload, transformers_generate
from kvlab.engine import LLM
from kvlab.metrics import StepRecord
from kvlab.model import load_model
from kvlab.sampling import SamplingParams


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between ranks; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class BatchResult:
    wall_s: float
    output_tokens: int
    ttfts: list[float]
    itls: list[float]
    num_preemptions: int
    steps: list[StepRecord] = field(repr=False)
    outputs: list = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_batch(llm: LLM, prompts: list, params) -> BatchResult:
    """Submit every prompt at once (a burst at concurrency len(prompts)) and run them all."""
    engine = llm.llm_engine
    first_step, preempted = engine.num_steps, engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return BatchResult(
        wall_s=wall,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
        ttfts=[o.metrics.ttft for o in outs],
        itls=[x for o in outs for x in o.metrics.itl],
        num_preemptions=engine.scheduler.num_preemptions - preempted,
        steps=[r for r in engine.step_trace if r.step > first_step],
        outputs=outs,
    )


def summarise(results: list[BatchResult]) -> dict:
    """Medians over repeats, with the throughput spread (min, max)."""
    tps = [r.tokens_per_s for r in results]
    return {
        "tok_s": round(statistics.median(tps), 1),
        "tok_s_spread": [round(min(tps), 1), round(max(tps), 1)],
        "ttft_median_ms": round(1000 * statistics.median(
            statistics.median(r.ttfts) for r in results), 1),
        "itl_median_ms": round(1000 * statistics.median(
            percentile(r.itls, 50) for r in results), 1),
        "itl_p99_ms": round(1000 * statistics.median(
            percentile(r.itls, 99) for r in results), 1),
        "preemptions": statistics.median(r.num_preemptions for r in results),
    }


def burst_prompts(tok, count: int, input_len: int, batch_index: int) -> list[dict]:
    """`count` distinct prompts of `input_len` tokens; each batch gets different ones."""
    prompts = make_prompts(tok, count * (batch_index + 1), input_len, input_len)
    return [{"prompt_token_ids": p} for p in prompts[count * batch_index:]]


def measure_bursts(llm: LLM, concurrency: int, input_len: int, output_len: int,
                   repeats: int = 3) -> dict:
    """Warm-up burst (excluded), then `repeats` bursts of `concurrency` requests."""
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    run_batch(llm, burst_prompts(tok, min(concurrency, 4), input_len, 0), sp)  # warm-up
    results = [run_batch(llm, burst_prompts(tok, concurrency, input_len, i + 1), sp)
               for i in range(repeats)]
    return summarise(results)


def continuous_batching_table(
    servers: dict[str, tuple[dict, tuple[int, ...]]] | None = None,
    input_len: int = 64, output_len: int = 32, repeats: int | dict[str, int] = 3,
    model: str | None = None, progress: bool = False,
) -> list[dict]:
    """The seed table: one-at-a-time (`max_num_seqs=1`) against the default scheduler, bursts
    of `concurrency` requests of input_len + output_len tokens (EOS ignored). `repeats`: runs
    per point, or per server name ({"max_num_seqs=1": 1, "default": 3})."""
    if isinstance(repeats, dict) and servers is not None and set(repeats) != set(servers):
        raise ValueError(f"repeats names {sorted(repeats)}, the servers are {sorted(servers)}")
    if servers is None:
        servers = {"max_num_seqs=1": ({"max_num_seqs": 1}, (1, 16)),
                   "default": ({}, (1, 4, 16))}
    points = [(name, c) for name, (_, concurrencies) in servers.items() for c in concurrencies]
    rows, engines = [], {}
    for name, c in tqdm(points, desc="continuous batching", disable=not progress):
        if name not in engines:
            engines[name] = LLM(model, enable_prefix_caching=False, max_model_len=input_len + output_len + 16,
                                **servers[name][0])
        rows.append({"server": name, "concurrency": c,
                     **measure_bursts(engines[name], c, input_len, output_len,
                                      repeats[name] if isinstance(repeats, dict) else repeats)})
    return rows


def kv_capacity_sweep(concurrencies=(1, 4, 8, 16, 32), kv_cache_tokens: int = 1536,
                      input_len: int = 64, output_len: int = 32, repeats: int = 1,
                      block_size: int = 16, model: str | None = None,
                      progress: bool = False) -> dict:
    """Concurrency past what the KV budget holds: throughput flattens, TTFT climbs, requests are
    preempted. Returns the rows and the predicted knee: how many requests the pool holds to their
    end at once, each in whole blocks of input_len + output_len - 1 tokens (`slots_per_request`)."""
    llm = LLM(model, enable_prefix_caching=False, block_size=block_size, kv_cache_tokens=kv_cache_tokens,
              max_model_len=input_len + output_len + block_size)
    rows = [{"concurrency": c, **measure_bursts(llm, c, input_len, output_len, repeats)}
            for c in tqdm(concurrencies, desc="KV capacity", disable=not progress)]
    # What a request holds at its end, in whole blocks (kvlab.kv_sizing: p + N - 1 tokens).
    blocks = kv_sizing.blocks_held(input_len, output_len, block_size)
    stats = llm.stats()
    return {"rows": rows, "kv_tokens": stats["kv_capacity_tokens"],
            "slots_per_request": blocks * block_size,
            "predicted_knee": kv_sizing.requests_at_once(stats["num_usable_blocks"], input_len,
                                                         output_len, block_size)}


def gantt_runs(num_requests: int = 8, max_num_seqs: int = 4, input_len: int = 32,
               output_lens=(4, 24, 8, 16, 6, 20, 10, 12), model: str | None = None) -> dict:
    """The same workload under static and continuous batching; each run's step trace."""
    runs = {}
    for scheduling in ("static", "continuous"):
        llm = LLM(model, enable_prefix_caching=False, scheduling=scheduling, max_num_seqs=max_num_seqs,
                  max_model_len=input_len + max(output_lens) + 16, kv_cache_tokens=4096)
        tok = llm.get_tokenizer()
        prompts = burst_prompts(tok, num_requests, input_len, 0)
        params = [SamplingParams(max_tokens=output_lens[i % len(output_lens)], temperature=0,
                                 ignore_eos=True) for i in range(num_requests)]
        runs[scheduling] = run_batch(llm, prompts, params)
    return runs


def throughput_targets(num_requests: int = 16, input_lens=(64, 128), output_lens=(96, 128),
                       repeats: int = 3, model: str | None = None) -> dict:
    """Throughput side by side in one run on a mixed-length workload:
    continuous batching vs `max_num_seqs=1`, and vs transformers `generate` (static, padded,
    run to the longest output; only requested tokens count as useful)."""
    loaded = load_model(model)
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts, params, lens_out = mixed_workload(tok, num_requests, input_lens, output_lens)
    useful = sum(lens_out)
    max_len = max(input_lens) + max(output_lens) + 16
    engines = {"continuous": LLM(model, enable_prefix_caching=False, max_model_len=max_len),
               "max_num_seqs=1": LLM(model, enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=1)}
    work = {name: (lambda llm=llm: llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                params))
            for name, llm in engines.items()}
    work["transformers generate"] = lambda: transformers_generate(
        loaded.hf_model, prompts, max(lens_out), pad_id)
    times: dict[str, list[float]] = {name: [] for name in work}
    for name, fn in work.items():
        fn()  # warm-up
    for _ in range(repeats):  # interleaved, so drift in machine speed hits every peer alike
        for name, fn in work.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rows = {name: {"useful_tok_s": round(useful / statistics.median(t), 1),
                   "spread_s": [round(min(t), 2), round(max(t), 2)]} for name, t in times.items()}
    cont = rows["continuous"]["useful_tok_s"]
    return {
        "workload": {"requests": num_requests, "input_lens": list(input_lens),
                     "output_lens": list(output_lens), "useful_tokens": useful},
        "rows": rows,
        "continuous_over_one_at_a_time": round(cont / rows["max_num_seqs=1"]["useful_tok_s"], 2),
        "continuous_over_transformers": round(
            cont / rows["transformers generate"]["useful_tok_s"], 2),
    }


def engine_overhead(num_requests: int = 64, input_len: int = 32, output_len: int = 32,
                    model: str | None = None) -> dict:
    """Share of step time spent outside the model forward (scheduling, block bookkeeping,
    building the batch, sampling) in decode steps with every request running."""
    llm = LLM(model, enable_prefix_caching=False, max_model_len=input_len + output_len + 16)
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    run_batch(llm, burst_prompts(tok, 4, input_len, 0), sp)  # warm-up
    res = run_batch(llm, burst_prompts(tok, num_requests, input_len, 1), sp)
    steps = [r for r in res.steps
             if r.num_prefill_tokens == 0 and len(r.request_ids) == num_requests]
    fractions = [(r.step_time - r.forward_time) / r.step_time for r in steps]
    return {"running": num_requests, "decode_steps": len(steps),
            "step_ms_median": round(1000 * statistics.median(r.step_time for r in steps), 1),
            "overhead_ms_median": round(1000 * statistics.median(
                r.step_time - r.forward_time for r in steps), 2),
            "overhead_fraction_median": round(statistics.median(fractions), 4)}


# ---- chunked prefill (chapter 04) ----------------------------------------------------------

def prefill_rate(lengths=(128, 256, 512, 1024), model: str | None = None,
                 repeats: int = 3) -> dict:
    """Prefill tokens per second on this machine: one prompt per step, model time only.

    Each length is prefilled `repeats` times (after one warm-up) and keeps its fastest time:
    anything else running on the machine can only add time to a step, never remove it, so one
    busy moment does not drag the rate down. Also the fastest step that decodes one request
    alone (`decode_step_s`, the whole step: schedule, forward, sample).

    Returns {"points": [(length, seconds), ...], "tokens_per_s": sum of the lengths / sum of
    their times, "decode_step_s": seconds}."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    llm = LLM(model, enable_prefix_caching=False, max_model_len=max(lengths) + 16, enable_chunked_prefill=False)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=1, temperature=0)

    def prefill_seconds(n: int) -> float:
        first = engine.num_steps
        llm.generate({"prompt_token_ids": make_prompts(tok, 1, n, n)[0]}, sp)
        return min(r.forward_time for r in engine.step_trace
                   if r.step > first and r.num_prefill_tokens == n)

    prefill_seconds(lengths[0])  # warm-up
    points = [(n, min(prefill_seconds(n) for _ in range(repeats))) for n in lengths]
    total_tokens = sum(n for n, _ in points)
    first = engine.num_steps
    decode_prompt = make_prompts(tok, 1, 32, 32)[0]
    llm.generate({"prompt_token_ids": decode_prompt},
                 SamplingParams(max_tokens=2 + 2 * repeats, temperature=0, ignore_eos=True))
    decode_step = min(r.step_time for r in engine.step_trace
                      if r.step > first and r.num_prefill_tokens == 0 and r.num_decode_tokens == 1)
    return {"points": points, "tokens_per_s": round(total_tokens / sum(t for _, t in points), 1),
            "decode_step_s": decode_step}


@dataclass
class StallRun:
    budget: int | None  # None: chunking off
    decode_times: list[float]  # the decoding request's token times, seconds from its arrival
    insert_time: float  # when the long prompt arrived (same clock)
    inserted_ttft: float  # the long prompt's time to first token
    max_gap: float  # worst gap of the decoding request while the long prompt was prefilled
    chunks: int  # steps the long prompt's prefill took


def chunked_prefill_stall(budget: int | None, long_len: int = 1024, decode_prompt_len: int = 32,
                          insert_after: int = 8, tail_tokens: int = 6, llm: LLM | None = None,
                          model: str | None = None) -> StallRun:
    """One request decodes; after `insert_after` of its tokens a `long_len`-token prompt
    arrives. `budget` None means chunking off (the whole prompt in one step)."""
    if llm is None:
        llm = stall_engine(budget, long_len, model)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    prompts = make_prompts(tok, 2, decode_prompt_len, long_len)
    decoder, long_prompt = prompts[0][:decode_prompt_len], prompts[1][:long_len]
    rid = f"stall-{engine.num_requests_added}"
    engine.add_request(rid + "-decode", {"prompt_token_ids": decoder},
                       SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    dec = engine.requests[rid + "-decode"]
    while len(dec.output_token_ids) < insert_after:
        engine.step()
    engine.add_request(rid + "-long", {"prompt_token_ids": long_prompt},
                       SamplingParams(max_tokens=1, temperature=0))
    long_req = engine.requests[rid + "-long"]
    first_step = engine.num_steps
    while not long_req.is_finished:
        engine.step()
    chunks = sum(1 for r in engine.step_trace
                 if r.step > first_step and long_req.request_id in r.request_ids)
    target = len(dec.output_token_ids) + tail_tokens
    while len(dec.output_token_ids) < target:
        engine.step()
    engine.abort_request(rid + "-decode")
    t0 = dec.metrics.arrival_time
    times = [t - t0 for t in dec.metrics.token_times]
    insert = long_req.metrics.arrival_time - t0
    done = long_req.metrics.first_token_time - t0
    gaps = [b - a for a, b in zip(times, times[1:]) if b > insert and a < done]
    return StallRun(budget, times, insert, long_req.metrics.ttft, max(gaps), chunks)


def stall_engine(budget: int | None, long_len: int = 1024, model: str | None = None) -> LLM:
    max_len = long_len + 512
    if budget is None:
        return LLM(model, enable_prefix_caching=False, max_model_len=max_len, enable_chunked_prefill=False,
                   max_num_batched_tokens=max_len)
    return LLM(model, enable_prefix_caching=False, max_model_len=max_len, max_num_batched_tokens=budget)


def chunked_prefill_trials(budget: int | None, long_len: int = 1024, repeats: int = 1,
                           model: str | None = None) -> list[StallRun]:
    """`repeats` stall runs at one budget on one engine, after a warm-up run (excluded)."""
    llm = stall_engine(budget, long_len, model)
    chunked_prefill_stall(budget, long_len, llm=llm)  # warm-up
    return [chunked_prefill_stall(budget, long_len, llm=llm) for _ in range(repeats)]


def chunked_prefill_table(budgets=(64, 128, 256, 512, None), long_len: int = 1024,
                          repeats: int = 1, model: str | None = None) -> list[StallRun]:
    """The stall table: for each budget, the run with the median worst decode gap."""
    runs = []
    for budget in budgets:
        trials = chunked_prefill_trials(budget, long_len, repeats, model)
        runs.append(sorted(trials, key=lambda r: r.max_gap)[len(trials) // 2])
    return runs


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares y = a + b x; returns (a, b, r^2)."""
    t = torch.tensor([xs, ys], dtype=torch.float64)
    x, y = t[0], t[1]
    b = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    a = float(y.mean() - b * x.mean())
    ss_res = float(((y - (a + b * x)) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return a, b, 1 - ss_res / ss_tot if ss_tot else 1.0


def full_prompt_admission(num_requests: int = 12, input_len: int = 200, output_len: int = 16,
                          kv_cache_tokens: int = 1024, budget: int = 64, block_size: int = 16,
                          model: str | None = None, progress: bool = False) -> dict:
    """vLLM's `scheduler_reserve_full_isl` on and off (vllm/config/scheduler.py; on by default
    in 0.33.0): one burst of long prompts, chunked by a small token budget, into a KV pool that
    holds only a few of them. Off, a waiting request is admitted as soon as its first chunk fits,
    so more prompts start than the pool can finish and running ones are preempted and
    recomputed; on, a prompt starts only when all of it fits. Returns, per setting, the
    preemptions, the tokens computed again (scheduled tokens beyond each request's prompt plus
    output less one), throughput, TTFT, and whether the tokens equal the other setting's."""
    tok = load_model(model).tokenizer
    prompts = [{"prompt_token_ids": p}
               for p in make_prompts(tok, num_requests, input_len, input_len)]
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    needed = num_requests * (input_len + output_len - 1)  # the last token is never fed back
    rows, tokens = [], {}
    for full in tqdm((True, False), desc="full-prompt admission", disable=not progress):
        llm = LLM(model, enable_prefix_caching=False, block_size=block_size, kv_cache_tokens=kv_cache_tokens,
                  max_model_len=input_len + output_len + block_size,
                  max_num_batched_tokens=budget, scheduler_reserve_full_isl=full)
        result = run_batch(llm, prompts, sp)
        computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in result.steps)
        tokens[full] = [o.outputs[0].token_ids for o in result.outputs]
        rows.append({
            "scheduler_reserve_full_isl": full,
            "preemptions": result.num_preemptions,
            "recomputed_tokens": computed - needed,
            "steps": len(result.steps),
            "tok_s": round(result.tokens_per_s, 1),
            "ttft_median_ms": round(1000 * statistics.median(result.ttfts), 1),
            "peak_running": max(s.num_running for s in result.steps),
        })
    return {"rows": rows, "same_tokens": tokens[True] == tokens[False],
            "kv_tokens": kv_cache_tokens, "budget": budget, "input_len": input_len,
            "output_len": output_len, "num_requests": num_requests}


def head_of_line(thresholds=(0, 64), long_len: int = 1024, short_len: int = 32,
                 budget: int = 256, arrive_after: int = 1, repeats: int = 3,
                 model: str | None = None) -> list[dict]:
    """The stall chunked prefill leaves: a `long_len`-token prompt is being prefilled in chunks
    of `budget` tokens when a `short_len`-token one arrives (after `arrive_after` of the long
    prompt's steps). Per `long_prefill_token_threshold` (0: vLLM's default, no cap): the short
    request's TTFT and the steps it waited, and the long prompt's TTFT, what the cap costs it.
    Medians over `repeats` runs on one engine per threshold, after a warm-up run."""
    rows = []
    for threshold in thresholds:
        llm = LLM(model, enable_prefix_caching=False, max_model_len=long_len + 64,
                  max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
        engine = llm.llm_engine
        tok = llm.get_tokenizer()
        long_ids, short_ids = make_prompts(tok, 2, short_len, long_len)[::-1]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        runs = []
        for i in range(repeats + 1):  # the first run is the warm-up
            start = engine.num_steps
            engine.add_request(f"long-{i}", {"prompt_token_ids": long_ids[:long_len]}, one)
            long_req = engine.requests[f"long-{i}"]
            while engine.num_steps < start + arrive_after:  # steps of the long prompt read
                engine.step()
            engine.add_request(f"short-{i}", {"prompt_token_ids": short_ids[:short_len]}, one)
            short_req, arrived_at = engine.requests[f"short-{i}"], engine.num_steps
            finished = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = (out.metrics.ttft, engine.num_steps)
            if i:
                runs.append({"short_ttft_ms": 1000 * finished[short_req.request_id][0],
                             "short_steps_waited": finished[short_req.request_id][1] - arrived_at,
                             "long_ttft_ms": 1000 * finished[long_req.request_id][0]})
        rows.append({"long_prefill_token_threshold": threshold, "budget": budget,
                     "long_len": long_len, "short_len": short_len,
                     **{k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}})
    return rows


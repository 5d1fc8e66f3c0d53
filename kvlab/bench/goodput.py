"""Goodput under an SLO: a workload of Poisson arrivals replayed through an engine, and the
requests per second that met their latency bounds (chapter 07's tuning lab).

The definitions follow vLLM's benchmark (`vllm bench serve --goodput ttft:MS tpot:MS`,
vllm/benchmarks/serve.py): a request is good when each of its measures is within its bound, and
goodput is the good requests over the run's duration. The measures: TTFT (arrival to first
token), TPOT (the mean time per output token after the first), and one vLLM's goodput does not
take, the request's worst inter-token gap: a stream that stalls for a long prefill chunk once
(chapter 04) can keep a good TPOT, because TPOT averages the stall away.

The replay runs on a virtual clock, and an idle engine jumps to the next arrival instead of
sleeping through it. Each engine call advances the clock by one of two things:
- its measured wall time (`step_cost=None`): the real latencies, which a busy laptop inflates
  and which differ from run to run, since a slower step changes which requests overlap;
- a `StepCost`: chapter 04's model of a step, the decode step plus a price per prompt token
  and per extra decode, measured on this machine first (`measure_step_cost`). The engine
  still schedules and runs every step for real (the tokens are the model's), but the clock is
  the model's, so the same settings give the same latencies every time: what a grader needs.
  `Replay.measured_s` keeps the wall time beside it, to show how close the model came.
(On a GPU the forward overlaps the host's work; here each step's time is what it took.)
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from kvlab.bench.scheduling import percentile
from kvlab.sampling import RequestOutputKind, SamplingParams
from kvlab.step_log import StepObserver


@dataclass(frozen=True)
class Workload:
    """Requests drawn from stated distributions, with Poisson arrivals (fixed by `seed`)."""

    num_requests: int
    rate: float  # requests per second (Poisson: exponential gaps)
    short_prompt: tuple[int, int]  # prompt lengths, uniform in [lo, hi]
    long_prompt: tuple[int, int]
    long_share: float  # the share of requests with a long prompt (documents)
    output_len: tuple[int, int]
    seed: int = 0

    def requests(self, vocab_size: int) -> list[dict]:
        """arrival_s, prompt_token_ids and output_len for each request, in arrival order. The
        prompts are random token ids: no two share a prefix, so no prefix-cache hit blurs the
        latencies."""
        rng = random.Random(self.seed)
        clock, out = 0.0, []
        for i in range(self.num_requests):
            if i:
                clock += rng.expovariate(self.rate)
            lo, hi = self.long_prompt if rng.random() < self.long_share else self.short_prompt
            n = rng.randint(lo, hi)
            out.append({"arrival_s": clock,
                        "prompt_token_ids": [rng.randrange(1000, vocab_size) for _ in range(n)],
                        "output_len": rng.randint(*self.output_len)})
        return out

    def max_len(self) -> int:
        return max(self.short_prompt[1], self.long_prompt[1]) + self.output_len[1]


@dataclass(frozen=True)
class SLO:
    """Bounds per request, in seconds; None: not bounded."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    max_gap_s: float | None = None

    def met(self, row: dict) -> bool:
        return all(bound is None or row[key] <= bound for key, bound in
                   (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s),
                    ("max_gap_s", self.max_gap_s)))


@dataclass(frozen=True)
class StepCost:
    """A step's time as chapter 04 models it: the decode step, plus each prompt token at the
    prefill rate, plus each decode beyond the first (its attention over its own context)."""

    decode_s: float
    prefill_token_s: float
    extra_decode_s: float

    def __call__(self, num_tokens: int, num_decodes: int) -> float:
        return (self.decode_s + max(0, num_tokens - num_decodes) * self.prefill_token_s
                + max(0, num_decodes - 1) * self.extra_decode_s)


def measure_step_cost(repeats: int = 3, **llm_kwargs) -> StepCost:
    """This machine's StepCost, each part the fastest of `repeats` runs (a busy core only adds
    time): one request decoding alone; prompts of 64 and 256 tokens alone (the slope between
    them); four requests decoding together at a context of about 100. Random prompts, so no
    prefix-cache hit shortens a prefill. `llm_kwargs`: what changes a step's cost (block_size,
    kv_cache_dtype)."""
    from kvlab.engine import LLM

    llm = LLM(max_model_len=300, kv_cache_tokens=2048, max_num_seqs=4, **llm_kwargs)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(1)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(length)]}
                for _ in range(n)]

    def decode_step(batch: int, length: int) -> float:
        sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        first = llm.llm_engine.num_steps
        llm.generate(prompts(batch, length), sp)
        steps = [r.step_time for r in llm.llm_engine.step_trace
                 if r.step > first + 2 and r.num_prefill_tokens == 0
                 and len(r.request_ids) == batch]
        return statistics.median(steps)

    def prefill_step(length: int) -> float:
        first = llm.llm_engine.num_steps
        llm.generate(prompts(1, length), SamplingParams(max_tokens=1))
        return next(r.step_time for r in llm.llm_engine.step_trace if r.step > first)

    decode_step(1, 16)  # warm-up
    one = min(decode_step(1, 32) for _ in range(repeats))
    four = min(decode_step(4, 96) for _ in range(repeats))
    short = min(prefill_step(64) for _ in range(repeats))
    long = min(prefill_step(256) for _ in range(repeats))
    return StepCost(decode_s=one, prefill_token_s=max(long - short, 0.0) / 192,
                    extra_decode_s=max(four - one, 0.0) / 3)


class _Scheduled(StepObserver):
    """Collects what each scheduled step carries: (tokens, decodes)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def on_schedule(self, engine, sched) -> None:
        counts = [n for _, n in sched.scheduled]
        if counts:
            self.steps.append((sum(counts), sum(n == 1 for n in counts)))


@dataclass
class Replay:
    rows: list[dict]  # per request: arrival_s, ttft_s, tpot_s, e2e_s, output_tokens
    duration_s: float  # first arrival to last token, on the virtual clock
    preemptions: int
    steps: int
    tokens: list[list[int]] = field(repr=False, default_factory=list)
    measured_s: float = 0.0  # the engine calls' wall time, whichever clock ran

    def goodput(self, slo: SLO) -> float:
        return sum(slo.met(r) for r in self.rows) / self.duration_s

    def summary(self, slo: SLO) -> dict:
        ttft = [r["ttft_s"] for r in self.rows]
        tpot = [r["tpot_s"] for r in self.rows]
        gaps = [r["max_gap_s"] for r in self.rows]

        def missed(key, bound):
            return sum(bound is not None and r[key] > bound for r in self.rows)

        # A miss count for each bound the SLO sets (none for a measure it leaves unbounded).
        misses = {f"missed_{name}": missed(key, bound) for name, key, bound in
                  (("ttft", "ttft_s", slo.ttft_s), ("tpot", "tpot_s", slo.tpot_s),
                   ("gap", "max_gap_s", slo.max_gap_s)) if bound is not None}
        return {"goodput": round(self.goodput(slo), 3),
                "met": sum(slo.met(r) for r in self.rows), "of": len(self.rows), **misses,
                "p50_ttft_s": round(statistics.median(ttft), 3),
                "p99_ttft_s": round(percentile(ttft, 99), 3),
                "p50_tpot_ms": round(1000 * statistics.median(tpot), 1),
                "p99_tpot_ms": round(1000 * percentile(tpot, 99), 1),
                "p50_max_gap_ms": round(1000 * statistics.median(gaps), 1),
                "p99_max_gap_ms": round(1000 * percentile(gaps, 99), 1),
                "duration_s": round(self.duration_s, 2), "preemptions": self.preemptions}


def replay(llm, workload: Workload, step_cost: StepCost | None = None,
           max_steps: int = 100_000) -> Replay:
    """Run `workload` through `llm` (a kvlab LLM) to the end on the virtual clock: measured
    step times, or `step_cost`'s."""
    engine = llm.llm_engine
    scheduled = _Scheduled()
    engine.add_observer(scheduled)
    measured = 0.0
    reqs = workload.requests(llm.get_tokenizer().vocab_size)
    ids = [f"goodput-{engine.num_requests_added + i}" for i in range(len(reqs))]
    first_preemptions = llm.stats()["num_preemptions"]
    seen: dict[str, dict] = {}
    clock, nxt, steps = 0.0, 0, 0
    while steps < max_steps:
        while nxt < len(reqs) and reqs[nxt]["arrival_s"] <= clock:
            r = reqs[nxt]
            sp = SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True,
                                output_kind=RequestOutputKind.CUMULATIVE)
            engine.add_request(ids[nxt], {"prompt_token_ids": r["prompt_token_ids"]}, sp)
            seen[ids[nxt]] = {"arrival_s": r["arrival_s"], "first": None, "last": None,
                              "n": 0, "gap": 0.0, "tokens": []}
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt == len(reqs):
                break
            clock = max(clock, reqs[nxt]["arrival_s"])  # idle: jump to the next arrival
            continue
        before = len(scheduled.steps)
        t0 = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - t0
        measured += wall
        # The steps this call scheduled ran their forward in it (kvlab runs each at once).
        clock += (wall if step_cost is None
                  else sum(step_cost(*s) for s in scheduled.steps[before:]))
        steps += 1
        for out in outputs:
            s = seen.get(out.request_id)
            if s is None:
                continue
            toks = out.outputs[0].token_ids
            if len(toks) > s["n"]:
                if s["first"] is None:
                    s["first"] = clock
                else:
                    s["gap"] = max(s["gap"], clock - s["last"])
                s["last"], s["n"], s["tokens"] = clock, len(toks), list(toks)
    else:
        raise RuntimeError(f"the workload did not finish in {max_steps} steps")
    engine.remove_observer(scheduled)
    rows = []
    for rid in ids:
        s = seen[rid]
        ttft = s["first"] - s["arrival_s"]
        tpot = (s["last"] - s["first"]) / (s["n"] - 1) if s["n"] > 1 else 0.0
        rows.append({"arrival_s": s["arrival_s"], "ttft_s": ttft, "tpot_s": tpot,
                     "max_gap_s": s["gap"], "e2e_s": s["last"] - s["arrival_s"],
                     "output_tokens": s["n"]})
    duration = max(seen[r]["last"] for r in ids) - reqs[0]["arrival_s"]
    return Replay(rows=rows, duration_s=duration,
                  preemptions=llm.stats()["num_preemptions"] - first_preemptions, steps=steps,
                  tokens=[seen[r]["tokens"] for r in ids], measured_s=measured)

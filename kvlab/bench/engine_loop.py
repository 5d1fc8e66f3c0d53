"""What vLLM's defaults change in chapter 03: preemption with and without the prefix cache, and
the synchronous loop against async scheduling (which step is scheduled and which is read at
each call, and the one more slot a request that stops on a stop token is given).

Each function builds fresh engines and runs them one after another in this process.
"""

from __future__ import annotations

import time

from kvlab.bench.common import make_prompts
from kvlab.engine import LLM
from kvlab.sampling import SamplingParams
from kvlab.step_log import StepObserver


def preemption_cost(num_requests: int = 12, min_len: int = 40, max_len: int = 90,
                    max_tokens: int = 24, kv_cache_tokens: int = 256, block_size: int = 8,
                    model: str | None = None) -> list[dict]:
    """The same burst through a pool too small for it, with the prefix cache off (a preempted
    request recomputes everything it had) and on (vLLM's default: its full blocks went to the
    free queue's tail and are found again at re-admission, unless evicted meanwhile).

    Per mode: preemptions, prompt and output tokens computed again after a preemption (every
    prefill token beyond each prompt's first computation), the tokens re-admissions found in
    the cache, the wall time, and whether the tokens equal a roomy engine's."""
    prompts = None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rows, want = [], None
    for caching in (None, False, True):  # None: the roomy reference, no preemption
        roomy = caching is None
        llm = LLM(model, block_size=block_size, max_model_len=max_len + max_tokens + block_size,
                  kv_cache_tokens=(16 * kv_cache_tokens if roomy else kv_cache_tokens),
                  enable_prefix_caching=bool(caching))
        if prompts is None:
            prompts = [{"prompt_token_ids": p}
                       for p in make_prompts(llm.get_tokenizer(), num_requests, min_len, max_len)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
        run = run_burst(llm, prompts, sp)
        if roomy:
            want = run["tokens"]
            continue
        rows.append({
            "enable_prefix_caching": caching,
            "preemptions": run["preemptions"],
            "tokens_recomputed": run["tokens_recomputed"],
            "tokens_found_again": run["found_in_pool"],
            "wall_s": round(run["wall_s"], 2),
            "output_tokens": sum(len(t) for t in run["tokens"]),
            "identical_to_roomy": run["tokens"] == want,
            "leaked_blocks": run["leaked_blocks"],
        })
    return rows


def run_burst(llm: LLM, prompts: list[dict], sp: SamplingParams) -> dict:
    """One burst through `llm`, what its preemptions cost: preemptions, prompt and output
    tokens computed again (every prefill token beyond each prompt's first computation, whose
    own hits, the pool's and a KV connector's, are not computed), the tokens re-admissions found
    in the pool and loaded by a connector (chapter 10), the wall time, the tokens, and the
    blocks still held at the end."""
    llm.llm_engine.step_log.step_trace.clear()
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    s = llm.stats()

    def delta(key: str) -> int:
        return s[key] - before[key]

    prefill = sum(r.num_prefill_tokens for r in llm.llm_engine.step_trace)
    first_hits = delta("prefix_cache_hits") + delta("external_prefix_cache_hits")
    first_compute = sum(len(p["prompt_token_ids"]) for p in prompts) - first_hits
    return {"preemptions": delta("num_preemptions"),
            "tokens_recomputed": prefill - first_compute,
            "found_in_pool": delta("prefix_cache_preempted_hits"),
            "loaded_from_tier": delta("external_prefix_cache_preempted_hits"),
            "wall_s": wall, "tokens": [o.outputs[0].token_ids for o in outs],
            "leaked_blocks": s["num_used_blocks"]}


class _CallLog(StepObserver):
    """Which step each `engine.step()` call scheduled and which it read."""

    def __init__(self) -> None:
        self.scheduled: list[int] = []  # steps scheduled during the current call
        self.num_scheduled = 0

    def on_schedule(self, engine, scheduler_output) -> None:
        if scheduler_output.scheduled:
            self.num_scheduled += 1
            self.scheduled.append(self.num_scheduled)


def loop_orders(num_requests: int = 2, prompt_len: int = 24, max_tokens: int = 4,
                model: str | None = None) -> dict[str, list[dict]]:
    """The same requests through the synchronous loop and through async scheduling: for each
    call of `engine.step()`, the step it scheduled (None: none) and the step whose tokens it
    read (None: none), and the requests that got a token from it. Tokens are returned too,
    to show they are the same."""
    out = {}
    for name, async_scheduling in (("synchronous", False), ("async scheduling", True)):
        llm = LLM(model, max_model_len=prompt_len + max_tokens + 16, kv_cache_tokens=1024,
                  async_scheduling=async_scheduling, enable_prefix_caching=False)
        engine = llm.llm_engine
        log = _CallLog()
        engine.add_observer(log)
        prompts = make_prompts(llm.get_tokenizer(), num_requests, prompt_len, prompt_len)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        calls, tokens = [], {}
        while engine.has_unfinished_requests():
            log.scheduled = []
            read_before = engine.num_steps
            outputs = engine.step()
            calls.append({"call": len(calls) + 1,
                          "scheduled": log.scheduled[0] if log.scheduled else None,
                          "read": engine.num_steps if engine.num_steps > read_before else None,
                          "tokens_to": [o.request_id for o in outputs]})
            for o in outputs:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        out[name] = {"calls": calls, "tokens": tokens}
    return out


def stop_slots(prompt_len: int = 31, stop_after: int = 6, block_size: int = 4,
               model: str | None = None) -> list[dict]:
    """One greedy request that ends on a stop token, in each loop: the most positions it was
    given K/V slots for, against prompt + N - 1 (N: its output tokens). The stop token is the
    greedy output's first token, at or after the `stop_after`-th, that did not appear before it
    and that makes prompt + N - 1 fill its last block exactly. Under async scheduling the step
    after the stop token is scheduled before the stop is seen: one slot more, here a block more.
    """
    rows = []
    for async_scheduling in (False, True):
        llm = LLM(model, block_size=block_size, max_model_len=prompt_len + 128,
                  kv_cache_tokens=1024, async_scheduling=async_scheduling,
                  enable_prefix_caching=False)
        prompt = {"prompt_token_ids": make_prompts(llm.get_tokenizer(), 1, prompt_len,
                                                   prompt_len)[0]}
        free = llm.generate(prompt, SamplingParams(max_tokens=stop_after + 8 * block_size,
                                                   temperature=0, ignore_eos=True))[0]
        ids = free.outputs[0].token_ids
        k = next(k for k in range(stop_after - 1, len(ids))
                 if ids[k] not in ids[:k] and (prompt_len + k) % block_size == 0)
        engine = llm.llm_engine
        seen = {"slots": 0}

        class _Peak(StepObserver):
            def on_schedule(self, engine, sched) -> None:
                for r, n in sched.scheduled:
                    seen["slots"] = max(seen["slots"], sched.num_computed_tokens[r.request_id] + n)

        engine.add_observer(_Peak())
        out = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[ids[k]]))[0].outputs[0]
        n = len(out.token_ids)
        rows.append({"async_scheduling": async_scheduling, "output_tokens": n,
                     "finish_reason": out.finish_reason,
                     "p_plus_n_minus_1": prompt_len + n - 1, "slots_given": seen["slots"],
                     "blocks_needed": -(-seen["slots"] // block_size)})
    return rows

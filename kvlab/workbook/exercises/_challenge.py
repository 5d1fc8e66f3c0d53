"""What the challenges share: a challenge asks for a decision, and its check measures it.

An exercise of `kind == "challenge"` asks for a choice, not a mechanism: a setting, or a small
function that returns one. Its check runs the participant's choice and kvlab's reference choice
side by side on the real model, in one run, and says how close the participant came to the best
and why. A do-nothing answer (the stub) is "not done yet"; a choice that breaks the workload
fails with what it cost. Each challenge has its own module beside its chapter's builds, named
for it (ch03_max_num_seqs.py), but chapter 08's, which shares ch08_kv_precision.py with its
build; kvlab/workbook/chapters.py says which chapter holds which.

What is here: the pool-sizing challenges' (01, 02) tolerance and their engine run. An operator
sizes the pool before the load comes (vLLM: `gpu_memory_utilization` or `kv_cache_memory_bytes`;
kvlab: `kv_cache_tokens`). Too small, and running requests are preempted and recomputed; too
large, and memory that could hold other requests' KV sits idle. Each check runs the
participant's pool on the real model, beside the smallest pool that works, and counts what ran
at once and what was preempted.
"""

from __future__ import annotations

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Mismatch, positive_int
from kvlab.sampling import SamplingParams

# A pool more than this much above the smallest one that works leaves memory idle.
SLACK = 0.10
MAX_STEPS = 4000  # a pool too small for the workload to finish stops here, reported


def _pool_tokens(value, what: str) -> int:
    return positive_int(value, f"{what}: a number of tokens (an int >= 1)")


def _within(got: int, best: int, what: str, too_small: str) -> None:
    if got < best:
        raise Mismatch(f"{what}: at least {best:,} tokens", f"{got:,}: {too_small}")
    if got > best * (1 + SLACK):
        raise Mismatch(f"{what}: at most {int(best * (1 + SLACK)):,} tokens "
                       f"({SLACK:.0%} above the smallest pool that works, {best:,})",
                       f"{got:,}: {got - best:,} tokens of KV memory never used")


def _run(llm_kwargs: dict, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Run the requests to the end on a fresh engine, stepping by hand so that a pool too small
    to finish cannot hang the check: peak running, preemptions, the tokens."""
    engine = _real_engine.new_engine(**llm_kwargs)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    outs = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [o.token_ids for o in out.outputs]
    else:
        raise Mismatch("every request finishes", f"still running after {MAX_STEPS} steps: the "
                       "pool is too small for the requests it preempts to ever finish")
    return {"peak_running": max((r.num_running for r in engine.step_trace), default=0),
            "first_running": engine.step_trace[0].num_running if engine.step_trace else 0,
            "preemptions": engine.stats()["num_preemptions"],
            "tokens": [outs[f"r{i}"] for i in range(len(prompts))]}

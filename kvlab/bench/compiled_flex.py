"""Compiled FlexAttention proved on a CPU: how many graphs a varied run compiles, its tokens
against `reference`, and its speed against the default path (`python -m kvlab.bench
compiled-flex`).

Defined for notebook 07's "on a GPU" section. torch.compile of the flex path runs on a CPU too
(inductor's C++ FlexAttention kernel), so what a first GPU run would discover about recompiles
is found here: one engine steps through a fixed, varied workload (requests arriving in bursts,
so the batch size changes; prompt lengths from a few tokens to a few hundred, chunked by the
token budget; a shared system prompt and repeated prompts hitting the prefix cache; a KV budget
small enough to preempt), and dynamo's counters say how many graphs it compiled and why each
recompile happened. The same workload on `backend="reference"` gives the tokens to match, and
on the default path (`"auto"`) the time to beat.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import torch

from kvlab.bench.common import make_prompts
from kvlab.engine import LLM
from kvlab.model import load_model
from kvlab.sampling import SamplingParams

# The engine every backend runs the workload on: a 256-token budget chunks long prompts and
# mixes them with decodes, 1,024 KV tokens (64 blocks) preempt when the bursts pile up.
ENGINE = dict(block_size=16, max_num_seqs=12, max_num_batched_tokens=256, kv_cache_tokens=1024,
              max_model_len=512, enable_prefix_caching=True)


@dataclass
class Arrival:
    step: int  # the loop turn (an engine step, or an idle turn) before which it is added
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def workload(tokenizer, steps: int, seed: int = 0, max_prompt_len: int = 300,
             gaps: tuple[int, int] = (3, 12)) -> list[Arrival]:
    """Requests arriving in bursts of 1 to 5, every `gaps` turns, deterministic.

    A third are a 48-token system prompt (three full blocks: prefix hits) and a tail, one in six
    repeats an earlier prompt outright, the rest are drawn from 64 prompts of 3 to
    max_prompt_len tokens."""
    rng = random.Random(seed)
    pool = make_prompts(tokenizer, 64, 3, max_prompt_len)
    system = make_prompts(tokenizer, 1, 48, 48)[0]
    arrivals: list[Arrival] = []
    step = 0
    while step < steps:
        for _ in range(rng.choice((1, 1, 2, 3, 5))):  # a burst: the batch size jumps
            kind = rng.random()
            if arrivals and kind < 1 / 6:
                prompt = arrivals[rng.randrange(len(arrivals))].prompt_token_ids
            elif kind < 1 / 2:
                prompt = system + rng.choice(pool)[: rng.randint(3, 2 * max_prompt_len // 3)]
            else:
                prompt = rng.choice(pool)
            arrivals.append(Arrival(step, f"r{len(arrivals)}", list(prompt),
                                    rng.randint(4, 40)))
        step += rng.randint(*gaps)
    return arrivals


@dataclass
class Run:
    tokens: dict[str, list[int]]  # each request's output tokens after the last step
    wall_s: float  # the steps alone (adding requests included, nothing else)
    step_shapes: list[tuple[int, int]]  # (tokens, sequences) of every step
    stats: dict


def run_workload(llm: LLM, arrivals: list[Arrival], steps: int) -> Run:
    """Add each request before its turn and step a fresh engine until it has run `steps`
    steps (a turn with nothing to run is not a step) or has nothing left to do. Requests still
    running at the end keep the tokens they have: every backend stops at the same point."""
    engine = llm.llm_engine
    by_step: dict[int, list[Arrival]] = {}
    for a in arrivals:
        by_step.setdefault(a.step, []).append(a)
    last_arrival = max(by_step)
    tokens: dict[str, list[int]] = {}
    turn = 0
    t0 = time.perf_counter()
    while engine.num_steps < steps and (turn <= last_arrival or engine.has_unfinished_requests()):
        for a in by_step.get(turn, ()):
            engine.add_request(a.request_id, {"prompt_token_ids": a.prompt_token_ids},
                               SamplingParams(max_tokens=a.max_tokens, temperature=0,
                                              ignore_eos=True))
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        turn += 1
    wall = time.perf_counter() - t0
    shapes = [(r.num_prefill_tokens + r.num_decode_tokens, len(r.request_ids))
              for r in engine.step_trace]
    return Run(tokens, wall, shapes, llm.stats())


def compile_counters() -> dict:
    """A snapshot of dynamo's process-wide record: graphs compiled so far, and the recent
    compiles (dynamo keeps the last 64), each with the function and the reason it recompiled."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "compiles": get_compilation_metrics()}


def compiles_since(before: dict) -> dict:
    """What was compiled after `before` (a compile_counters() snapshot): graph count, compiles
    per function, and the reason dynamo gave for each recompile (a first compile has none)."""
    now = compile_counters()
    seen = {id(m) for m in before["compiles"]}
    new = [m for m in now["compiles"] if id(m) not in seen]
    per_function: dict[str, int] = {}
    for m in new:
        per_function[m.co_name] = per_function.get(m.co_name, 0) + 1
    return {"graphs": now["unique_graphs"] - before["unique_graphs"],
            "compiles_per_function": per_function,
            "recompile_reasons": [f"{m.co_name}: {m.recompile_reason}" for m in new
                                  if m.recompile_reason],
            "recompile_limit": torch._dynamo.config.recompile_limit}


def compiled_flex_report(steps: int = 200, repeats: int = 1, model: str | None = None,
                         time_auto: bool = True, progress: bool = True,
                         engine: dict | None = None) -> dict:
    """The workload on `reference` (the tokens to match), then on compiled flex: a first run
    that compiles, and `repeats` runs on fresh engines that must compile nothing; then on
    `auto` after one warm-up run. Each run is a fresh engine, so all see the same steps."""
    if repeats < 1 or steps < 1:
        raise ValueError(f"steps and repeats must be at least 1 (got {steps}, {repeats})")
    tok = load_model(model).tokenizer
    arrivals = workload(tok, steps)
    engine = ENGINE | (engine or {})

    def run(backend: str, **kwargs) -> Run:
        # Cold: both backends must compute the same arrivals (no prefix hit in one only).
        return run_workload(LLM(model, backend=backend, **{"enable_prefix_caching": False,
                                                           **engine, **kwargs}),
                            arrivals, steps)

    def same(a: Run, b: Run) -> str:
        return f"{sum(a.tokens.get(r) == t for r, t in b.tokens.items())}/{len(b.tokens)}"

    report: dict = {}

    def done(key: str, value) -> None:
        report[key] = value
        if progress:
            print(json.dumps({key: value}), flush=True)

    ref = run("reference")
    shapes = ref.step_shapes
    done("workload", {
        "steps": len(shapes), "requests_added": len(ref.tokens), "engine": engine,
        "requests_finished": sum(len(ref.tokens.get(a.request_id, ())) == a.max_tokens
                                 for a in arrivals),
        "tokens_generated": sum(len(t) for t in ref.tokens.values()),
        "distinct_step_tokens": len({t for t, _ in shapes}),
        "step_tokens_range": [min(t for t, _ in shapes), max(t for t, _ in shapes)],
        "batch_size_range": [min(b for _, b in shapes), max(b for _, b in shapes)],
        "prefix_cache_hits": ref.stats["prefix_cache_hits"],
        "num_preemptions": ref.stats["num_preemptions"]})

    before = compile_counters()
    t0 = time.perf_counter()
    first = run("flex", enforce_eager=False)
    compiled = compiles_since(before) | {"first_run_s": round(time.perf_counter() - t0, 1),
                                         "identical_to_reference": same(first, ref)}
    again = compile_counters()
    timed = [run("flex", enforce_eager=False) for _ in range(repeats)]
    compiled["graphs_in_later_runs"] = compiles_since(again)["graphs"]
    compiled["later_runs_identical"] = all(r.tokens == first.tokens for r in timed)
    done("compiled_flex", compiled)
    wall = {"flex_compiled": round(min(r.wall_s for r in timed), 3)}
    if time_auto:
        run("auto")  # warm-up
        autos = [run("auto") for _ in range(repeats)]
        done("auto_identical_to_reference", same(autos[0], ref))
        wall["auto"] = round(min(r.wall_s for r in autos), 3)
        wall["flex_compiled_over_auto"] = round(wall["flex_compiled"] / wall["auto"], 3)
    done("wall_s", wall)
    return report

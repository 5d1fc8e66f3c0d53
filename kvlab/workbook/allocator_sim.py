"""A pure-Python allocator simulation: contiguous reservation against paged blocks, no model.

Defined in notebook 01. It replays the classic experiment: a pool of `total_slots` KV slots and
requests that each grow to a length drawn uniformly from 10-512 tokens, one token per step
(by default a request's prompt is its first token; `prompt_lens` gives longer prompts). It
counts the steps until every request has finished, and records each step's requests running,
requests waiting and the share of the pool holding tokens.

- contiguous: a request is admitted only if an unbroken region of `max_len` slots is free
  (first fit), because its final length is unknown when it starts. It is never preempted.
- paged, `admission="vllm"` (the default), vLLM 0.33.0's scheduler
  (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`, and `KVCacheManager.allocate_slots`
  in `vllm/v1/core/kv_cache_manager.py`): the running requests are scheduled first, in
  admission order; one whose next token needs a block when none is free preempts the newest
  running request (its blocks freed, its computed tokens dropped, back to the front of the
  queue) until the block is there, or preempts itself. Then, in a step that preempted no one,
  waiting requests are admitted first come first served while the blocks for *all the tokens
  they compute this step* can be allocated (a new request: its whole prompt; a preempted one:
  its prompt and every token it had generated), stopping at the first that cannot. An admitted
  request computes those tokens in that one step (no token budget is modelled).
- paged, `admission="one-block"`: a too-eager rule. A waiting request is admitted while one
  block is free, and a preempted request starts over from nothing, growing again one token
  per step. It admits at once what vLLM's rule would hold back, and pays in preemptions.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

ADMISSIONS = ("vllm", "one-block")


@dataclass
class SimResult:
    layout: str
    admission: str = "vllm"
    # One entry per engine step, from step 0 to the step the last request finished.
    running_per_step: list[int] = field(default_factory=list)  # requests that computed tokens
    waiting_per_step: list[int] = field(default_factory=list)  # requests left in the queue
    utilisation_per_step: list[float] = field(default_factory=list)  # tokens held / total slots
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # computed tokens a preemption threw away, computed again later
    num_steps: int = 0  # steps until every request finished

    @property
    def steps(self) -> list[int]:
        """The steps at which requests were waiting (the pool, not arrivals, held them back)."""
        return [s for s, w in enumerate(self.waiting_per_step) if w]

    @property
    def mean_running(self) -> float:
        """Requests running per step, averaged over every step of the run."""
        return statistics.fmean(self.running_per_step) if self.running_per_step else 0.0

    @property
    def mean_running_while_waiting(self) -> float:
        """Requests running per step, averaged over the steps at which others were waiting."""
        queued = [self.running_per_step[s] for s in self.steps]
        return statistics.fmean(queued) if queued else 0.0

    @property
    def max_running(self) -> int:
        return max(self.running_per_step, default=0)

    @property
    def mean_utilisation(self) -> float:
        """The pool's share holding tokens, averaged over every step of the run."""
        return statistics.fmean(self.utilisation_per_step) if self.utilisation_per_step else 0.0


def request_lengths(num_requests: int = 100, low: int = 10, high: int = 512, seed: int = 0):
    """Final lengths, uniform in [low, high], reproducible from the seed."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num_requests)]


def _checked_prompts(lengths, layout, max_len, prompt_lens, admission) -> list[int]:
    """The prompts' lengths (one token each by default), after refusing arguments that make no
    simulation: before any state is built."""
    if layout not in ("contiguous", "paged"):
        raise ValueError(f"layout must be 'contiguous' or 'paged', got {layout!r}")
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
    if max(lengths) > max_len:
        raise ValueError(f"a length exceeds max_len={max_len}")
    prompts = [1] * len(lengths) if prompt_lens is None else list(prompt_lens)
    if len(prompts) != len(lengths) or any(not 1 <= p <= n for p, n in zip(prompts, lengths)):
        raise ValueError("each request needs a prompt of 1 to its length tokens")
    if admission == "one-block" and (layout != "paged" or prompt_lens is not None):
        raise ValueError("the one-block rule is a paged rule, for one-token prompts")
    return prompts


def simulate(
    lengths: list[int],
    layout: str,
    total_slots: int = 10_000,
    max_len: int = 512,
    block_size: int = 16,
    prompt_lens: list[int] | None = None,
    admission: str = "vllm",
) -> SimResult:
    """Run every request to its length (tokens held at its end) and record each step.

    `prompt_lens` (default: one token each) are computed in the request's first step; every
    later step computes one token. `admission` picks the paged rule (module docstring); the
    contiguous layout has one rule.
    """
    prompts = _checked_prompts(lengths, layout, max_len, prompt_lens, admission)
    if admission == "one-block":
        return _simulate_one_block(lengths, total_slots, block_size)
    result = SimResult(layout, admission)
    free_blocks = total_slots // block_size  # paged memory, in blocks
    free_slots = [True] * total_slots  # contiguous memory: which slots are free (for first fit)
    region_start: dict[int, int] = {}
    waiting = list(range(len(lengths)))  # request indices, arrival order
    running: list[int] = []  # admission order
    num_tokens = list(prompts)  # the request's tokens so far: its prompt, then what it generated
    computed = [0] * len(lengths)  # tokens whose K/V is in the pool
    held_blocks = [0] * len(lengths)

    def blocks_missing(r: int, upto: int) -> int:
        return -(-upto // block_size) - held_blocks[r]

    def first_fit(n: int) -> int | None:
        run = 0
        for i, free in enumerate(free_slots):
            run = run + 1 if free else 0
            if run == n:
                return i - n + 1
        return None

    while waiting or running:
        scheduled: list[int] = []
        preempted = False
        # 1. The running requests first, oldest first: each needs room for its next token.
        for r in list(running):
            if r not in running:
                continue  # preempted earlier in this step
            if layout == "paged":
                while blocks_missing(r, num_tokens[r]) > free_blocks:
                    victim = running.pop()  # the newest request gives way
                    result.num_preemptions += 1
                    result.num_recomputed_tokens += computed[victim]
                    free_blocks += held_blocks[victim]
                    held_blocks[victim], computed[victim] = 0, 0  # it keeps its tokens
                    waiting.insert(0, victim)
                    preempted = True
                    if victim == r:
                        break
                if r not in running:
                    continue
                k = blocks_missing(r, num_tokens[r])
                free_blocks -= k
                held_blocks[r] += k
            scheduled.append(r)
        # 2. Then the queue, first come first served, in a step that preempted no one.
        while waiting and not preempted:
            r = waiting[0]
            if layout == "contiguous":
                start = first_fit(max_len)
                if start is None:
                    break
                free_slots[start : start + max_len] = [False] * max_len
                region_start[r] = start
            else:
                k = blocks_missing(r, num_tokens[r])  # every token it computes this step
                if k > free_blocks:
                    break
                free_blocks -= k
                held_blocks[r] += k
            running.append(waiting.pop(0))
            scheduled.append(r)
        # 3. The step computes what it scheduled; each request then has one token more.
        for r in scheduled:
            computed[r] = num_tokens[r]
            num_tokens[r] = min(num_tokens[r] + 1, lengths[r])
        _record(result, len(scheduled), len(waiting), sum(computed[r] for r in running), total_slots)
        # Finished requests free their memory at once.
        for r in [r for r in running if computed[r] >= lengths[r]]:
            running.remove(r)
            if layout == "contiguous":
                s = region_start.pop(r)
                free_slots[s : s + max_len] = [True] * max_len
            else:
                free_blocks += held_blocks[r]
                held_blocks[r] = 0
        result.num_steps += 1
    return result


def _record(result: SimResult, running: int, waiting: int, tokens: int, total_slots: int) -> None:
    result.running_per_step.append(running)
    result.waiting_per_step.append(waiting)
    result.utilisation_per_step.append(tokens / total_slots)


def _simulate_one_block(lengths: list[int], total_slots: int, block_size: int) -> SimResult:
    """The too-eager paged rule: admit while one block is free; a preempted request starts over
    from nothing, growing again one token per step."""
    result = SimResult("paged", "one-block")
    free_blocks = total_slots // block_size
    waiting = list(range(len(lengths)))
    running: list[int] = []
    tokens = [0] * len(lengths)
    held_blocks = [0] * len(lengths)
    while waiting or running:
        while waiting and free_blocks >= 1:  # one free block is enough to start
            running.append(waiting.pop(0))
        for r in list(running):
            if r not in running:
                continue  # preempted earlier in this step
            if tokens[r] % block_size == 0:
                while free_blocks < 1:
                    victim = running.pop()  # the newest request gives way
                    result.num_preemptions += 1
                    result.num_recomputed_tokens += tokens[victim]
                    free_blocks += held_blocks[victim]
                    held_blocks[victim], tokens[victim] = 0, 0
                    waiting.insert(0, victim)
                    if victim == r:
                        break
                if r not in running:
                    continue
                free_blocks -= 1
                held_blocks[r] += 1
            tokens[r] += 1
        _record(result, len(running), len(waiting), sum(tokens[r] for r in running), total_slots)
        for r in [r for r in running if tokens[r] >= lengths[r]]:
            running.remove(r)
            free_blocks += held_blocks[r]
            held_blocks[r] = 0
        result.num_steps += 1
    return result


def internal_waste(lengths: list[int], block_size: int) -> float:
    """Mean slots allocated but unused in each request's last block (paged, at full length)."""
    return statistics.fmean((-length) % block_size for length in lengths)


def block_table_entries(lengths: list[int], block_size: int) -> float:
    """Mean block-table length per request: what small blocks cost in bookkeeping and lookups."""
    return statistics.fmean(-(-length // block_size) for length in lengths)


def waste_breakdown(
    held_slots: dict[str, int],
    tokens_now: dict[str, int],
    final_tokens: dict[str, int],
    free_slots: int,
    usable_free_slots: int,
) -> dict[str, int]:
    """Split a pool snapshot into the paper's three wastes (in slots).

    - reservation: held for tokens the request will still produce;
    - internal fragmentation: held but never to be used (the request ends first);
    - external fragmentation: free, but in gaps too small for anyone to use.
    """
    used = sum(tokens_now.values())
    reservation = sum(min(held_slots[r], final_tokens[r]) - tokens_now[r] for r in held_slots)
    internal = sum(max(0, held_slots[r] - final_tokens[r]) for r in held_slots)
    return {
        "tokens": used,
        "reservation": reservation,
        "internal": internal,
        "external": free_slots - usable_free_slots,
        "free (usable)": usable_free_slots,
    }

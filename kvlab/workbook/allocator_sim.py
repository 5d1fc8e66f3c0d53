"""A pure-Python allocator simulation: contiguous reservation against paged blocks, no model.

Defined in notebook 01. It replays the classic experiment: a pool of `total_slots` KV slots,
requests that each grow to a length drawn uniformly from 10-512 tokens, one token per step.

- contiguous: a request is admitted only if an unbroken region of `max_len` slots is free
  (first fit), because its final length is unknown when it starts.
- paged: a request is admitted if one free block exists; it takes another block each time its
  tokens cross a block boundary. If none is free, the newest running request is preempted (its
  blocks freed, back to the front of the queue), as vLLM does.

It reports how many requests run at once and how much of the pool holds real tokens.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field


@dataclass
class SimResult:
    layout: str
    running_per_step: list[int] = field(default_factory=list)
    utilisation_per_step: list[float] = field(default_factory=list)  # tokens held / total slots
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens a preempted request had, computed again later
    num_steps: int = 0  # steps until every request finished
    steps: list[int] = field(default_factory=list)  # the step of each recorded entry above

    @property
    def mean_running(self) -> float:
        return statistics.fmean(self.running_per_step) if self.running_per_step else 0.0

    @property
    def max_running(self) -> int:
        return max(self.running_per_step, default=0)

    @property
    def mean_utilisation(self) -> float:
        return statistics.fmean(self.utilisation_per_step) if self.utilisation_per_step else 0.0


def request_lengths(num_requests: int = 100, low: int = 10, high: int = 512, seed: int = 0):
    """Final lengths, uniform in [low, high], reproducible from the seed."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num_requests)]


def simulate(
    lengths: list[int],
    layout: str,
    total_slots: int = 10_000,
    max_len: int = 512,
    block_size: int = 16,
) -> SimResult:
    """Run every request to its length; record concurrency while requests are still waiting.

    Only steps with a non-empty queue are recorded: that is the steady state where memory, not
    the supply of requests, limits how many run at once.
    """
    if layout not in ("contiguous", "paged"):
        raise ValueError(f"layout must be 'contiguous' or 'paged', got {layout!r}")
    if max(lengths) > max_len:
        raise ValueError(f"a length exceeds max_len={max_len}")
    num_blocks = total_slots // block_size
    # Contiguous regions are counted in slots; paged memory in blocks.
    free_slots = [True] * total_slots  # contiguous: which slots are free (for first fit)
    free_blocks = num_blocks
    waiting = list(range(len(lengths)))  # request indices, arrival order
    running: list[int] = []  # admission order
    tokens = [0] * len(lengths)  # tokens held so far
    held_blocks = [0] * len(lengths)
    region_start: dict[int, int] = {}
    result = SimResult(layout)

    def first_fit(n: int) -> int | None:
        run = 0
        for i, free in enumerate(free_slots):
            run = run + 1 if free else 0
            if run == n:
                return i - n + 1
        return None

    while waiting or running:
        # Admit in arrival order while memory allows.
        while waiting:
            r = waiting[0]
            if layout == "contiguous":
                start = first_fit(max_len)
                if start is None:
                    break
                free_slots[start : start + max_len] = [False] * max_len
                region_start[r] = start
            else:
                if free_blocks < 1:
                    break
            running.append(waiting.pop(0))
        # Every running request produces one token; paged takes a block at each boundary.
        for r in list(running):
            if r not in running:
                continue  # preempted earlier in this step
            if layout == "paged" and tokens[r] % block_size == 0:
                while free_blocks < 1:
                    victim = running.pop()  # the newest request gives way
                    result.num_recomputed_tokens += tokens[victim]
                    free_blocks += held_blocks[victim]
                    held_blocks[victim], tokens[victim] = 0, 0
                    waiting.insert(0, victim)
                    result.num_preemptions += 1
                    if victim == r:
                        break
                if r not in running:
                    continue
                free_blocks -= 1
                held_blocks[r] += 1
            tokens[r] += 1
        if waiting:
            result.steps.append(result.num_steps)
            result.running_per_step.append(len(running))
            result.utilisation_per_step.append(sum(tokens[r] for r in running) / total_slots)
        # Finished requests free their memory at once.
        for r in [r for r in running if tokens[r] >= lengths[r]]:
            running.remove(r)
            if layout == "contiguous":
                s = region_start.pop(r)
                free_slots[s : s + max_len] = [True] * max_len
            else:
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

"""Which requests run in the next step, and how many tokens each.

Defined in notebook 00 in its plainest form; notebooks 03-04 are about it. One rule covers
prefill and decode (vLLM v1): a request is given `num_tokens - num_computed_tokens` new tokens,
capped by what is left of the step's token budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlab.config import EngineConfig
from kvlab.kv_cache import KVCacheManager
from kvlab.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()  # arrival order; preempted requests go in front
        self.running: list[Request] = []  # admission order: the newest is preempted first
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_new = request.num_tokens - num_computed
        if self.config.enable_chunked_prefill:
            return min(num_new, budget)  # a long prompt takes what is left, the rest next step
        return num_new if num_new <= budget else 0  # whole prompt in one step, or not now

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Static batching admits only into an empty engine: the batch runs until its last request
        # ends. Decided before this step's work, so a batch cannot grow while it runs.
        admit = self.config.scheduling == "continuous" or not self.running

        # Running requests first: they already hold KV, and a decode token is the cheapest
        # progress there is. Oldest first, so under memory pressure the newest gives way.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            # Out of blocks: preempt the newest running request (recompute: its K/V is dropped
            # and rebuilt when it runs again) until this one fits, or it is the one preempted.
            while not self.kv_cache_manager.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new,
                request.num_computed_tokens,
            ):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # Then waiting requests, in arrival order, while seats, budget and blocks allow.
        while admit and not out.preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            # Prefix cache (chapter 05): blocks some earlier request already computed.
            hits, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_computed = request.num_computed_tokens + num_hit
            num_new = self._num_new_tokens(request, budget, num_computed)
            if num_new == 0:
                break
            if len(self.running) + 1 + len(request.fork_children) > self.config.max_num_seqs:
                break  # its samples will need seats too once its prompt is done
            if not self.kv_cache_manager.allocate_slots(
                request.request_id, num_computed + num_new, num_computed, hits
            ):
                break  # first come, first served: nobody overtakes the head of the queue
            if self.config.enable_prefix_caching and request.num_computed_tokens == 0:
                self.kv_cache_manager.prefix_cache_queries += request.num_tokens
                self.kv_cache_manager.prefix_cache_hits += num_hit
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_computed
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0  # recompute prompt + generated tokens later
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish_request(self, request: Request, reason: str) -> None:
        """Remove a finished or aborted request and give its blocks back at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

"""Which requests run in the next step, how many tokens each, and what their results change.

Defined in notebook 00 in its plainest form; notebooks 03-04 are about it. One rule covers
prefill and decode (vLLM v1): a request is given `num_tokens - num_computed_tokens` new tokens,
capped by what is left of the step's token budget.

The scheduler owns the queues, as vLLM's `vllm/v1/core/sched/scheduler.py` does:
`schedule()` decides the step and returns a `SchedulerOutput`; after the model ran,
`update_from_output()` appends the sampled tokens, checks stops, frees what finished and
reports which requests changed. Nothing else edits `waiting` or `running`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvlab.config import EngineConfig
from kvlab.kv_cache import KVCacheManager
from kvlab.outputs import ModelRunnerOutput
from kvlab.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    # n > 1 (chapter 02): samples forked this step from a request whose prompt this step
    # completes. They start with the parent's blocks and draw their first token from its logits.
    forked: dict[str, list[Request]] = field(default_factory=dict)  # parent id -> samples
    preempted: list[Request] = field(default_factory=list)
    # Whole-block K/V copies to make before the forward, in this order: fork copies from earlier
    # steps (their source K/V is complete now), then this step's copy-on-write copies.
    fork_copies: list[tuple[int, int]] = field(default_factory=list)
    cow_copies: list[tuple[int, int]] = field(default_factory=list)

    # Filled in when the step is decided, before the requests advance.
    num_decode_tokens: int = 0  # one per request that was generating
    total_num_scheduled_tokens: int = 0  # prefill (prompt, chunk or recompute) + decode


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

    # ---- seats ---------------------------------------------------------------------------
    def _seats_in_use(self) -> tuple[int, set[int]]:
        """Seats held by running requests, and the groups that hold theirs. A group (the samples
        of one n > 1 request, or one beam search's beams) holds all its seats while any member
        runs, so the members that start later can never push `running` past max_num_seqs."""
        seats, groups = 0, set()
        for r in self.running:
            if r.group is None:
                seats += 1
            elif id(r.group) not in groups:
                groups.add(id(r.group))
                seats += r.group.num_seats
        return seats, groups

    def _seat_cost(self, request: Request, running_groups: set[int]) -> int:
        if request.group is None:
            return 1
        return 0 if id(request.group) in running_groups else request.group.num_seats

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_new = request.num_tokens - num_computed
        if self.config.enable_chunked_prefill:
            return min(num_new, budget)  # a long prompt takes what is left, the rest next step
        return num_new if num_new <= budget else 0  # whole prompt in one step, or not now

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(fork_copies=self.kv_cache_manager.take_fork_copies())
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
            # Nothing to compute: a beam waiting for its siblings' results, or a sample forked
            # in this very loop (it draws its first token from its parent's logits).
            if num_new == 0:
                i += 1
                continue
            # Out of blocks: preempt the newest running request (recompute: its K/V is dropped
            # and rebuilt when it runs again) until this one fits, or it is the one preempted.
            while not self.kv_cache_manager.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new,
                request.num_computed_tokens, request=request,
            ):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                self._fork_if_prompt_done(request, num_new, out)
                i += 1

        # Then waiting requests, in arrival order, while seats, budget and blocks allow.
        seats, running_groups = self._seats_in_use()
        while admit and not out.preempted and self.waiting and budget > 0:
            request = self.waiting[0]
            cost = self._seat_cost(request, running_groups)
            if seats + cost > self.config.max_num_seqs:
                break
            # Prefix cache (chapter 05): blocks some earlier request already computed, this
            # step's earlier admissions included (they were keyed when their blocks were taken).
            hits, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_computed = request.num_computed_tokens + num_hit
            num_new = self._num_new_tokens(request, budget, num_computed)
            if num_new == 0:
                break
            if not self.kv_cache_manager.allocate_slots(
                request.request_id, num_computed + num_new, num_computed, hits, request=request
            ):
                break  # first come, first served: nobody overtakes the head of the queue
            if request.num_computed_tokens == 0:
                self.kv_cache_manager.record_prefix_cache_stats(request, num_hit)
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_computed
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seats += cost
            if request.group is not None:
                running_groups.add(id(request.group))
            out.scheduled.append((request, num_new))
            budget -= num_new
            self._fork_if_prompt_done(request, num_new, out)

        self._make_room_for_waiting_beams(out)
        out.cow_copies = self.kv_cache_manager.take_pending_copies()
        out.total_num_scheduled_tokens = sum(n for _, n in out.scheduled)
        out.num_decode_tokens = sum(1 for r, _ in out.scheduled
                                    if r.num_computed_tokens >= r.num_prompt_tokens)
        return out

    def _fork_if_prompt_done(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """n > 1 in the PagedAttention paper's way: once sample 0's prompt is computed (this
        step), the other samples fork from it, sharing every block. Their seats were held by the
        group since sample 0 started. A fork that cannot get its memory (the contiguous
        layout, or the no-sharing baseline, when full) waits and computes its prompt itself."""
        if not request.fork_children or request.num_computed_tokens + num_new < request.num_tokens:
            return
        children, request.fork_children = request.fork_children, []
        started = []
        for child in children:
            if self.kv_cache_manager.fork(request.request_id, child.request_id):
                child.num_computed_tokens = request.num_computed_tokens + num_new
                child.status = RequestStatus.RUNNING
                child.metrics.first_scheduled_time = time.perf_counter()
                self.running.append(child)
                started.append(child)
            else:
                self.waiting.appendleft(child)
        if started:
            out.forked[request.request_id] = started

    def _preempt(self, request: Request, out: SchedulerOutput, front: bool = True) -> None:
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0  # recompute prompt + generated tokens later
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        out.preempted.append(request)
        # A sample forked earlier in this step no longer takes its token from its parent.
        for parent_id, children in list(out.forked.items()):
            if request in children:
                children.remove(request)
                if not children:
                    del out.forked[parent_id]

    def _make_room_for_waiting_beams(self, out: SchedulerOutput) -> None:
        """A beam that has reported its logprobs sits idle, holding blocks, until its siblings
        report. If the beam they wait for cannot get blocks, nothing runs. So when a step
        schedules nothing, the newest idle beam gives its blocks back (preempted to the end of
        the queue: its report stands, it recomputes when it next runs). Any request fits an
        empty pool, so this always ends; only if no idle beam is left to preempt are the beam
        searches failed."""
        if out.scheduled or not self.waiting:
            return
        idle = [r for r in self.running
                if r.beam_group is not None and r.request_id in r.beam_group.reported]
        if idle:
            self.running.remove(idle[-1])
            self._preempt(idle[-1], out, front=False)
            return
        for request in list(self.running) + list(self.waiting):
            group = request.beam_group
            if group is not None and group.error is None:
                group.error = ("beam search ran out of KV blocks: lower beam_width or "
                               "max_tokens, or raise kv_cache_tokens (every block has been "
                               "returned)")
                for beam in group.live_beams():
                    self.finish_request(beam, "abort")

    def update_from_output(self, sched: SchedulerOutput,
                           output: ModelRunnerOutput) -> list[Request]:
        """Advance every scheduled request by its computed tokens, append sampled tokens, check
        stops, and free what finished. Returns the requests that received a token."""
        now = time.perf_counter()
        for request, num_new in sched.scheduled:
            request.num_computed_tokens += num_new
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        touched: list[Request] = []
        beam_groups = {}
        for request, _ in sched.scheduled:
            for r in [request, *sched.forked.get(request.request_id, [])]:
                if r.request_id not in output.sampled_token_ids or r.is_finished:
                    continue
                if r.beam_group is not None:
                    r.beam_group.add_logprobs(r, output.logprobs[r.request_id])
                    beam_groups[id(r.beam_group)] = r.beam_group
                    continue
                r.append_output_token(output.sampled_token_ids[r.request_id], now)
                if r.request_id in output.logprobs:
                    r.output_logprobs.append(output.logprobs[r.request_id])
                reason = r.check_stop(self.config.max_model_len)
                if reason is not None:
                    self.finish_request(r, reason)
                    r.metrics.finished_time = now
                touched.append(r)
        for group in beam_groups.values():
            if group.ready():
                self._advance_beams(group)
        return touched

    def _advance_beams(self, group) -> None:
        """Apply one beam-search selection: pruned beams free their blocks, a beam continued
        several ways forks (sharing its blocks, copy-on-write later), survivors get their token."""
        step = group.advance()
        for beam in step.drop:
            self.finish_request(beam, "abort")
        for parent, child in step.forks:
            if parent.status == RequestStatus.RUNNING and self.kv_cache_manager.fork(
                    parent.request_id, child.request_id):
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            else:  # the parent was preempted, or no room to copy: compute it from scratch
                self.waiting.appendleft(child)
        for beam, token in step.extend:
            beam.output_token_ids.append(token)

    def finish_request(self, request: Request, reason: str,
                       stop_reason: int | str | None = None) -> None:
        """Remove a finished or aborted request and give its blocks back at once."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if stop_reason is not None:
            request.stop_reason = stop_reason
        # Samples never forked (their parent ended first) end with it.
        for child in request.fork_children:
            child.status = RequestStatus.FINISHED
            child.finish_reason = reason
        request.fork_children = []

"""Which requests run in the next step, how many tokens each, and what their results change.

Notebooks 03-04 are about it. One rule covers prefill and decode (vLLM v1): a request is given
`num_tokens - num_computed_tokens` new tokens, capped by what is left of the step's token
budget.

The scheduler owns the queues, as vLLM's `vllm/v1/core/sched/scheduler.py` does:
`schedule()` decides the step and returns a `SchedulerOutput`, which carries everything the
model runner needs (token counts and block tables); after the model ran,
`update_from_output()` appends the sampled tokens, checks stops, frees what finished and
reports which requests changed. Nothing else edits `waiting` or `running`.

The waiting queue keeps the order of vLLM's scheduling policy (`EngineConfig.policy`,
`kvlab/request_queue.py`): arrival order ("fcfs", the default) or request priority
("priority"). The policy also picks who is preempted when a running request needs a block and
none is free: the newest running request under "fcfs", the one with the highest (priority,
arrival time) under "priority" (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`).

`EngineConfig.long_prefill_token_threshold` (vLLM 0.33.0's knob, `vllm/config/scheduler.py`;
off by default) caps what one request is given per step, so that a request arriving during a
long chunked prefill does not wait for the whole prompt: the cap is decided once per step
(`_long_prefill_cap_for_step`) and applied where a request's new tokens are counted, for running
and waiting requests alike, as `Scheduler.schedule` in `vllm/v1/core/sched/scheduler.py` does.

This file is the scheduler vLLM has. Chapter 02's machinery (n samples forked from one prompt,
beam search's beams) lives beside it in `group_scheduler.py`, through the hooks marked below:
vLLM's scheduler sees neither (vLLM fans n > 1 out into independent requests in
`vllm/v1/engine/parallel_sampling.py` and runs beam search above the engine).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvlab.config import EngineConfig
from kvlab.kv_cache import KVCacheManager
from kvlab.outputs import ModelRunnerOutput
from kvlab.request import Request, RequestStatus
from kvlab.request_queue import SchedulingPolicy, create_request_queue


@dataclass
class NewRequestData:
    """A request admitted this step (vLLM: NewRequestData in vllm/v1/core/sched/output.py)."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int  # at admission: the prefix-cache hit (0 without one)


@dataclass
class SchedulerOutput:
    """One step's decision (vLLM: `vllm/v1/core/sched/output.py`)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    # Whole-block K/V copies to make before the forward, in this order: fork copies from earlier
    # steps (their source K/V is complete now), then this step's copy-on-write copies.
    fork_copies: list[tuple[int, int]] = field(default_factory=list)
    cow_copies: list[tuple[int, int]] = field(default_factory=list)
    # Chapter 02 (group_scheduler.py): samples forked this step from a request whose prompt
    # this step completes; they draw their first token from its logits.
    forked: dict[str, list[Request]] = field(default_factory=dict)  # parent id -> samples

    # Filled in when the step is decided, before the requests advance.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # vLLM's name
    # Admitted this step: first admissions, and re-admissions after a preemption, whose ids are
    # also in resumed_req_ids. vLLM 0.33.0's default Model Runner V2 lists resumed requests in
    # scheduled_new_reqs too (its resumed_req_ids then stays empty); the V1 runner lists them
    # among scheduled_cached_reqs, in CachedRequestData.resumed_req_ids.
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    # Each scheduled request's whole block table. vLLM sends a new request's table
    # (NewRequestData.block_ids) and then only the blocks appended to it
    # (CachedRequestData.new_block_ids), its runner keeping the tables; kvlab sends whole
    # tables, since copy-on-write can replace a block in the middle of one.
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Each scheduled request's num_computed_tokens when the step was decided: where its new
    # tokens start (vLLM: NewRequestData / CachedRequestData.num_computed_tokens). The request's
    # own count is advanced at the end of schedule(), before the model runs, as vLLM's is.
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    num_decode_tokens: int = 0  # one per request that was generating
    total_num_scheduled_tokens: int = 0  # prefill (prompt, chunk or recompute) + decode
    # The KV connector's loads and stores for this step (chapter 10; vLLM's
    # SchedulerOutput.kv_connector_metadata); None without a connector.
    kv_connector_metadata: object | None = None

    @property
    def has_work(self) -> bool:
        """Something for the model runner: tokens to compute, or a connector's loads and
        stores (a step may only load, while every request waits for its K/V)."""
        return bool(self.scheduled or self.kv_connector_metadata)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.policy = SchedulingPolicy(config.policy)
        # In the policy's order, head first. Under "fcfs" a deque (FCFSRequestQueue): arrival
        # order, preempted requests in front.
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []  # admission order: under "fcfs" the newest goes first
        self.num_preemptions = 0
        self._long_prefill_cap = 0  # this step's long_prefill_token_threshold; 0: no cap
        # Chapter 10: the KV connector's scheduler side (kvlab/kv_transfer/), set by the engine
        # when it runs one. Requests whose load the worker reported done, or failed.
        self.connector = None
        self.kv_load_failure_policy = "fail"
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        # vLLM's connector PrefixCacheStats (vllm/v1/core/sched/scheduler.py): per admission
        # that asked the connector, the prompt tokens past the pool's hit (queries) and those
        # the connector supplied (hits); re-admissions after a preemption apart.
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.external_prefix_cache_preempted_queries = 0
        self.external_prefix_cache_preempted_hits = 0
        self.num_kv_load_failures = 0

    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        if num_computed is None:
            num_computed = request.num_computed_tokens
        # A token a step in flight will sample counts as a token to compute (async scheduling):
        # the model runner feeds it in from that step's output.
        num_new = request.num_tokens + request.num_output_placeholders - num_computed
        # The long-prefill cap comes first, before the budget and before the no-chunking rule,
        # as in vLLM: so with enable_chunked_prefill=False a capped prompt is still cut.
        if 0 < self._long_prefill_cap < num_new:
            num_new = self._long_prefill_cap
        # vLLM's loop over running requests never asks whether chunking is on. Without the cap
        # a running request then has at most one token to compute, so the rules agree; with
        # it, a prompt the cap cut goes on in chunks.
        if self.config.enable_chunked_prefill or request.status == RequestStatus.RUNNING:
            return min(num_new, budget)  # a long prompt takes what is left, the rest next step
        return num_new if num_new <= budget else 0  # whole prompt in one step, or not now

    def _long_prefill_cap_for_step(self) -> int:
        """The most tokens one request may be given this step (0: no cap), from the queues as
        they are before anything is scheduled (vLLM: `Scheduler.schedule` in
        vllm/v1/core/sched/scheduler.py, before its loop over running requests).

        long_prefill_token_threshold, but only while more than one request is running or
        waiting: a request alone has nobody to hold back. With the adaptive switch it is
        raised to max_num_batched_tokens // (running + waiting) when that is larger, so a cap
        set for a crowded engine does not cut prefills short in an emptier one. Samples of a
        "fork" group that have not forked yet are in neither queue and do not count (vLLM's
        n > 1 requests are all queued; they need no prefill of their own here)."""
        threshold = self.config.long_prefill_token_threshold
        num_eligible = len(self.running) + len(self.waiting)
        if threshold == 0 or num_eligible <= 1:
            return 0
        if self.config.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, self.config.max_num_batched_tokens // num_eligible)
        return threshold

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        out = SchedulerOutput(fork_copies=kv.take_fork_copies())
        budget = self.config.max_num_batched_tokens
        # Static batching admits only into an empty engine: the batch runs until its last request
        # ends. Decided before this step's work, so a batch cannot grow while it runs.
        admit = self.config.scheduling == "continuous" or not self.running
        self._long_prefill_cap = self._long_prefill_cap_for_step()
        budget = self._schedule_running(out, budget)
        # Admissions only in a step that preempted nobody: a request just preempted for lack of
        # blocks would otherwise see a newcomer take them (vLLM: `if not preempted_reqs`).
        if admit and not out.preempted:
            self._schedule_waiting(out, budget)
        self._before_finish(out)
        self.finish_output(out)
        if self.connector is not None:  # once per step, after the step is decided (vLLM)
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._update_after_schedule(out)
        # vLLM asserts these where it decides the step (end of Scheduler.schedule).
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens, (
            f"scheduled {out.total_num_scheduled_tokens} tokens over a budget of "
            f"{self.config.max_num_batched_tokens}")
        assert len(self.running) <= self.config.max_num_seqs, (
            f"{len(self.running)} running over max_num_seqs={self.config.max_num_seqs}")
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first: they already hold KV, and a decode token is the cheapest
        progress there is. In admission order; when one needs blocks and none are free, running
        requests are preempted (recompute: their K/V is dropped and rebuilt when they run again)
        until it fits, or it is itself the one preempted. Returns the budget left."""
        kv = self.kv_cache_manager
        considered: set[int] = set()  # ids of the running requests already looked at
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            considered.add(id(request))
            if self._reaches_max_tokens_in_flight(request):
                i += 1
                continue
            num_new = self._num_new_tokens(request, budget)
            # No position at or past max_model_len: with a step in flight, a request about to
            # end by length would otherwise be given one more (vLLM caps it the same way).
            num_new = min(num_new, self.config.max_model_len - 1 - request.num_computed_tokens)
            if num_new <= 0:  # chapter 02's forked samples and idle beams; a request at its end
                i += 1
                continue
            num_preempted = len(out.preempted)
            while not kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new,
                                        request.num_computed_tokens, request=request):
                victim = self._pop_victim()
                budget += self._unschedule(victim, out)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                self._on_scheduled(request, num_new, out)
            if len(out.preempted) == num_preempted:
                i += 1
                continue
            if request.status == RequestStatus.PREEMPTED and self.policy is SchedulingPolicy.FCFS:
                break  # it was the newest: nobody after it is left to run
            # Under "priority" the requests after one that preempted itself rank above it and
            # may still fit (vLLM continues). Victims may have stood before this request: the
            # next to look at is the first running request not looked at yet.
            i = sum(1 for r in self.running if id(r) in considered)
        return budget

    @staticmethod
    def _reaches_max_tokens_in_flight(request: Request) -> bool:
        """Async scheduling: the step in flight samples the request's last token (max_tokens),
        so no further step is needed and none is scheduled (vLLM's check at the top of its loop
        over running requests). A request that will stop on EOS or a stop token cannot be known
        in advance: it gets one more step, whose slot is freed when the stop is seen."""
        if request.num_output_placeholders == 0:
            return False
        known_after_flight = request.num_computed_tokens + 1 - request.num_output_placeholders
        return (known_after_flight + 1
                >= request.num_prompt_tokens + request.sampling_params.max_tokens)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by its new tokens now, before the model runs (vLLM:
        Scheduler._update_after_schedule), so the next step can be scheduled before this one's
        result is read. Under async scheduling a step that completes a request's sequence also
        adds an output placeholder: the token it will sample (vLLM's AsyncScheduler)."""
        now = time.perf_counter()
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            request.num_in_flight_tokens += num_new
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            samples = request.num_computed_tokens >= (request.num_tokens
                                                      + request.num_output_placeholders)
            if samples and self.config.async_scheduling:
                request.num_output_placeholders += 1

    def can_run_ahead(self) -> bool:
        """Whether the engine may schedule the next step before this one's tokens are read.
        Always, here; chapter 02's groups (group_scheduler.py) need each token first."""
        return True

    def _pop_victim(self) -> Request:
        """Take the request to preempt out of `running`, as vLLM's scheduler chooses it: under
        "priority" the lowest-priority one (the highest (priority, arrival time); the first such
        in admission order on a tie), which may have been scheduled earlier in this step; under
        "fcfs" the newest, which never was."""
        if self.policy is SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.metrics.arrival_time))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _unschedule(self, victim: Request, out: SchedulerOutput) -> int:
        """Take back what this step gave a request that is now preempted (only under
        "priority" can a victim have been scheduled already). Its freshly keyed blocks will
        hold no K/V, so their keys go too. Returns the tokens given back to the budget."""
        given = [n for r, n in out.scheduled if r is victim]
        if not given:
            return 0
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not victim]
        self.kv_cache_manager.uncache_unwritten_blocks(victim)
        self._on_unscheduled(victim, out)
        return given[0]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Then waiting requests, in the queue's order, while seats, budget and blocks allow."""
        kv = self.kv_cache_manager
        seats = self._num_seats_in_use()
        skipped: deque[Request] = deque()
        while self.waiting and budget > 0:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self._update_waiting_for_remote_kv(request):
                    skipped.appendleft(self.waiting.pop_request())  # its load is not done
                    continue
            if request.num_stale_output_tokens > 0 and not request.drop_stale_output:
                # Its step in flight still delivers a token: resuming it first would sample
                # that position again (vLLM skips it, ahead of the queue, until it drains).
                skipped.appendleft(self.waiting.pop_request())
                continue
            cost = self._seat_cost(request)
            if seats + cost > self.config.max_num_seqs:
                break
            # Prefix cache (chapter 05): blocks some earlier request already computed, this
            # step's earlier admissions included (they were keyed when their blocks were taken).
            hits, num_hit = [], 0
            # A request asking for prompt logprobs computes its whole prompt (vLLM's
            # skip_reading_prefix_cache, vllm/v1/core/kv_cache_manager.py
            # prefix_cache_lookup_enabled): no lookup, and it is not counted as a query.
            lookup = (request.num_computed_tokens == 0
                      and not request.sampling_params.skip_reading_prefix_cache)
            if lookup:
                hits, num_hit = kv.get_computed_blocks(request)
            # Chapter 10: after the pool's hit, the KV connector's (a second tier, or another
            # engine's prefill): tokens it can load past that hit, into blocks allocated now.
            num_external = 0
            if lookup and self.connector is not None:
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    request, num_hit)
                if num_external is None:  # the connector cannot tell yet: ask next step
                    skipped.appendleft(self.waiting.pop_request())
                    continue
            num_computed = request.num_computed_tokens + num_hit + num_external
            # kvlab runs every external load asynchronously (vLLM's offloading and NIXL
            # connectors do): this step computes nothing for the request, and it waits in
            # WAITING_FOR_REMOTE_KVS until the load is done.
            num_new = 0 if num_external else self._num_new_tokens(request, budget, num_computed)
            if num_new == 0 and not num_external:
                break
            # scheduler_reserve_full_isl: the whole prompt must fit now, not only this chunk.
            # (delay_cache_blocks is passed only with a connector's load: a manager class of
            # an earlier chapter's exercise need not know it.)
            delay = {"delay_cache_blocks": True} if num_external else {}
            if self.connector is not None:
                # Blocks the other requests waiting for a load still need to start: nobody
                # else may take them, or two loads could each hold what the other waits for
                # (vLLM: _inflight_prefill_reserved_blocks).
                kv.reserved_blocks = self._blocks_reserved_for_loads(
                    request, [*self.waiting, *skipped])
            admitted = kv.allocate_slots(
                request.request_id, num_computed + num_new, num_computed, hits, request=request,
                full_sequence_must_fit=self.config.scheduler_reserve_full_isl,
                has_scheduled_reqs=bool(self.running), **delay)
            if self.connector is not None:
                kv.reserved_blocks = 0
            if not admitted:
                break  # nobody overtakes the head of the queue
            if lookup:
                kv.record_prefix_cache_stats(request, num_hit)
            if request.num_computed_tokens == 0:
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_hit + num_external
            if lookup and self.connector is not None:
                self._record_external_stats(request, request.num_tokens - num_hit, num_external)
                self.connector.update_state_after_alloc(
                    request, kv.get_block_ids(request.request_id), num_external)
            request.num_computed_tokens = num_computed
            if num_external:
                # Blocks held, K/V on its way: out of the queue's way until the load is done.
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.appendleft(self.waiting.pop_request())
                continue
            self.waiting.pop_request()
            if request.status == RequestStatus.PREEMPTED:
                out.resumed_req_ids.add(request.request_id)
            out.scheduled_new_reqs.append(NewRequestData(
                request.request_id, request.prompt_token_ids,
                kv.get_block_ids(request.request_id), num_computed))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seats += cost
            out.scheduled.append((request, num_new))
            budget -= num_new
            self._on_scheduled(request, num_new, out)
        if skipped:  # back at the head of the queue, in their order
            self.waiting.prepend_requests(skipped)

    def _blocks_reserved_for_loads(self, request: Request, waiting) -> int:
        """The blocks the requests waiting for a connector's load (other than `request`) still
        need before their prompt can run: their whole prompt, less what they hold."""
        kv, reserved = self.kv_cache_manager, 0
        for r in waiting:
            if r is request or r.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            need = kv.num_blocks_for(min(r.num_tokens, self.config.max_model_len))
            reserved += max(0, need - len(kv.get_block_ids(r.request_id)))
        return reserved

    def _record_external_stats(self, request: Request, queries: int, hits: int) -> None:
        if request.num_preemptions > 0:
            self.external_prefix_cache_preempted_queries += queries
            self.external_prefix_cache_preempted_hits += hits
        else:
            self.external_prefix_cache_queries += queries
            self.external_prefix_cache_hits += hits

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """A request waiting for a connector's load (vLLM: _handle_blocked_waiting_request and
        _update_waiting_for_remote_kv). False while the load is not done. Once done, its blocks
        are keyed for the prefix cache, as any computed block is; a load that covered the
        whole sequence leaves its last token to compute, for the logits. After a failed load
        (kv_load_failure_policy "recompute") it gives its blocks back and starts over: the
        lookup runs again, and the connector no longer offers what failed."""
        rid = request.request_id
        if rid in self.failed_recving_kv_req_ids:
            self.failed_recving_kv_req_ids.discard(rid)
            self.kv_cache_manager.free(rid)
            request.num_computed_tokens = 0
        elif rid in self.finished_recving_kv_req_ids:
            self.finished_recving_kv_req_ids.discard(rid)
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                request.num_computed_tokens = request.num_tokens - 1
        else:
            return False
        request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                          else RequestStatus.WAITING)
        return True

    def _update_from_kv_xfer_finished(self, output) -> list[Request]:
        """The worker's connector report for a step being read: loads done, or failed. A failed
        load ends its request with an error under vLLM's default policy ("fail"); under
        "recompute" the request computes what did not arrive. Either way it is counted.
        Returns the requests ended."""
        self.connector.update_connector_output(output)
        ended: list[Request] = []
        if not (output.finished_recving or output.failed_recving):
            return ended
        loading = {r.request_id: r for r in self.waiting
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
        # A request aborted during its load is gone: its id is not kept (vLLM's check).
        self.finished_recving_kv_req_ids |= output.finished_recving & loading.keys()
        for rid in output.failed_recving:
            self.num_kv_load_failures += 1
            request = loading.get(rid)
            if request is None:
                continue  # aborted meanwhile
            if self.kv_load_failure_policy == "recompute":
                self.failed_recving_kv_req_ids.add(rid)
            else:
                self.finish_request(request, "error")
                request.metrics.finished_time = time.perf_counter()
                ended.append(request)
        return ended

    def finish_output(self, out: SchedulerOutput) -> None:
        """Fill in what the model runner reads besides the (request, tokens) pairs."""
        kv = self.kv_cache_manager
        out.cow_copies = kv.take_pending_copies()
        out.num_scheduled_tokens = {r.request_id: n for r, n in out.scheduled}
        out.block_ids = {r.request_id: kv.get_block_ids(r.request_id) for r, _ in out.scheduled}
        out.total_num_scheduled_tokens = sum(n for _, n in out.scheduled)
        out.num_computed_tokens = {r.request_id: r.num_computed_tokens for r, _ in out.scheduled}
        out.num_decode_tokens = sum(1 for r, _ in out.scheduled
                                    if r.num_computed_tokens >= r.num_prompt_tokens)

    def _preempt(self, request: Request, out: SchedulerOutput, front: bool = True,
                 drop_stale_output: bool = False) -> None:
        assert request.status == RequestStatus.RUNNING, (
            f"preempting {request.request_id}, which is {request.status.value}, not running")
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0  # recompute prompt + generated tokens later
        # A step in flight still delivers its token, but changes no counter (vLLM's stale share);
        # with drop_stale_output it is discarded. An undrained dropped share stays dropped.
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if front:  # fcfs: the head of the queue; priority: its place by its key
            self.waiting.prepend_request(request)
        else:
            self.waiting.add_request(request)
        out.preempted.append(request)
        self._on_preempted(request, out)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (vLLM: Scheduler.reset_prefix_cache). Refused (False)
        while requests hold blocks, unless `reset_running_requests`: then every running request
        is preempted first, newest first, so they run again in their order and recompute."""
        if reset_running_requests:
            out = SchedulerOutput()  # the preemptions are reported by no step
            while self.running:  # they may resume before the steps in flight are read
                self._preempt(self.running.pop(), out, drop_stale_output=True)
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- results in --------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           output: ModelRunnerOutput) -> list[Request]:
        """Advance every scheduled request by its computed tokens, append sampled tokens, check
        stops, and free what finished. Returns the requests that received a token."""
        now = time.perf_counter()
        touched: list[Request] = []
        if output.kv_connector_output is not None and self.connector is not None:
            touched += self._update_from_kv_xfer_finished(output.kv_connector_output)
        for request, num_new in sched.scheduled:
            stale = self._settle_in_flight(request, num_new,
                                           request.request_id in output.sampled_token_ids)
            if stale and request.drop_stale_output:
                continue  # preempted to resume at once (reset_prefix_cache): discarded
            for r in self._samplers(request, sched):
                if r.request_id not in output.sampled_token_ids or r.is_finished:
                    continue
                if self._take_sample(r, output):
                    continue
                r.append_output_token(output.sampled_token_ids[r.request_id], now)
                if r.request_id in output.logprobs:
                    r.output_logprobs.append(output.logprobs[r.request_id])
                if self.config.async_scheduling and not stale:
                    # The blocks this token completes could not be keyed when the step was
                    # scheduled (the token was a placeholder then): key them now, before a
                    # stop frees them (vLLM keys them here under async scheduling).
                    self.kv_cache_manager.cache_blocks(
                        r, r.num_computed_tokens - r.num_in_flight_tokens)
                reason = r.check_stop(self.config.max_model_len)
                if reason is not None:
                    self.finish_request(r, reason)
                    r.metrics.finished_time = now
                touched.append(r)
        self._after_update()
        return touched

    @staticmethod
    def _settle_in_flight(request: Request, num_new: int, sampled: bool) -> bool:
        """The step's result for `request` is read: it is no longer in flight, and its sampled
        token, if any, replaces a placeholder. Returns True if the output is stale (the request
        was preempted while the step ran): its token is kept, no counter moves."""
        request.num_in_flight_tokens -= num_new
        if request.num_stale_output_tokens > 0:
            request.num_stale_output_tokens -= num_new
            return True
        if sampled and request.num_output_placeholders > 0:
            request.num_output_placeholders -= 1
        return False

    def finish_request(self, request: Request, reason: str,
                       stop_reason: int | str | None = None) -> None:
        """Remove a finished or aborted request and give its blocks back at once."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove_request(request)
        if self.connector is not None:  # before its blocks go (vLLM: _free_request)
            self.connector.request_finished(request,
                                            self.kv_cache_manager.get_block_ids(request.request_id))
            self.finished_recving_kv_req_ids.discard(request.request_id)
            self.failed_recving_kv_req_ids.discard(request.request_id)
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._on_finished(request, reason)

    # ---- hooks: no-ops here; group_scheduler.py fills them for chapter 02 --------------------
    def _num_seats_in_use(self) -> int:
        return len(self.running)

    def _seat_cost(self, request: Request) -> int:
        return 1

    def _on_scheduled(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        pass

    def _on_preempted(self, request: Request, out: SchedulerOutput) -> None:
        pass

    def _on_unscheduled(self, request: Request, out: SchedulerOutput) -> None:
        pass  # called before its preemption, when it had been scheduled in the same step

    def _before_finish(self, out: SchedulerOutput) -> None:
        pass

    def _samplers(self, request: Request, sched: SchedulerOutput) -> list[Request]:
        return [request]  # who takes a token from this request's logits

    def _take_sample(self, request: Request, output: ModelRunnerOutput) -> bool:
        return False  # True: the token was handled elsewhere (a beam's logprobs)

    def _after_update(self) -> None:
        pass

    def _on_finished(self, request: Request, reason: str) -> None:
        pass

"""Chapter 02's scheduling, beside vLLM's: requests that move as a group.

Two kinds of group share one request's prompt blocks (`request.RequestGroup`):
- the n samples of `SamplingParams(n > 1)` with `parallel_sampling="fork"` (the PagedAttention
  paper's way): sample 0 computes the prompt, and when its last prompt token is scheduled the
  others fork its block table, sharing every block; copy-on-write separates them later;
- the beams of one beam search (`beam_search.py`): each beam is a request whose next token is
  chosen by its `BeamSearchGroup` once every live beam has reported its logprobs.

A group holds `num_seats` of max_num_seqs from the moment its first member runs, so its later
members always find a seat. vLLM's scheduler has none of this (its n > 1 is n independent
requests, `vllm/v1/engine/parallel_sampling.py`; its beam search runs above the engine), so
`scheduler.Scheduler` stays the scheduler vLLM has and this subclass fills its hooks.
"""

from __future__ import annotations

import time

from kvlab.outputs import ModelRunnerOutput
from kvlab.request import Request, RequestStatus
from kvlab.scheduler import Scheduler, SchedulerOutput


class GroupScheduler(Scheduler):
    def __init__(self, config, kv_cache_manager) -> None:
        super().__init__(config, kv_cache_manager)
        self._reported_beam_groups: dict[int, object] = {}  # this update's beam searches

    # ---- seats ---------------------------------------------------------------------------
    def _num_seats_in_use(self) -> int:
        """Seats held by running requests: one each, or a whole group's while any member runs,
        so the members that start later can never push `running` past max_num_seqs."""
        seats, groups = 0, set()
        for r in self.running:
            if r.group is None:
                seats += 1
            elif id(r.group) not in groups:
                groups.add(id(r.group))
                seats += r.group.num_seats
        return seats

    def _seat_cost(self, request: Request) -> int:
        if request.group is None:
            return 1
        if any(r.group is request.group for r in self.running):
            return 0  # the group already holds this member's seat
        return request.group.num_seats

    def can_run_ahead(self) -> bool:
        """A forked sample or a beam needs its token read before its group can go on (a fork
        waits for its parent's prompt, a beam for its siblings' logprobs), so while any group
        is live the engine runs the synchronous loop."""
        return not any(r.group is not None or r.beam_group is not None
                       for r in (*self.running, *self.waiting))

    # ---- n > 1 by fork ---------------------------------------------------------------------
    def _on_scheduled(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """Once sample 0's prompt is computed (this step), the other samples fork from it,
        sharing every block. A fork that cannot get its memory (the contiguous layout, or the
        no-sharing baseline, when full) waits and computes its prompt itself."""
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
                self.waiting.prepend_request(child)
        if started:
            out.forked[request.request_id] = started

    def _on_unscheduled(self, request: Request, out: SchedulerOutput) -> None:
        """A request scheduled earlier in this step is preempted after all (policy="priority"
        only): the samples it forked this step share blocks whose K/V this step would have
        written, so the fork is undone. They wait as its unforked samples again, to fork when
        it computes its prompt anew."""
        children = out.forked.pop(request.request_id, [])
        for child in children:
            self.running.remove(child)
            self.kv_cache_manager.free(child.request_id)
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            child.metrics.first_scheduled_time = None
        request.fork_children = children + request.fork_children

    def _on_preempted(self, request: Request, out: SchedulerOutput) -> None:
        # A sample forked earlier in this step no longer takes its token from its parent.
        for parent_id, children in list(out.forked.items()):
            if request in children:
                children.remove(request)
                if not children:
                    del out.forked[parent_id]

    def _samplers(self, request: Request, sched: SchedulerOutput) -> list[Request]:
        return [request, *sched.forked.get(request.request_id, [])]

    def _on_finished(self, request: Request, reason: str) -> None:
        # Samples never forked (their parent ended first) end with it.
        for child in request.fork_children:
            child.status = RequestStatus.FINISHED
            child.finish_reason = reason
        request.fork_children = []

    # ---- beam search -------------------------------------------------------------------------
    def _take_sample(self, request: Request, output: ModelRunnerOutput) -> bool:
        if request.beam_group is None:
            return False
        request.beam_group.add_logprobs(request, output.logprobs[request.request_id])
        self._reported_beam_groups[id(request.beam_group)] = request.beam_group
        return True

    def _after_update(self) -> None:
        groups, self._reported_beam_groups = self._reported_beam_groups, {}
        for group in groups.values():
            if group.ready():
                self._advance_beams(group)

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
                self.waiting.prepend_request(child)
        for beam, token in step.extend:
            beam.output_token_ids.append(token)

    def _before_finish(self, out: SchedulerOutput) -> None:
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

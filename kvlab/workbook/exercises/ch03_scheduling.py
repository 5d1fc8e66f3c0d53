"""Chapter 03 exercise: one scheduling step of continuous batching, with preemption.

What it teaches, in the order the scheduler decides: running requests first, oldest first (they
hold KV already, and a decode token is the cheapest progress there is); when one needs a block
and none is free, the newest running request is preempted (recompute: its blocks come back now,
it starts over later), until the request fits or is itself the one preempted. Then waiting
requests in arrival order, whole prompts (chunked prefill is chapter 04), while seats
(max_num_seqs), the token budget (max_num_batched_tokens) and free blocks allow; the first that
does not fit stops admission (nobody overtakes), and after a preemption nobody is admitted.

Checked against kvlab's own `Scheduler.schedule()` on hand-made and random states, then as the
scheduler of a real engine whose pool forces preemptions: the same decision every step, the
same tokens.
"""

from __future__ import annotations

import random

from kvlab.config import EngineConfig
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, RequestView, cdiv, short
from kvlab.kv_cache import KVCacheManager
from kvlab.metrics import RequestMetrics
from kvlab.request import Request, RequestStatus
from kvlab.sampling import SamplingParams
from kvlab.scheduler import Scheduler, SchedulerOutput


def schedule_step(running, waiting, num_free_blocks, block_size, max_num_seqs,
                  max_num_batched_tokens):
    """One step's decision: ([(request_id, num_new_tokens), ...], [preempted request_id, ...])."""
    scheduled, preempted = [], []
    budget = max_num_batched_tokens
    free = num_free_blocks
    running = list(running)  # our copy: preempting pops from its end

    # 1. Running requests, oldest first. Each decodes one token, at position
    #    num_computed_tokens; it needs a new block when its blocks are full.
    i = 0
    while i < len(running) and budget > 0:
        request = running[i]
        need = (request.num_computed_tokens + 1 + block_size - 1) // block_size - request.num_blocks
        # Out of blocks: the newest running request gives way (recompute: its blocks come back
        # now, it starts over later), until this one fits or was itself the newest.
        while need > free and request in running:
            victim = running.pop()
            preempted.append(victim.request_id)
            free += victim.num_blocks
        if request not in running:
            break  # it preempted itself; everyone after it had gone already
        free -= need
        budget -= 1
        scheduled.append((request.request_id, 1))
        i += 1

    # 2. Memory is short if someone was just preempted: admit nobody this step.
    if preempted:
        return scheduled, preempted

    # 3. Waiting requests in arrival order, whole prompts, while seats, budget and blocks last.
    seats = len(running)
    for request in waiting:
        num_new = request.num_tokens
        need = (num_new + block_size - 1) // block_size
        if seats >= max_num_seqs or num_new > budget or need > free:
            break  # first come, first served: nobody overtakes the head of the queue
        scheduled.append((request.request_id, num_new))
        seats += 1
        budget -= num_new
        free -= need
    return scheduled, preempted


STUB = '''def schedule_step(running, waiting, num_free_blocks, block_size, max_num_seqs,
                  max_num_batched_tokens):
    """Decide one step as kvlab's scheduler does in the trace above. Requests have .request_id,
    .num_tokens, .num_computed_tokens and .num_blocks (blocks held). running is in admission
    order (the oldest first, the newest last), every one of them decoding; waiting is in
    arrival order.

    Return (scheduled, preempted): [(request_id, num_new_tokens), ...] and the ids of the
    requests preempted, in the order they were preempted. What must hold after the step:
    - a scheduled request computes num_tokens - num_computed_tokens new tokens (1 for a running
      one, the whole prompt for a waiting one: no chunking until chapter 04) and holds blocks
      for num_computed_tokens + those tokens, taken from the free ones;
    - at most max_num_batched_tokens new tokens in all, a decode's token too, and at most
      max_num_seqs requests running (a running request the step leaves out keeps its seat);
    - a preempted request was running: its blocks are free at once, and it is not scheduled.
    Example: running [a], waiting [b (5 tokens)], plenty of room -> ([("a", 1), ("b", 5)], []).
    """
    raise NotImplementedError("your turn")
'''


# ---- kvlab's own scheduler as the oracle (shared with chapter 04) -----------------------------
def _request(view: RequestView) -> Request:
    return Request(view.request_id, None, [0] * view.num_tokens, SamplingParams(), frozenset(),
                   RequestMetrics(arrival_time=0.0), num_computed_tokens=view.num_computed_tokens)


def kvlab_schedule(running, waiting, num_free_blocks, block_size, max_num_seqs,
                   max_num_batched_tokens, enable_chunked_prefill):
    """What kvlab's Scheduler.schedule() decides in this state: ({id: tokens}, [preempted])."""
    held = sum(v.num_blocks for v in running)
    # Block 0 is the null block, never handed out: the pool is one block larger.
    manager = KVCacheManager(max(1, held + num_free_blocks) + 1, block_size)
    if held + num_free_blocks == 0:
        manager.block_pool.get_new_blocks(1)  # the pool must have a block; hold it
    # One step of the synchronous loop, as the exercise describes it (no output placeholders);
    # a context longer than any request here.
    config = EngineConfig(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=enable_chunked_prefill,
                          max_model_len=1 << 20, async_scheduling=False)
    # Seats set after the checks: a state may give more seats than the budget has tokens,
    # which vLLM's config refuses but which changes nothing about the step's rule.
    config.max_num_seqs = max_num_seqs
    scheduler = Scheduler(config, manager)
    for view in running:
        request = _request(view)
        request.status = RequestStatus.RUNNING
        if view.num_blocks:
            manager.allocate_slots(view.request_id, view.num_blocks * block_size)
        scheduler.running.append(request)
    for view in waiting:
        scheduler.waiting.append(_request(view))
    out = scheduler.schedule()
    return {r.request_id: n for r, n in out.scheduled}, [r.request_id for r in out.preempted]


def _parse(decision):
    try:
        scheduled, preempted = decision
        if isinstance(scheduled, dict):  # {request_id: num_new_tokens} is fine too
            scheduled = scheduled.items()
        scheduled = {str(rid): n for rid, n in scheduled}
        preempted = [str(rid) for rid in preempted]
    except (TypeError, ValueError):
        raise Mismatch("(scheduled, preempted): ([(request_id, num_new_tokens), ...], "
                       "[request_id, ...])", short(decision)) from None
    return scheduled, preempted


def _describe(running, waiting, free, block_size, seats, budget) -> str:
    def one(v):
        return f"{v.request_id}({v.num_computed_tokens}/{v.num_tokens} tok, {v.num_blocks} blk)"
    return (f"running {[one(v) for v in running]}, waiting "
            f"{[f'{v.request_id}({v.num_tokens} tok)' for v in waiting]}, {free} free blocks, "
            f"block_size {block_size}, max_num_seqs {seats}, budget {budget}")


def _compare(impl, running, waiting, free, block_size, seats, budget) -> None:
    want = kvlab_schedule(running, waiting, free, block_size, seats, budget, False)
    got = _parse(impl(list(running), list(waiting), free, block_size, seats, budget))
    if got != want:
        what = "scheduled" if got[0] != want[0] else "preempted"
        k = 0 if what == "scheduled" else 1
        raise Mismatch(f"{what} {want[k]}", f"{got[k]}",
                       _describe(running, waiting, free, block_size, seats, budget))


def _decode(rid: str, num_computed: int, block_size: int) -> RequestView:
    """A running request about to decode: its blocks cover its computed tokens."""
    return RequestView(rid, num_computed + 1, num_computed, cdiv(num_computed, block_size))


def _prompt(rid: str, n: int) -> RequestView:
    return RequestView(rid, n)


def _scene(running, waiting, free, block_size=4, seats=8, budget=64):
    return lambda impl: _compare(impl, running, waiting, free, block_size, seats, budget)


def _random(impl) -> None:
    rng = random.Random(4)
    for _ in range(400):
        block_size = rng.choice([1, 2, 4, 16])
        running = [_decode(f"r{j}", rng.randint(1, 40), block_size)
                   for j in range(rng.randint(0, 6))]
        waiting = [_prompt(f"w{j}", rng.randint(1, 40)) for j in range(rng.randint(0, 5))]
        free = rng.randint(0 if running else 1, 12)
        seats = rng.randint(max(1, len(running)), len(running) + 4)
        _compare(impl, running, waiting, free, block_size, seats, rng.randint(1, 64))


class _ParticipantScheduler(Scheduler):
    """kvlab's Scheduler whose decisions come from the participant's function; kvlab applies
    them (preempt, allocate, admit) and refuses impossible ones."""

    impl = None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(fork_copies=self.kv_cache_manager.take_fork_copies())
        kv = self.kv_cache_manager
        self.num_steps = getattr(self, "num_steps", 0) + 1
        step = self.num_steps

        def view(r):
            return RequestView(r.request_id, r.num_tokens, r.num_computed_tokens,
                               len(kv.get_block_ids(r.request_id)))

        scheduled, preempted = _parse(self.impl(
            [view(r) for r in self.running], [view(r) for r in self.waiting],
            kv.block_pool.get_num_free_blocks(), kv.block_size, self.config.max_num_seqs,
            self.config.max_num_batched_tokens))
        by_id = {r.request_id: r for r in [*self.running, *self.waiting]}
        for rid in preempted:
            request = by_id.get(rid)
            if request not in self.running:
                raise Mismatch("preempted requests to be running ones", f"{rid!r}")
            self.running.remove(request)
            self._preempt(request, out)
        budget = self.config.max_num_batched_tokens
        for request in [*self.running, *self.waiting]:
            if request.request_id not in scheduled:
                continue
            n = scheduled.pop(request.request_id)
            want = request.num_tokens - request.num_computed_tokens
            if n != want:
                raise Mismatch(f"step {step}: {request.request_id} to get {want} new tokens",
                               f"{short(n)}")
            if not kv.allocate_slots(request.request_id, request.num_computed_tokens + n,
                                     request.num_computed_tokens, request=request):
                raise Mismatch(f"step {step}: {request.request_id} scheduled only if its "
                               "blocks fit",
                               f"no free block for it ({kv.block_pool.get_num_free_blocks()} "
                               "free)")
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n
        if scheduled:
            raise Mismatch("request ids of running or waiting requests", short(list(scheduled)))
        if budget < 0 or len(self.running) > self.config.max_num_seqs:
            raise Mismatch("a step within the budget and the seats",
                           f"{self.config.max_num_batched_tokens - budget} tokens, "
                           f"{len(self.running)} running")
        self.finish_output(out)
        self._update_after_schedule(out)  # the requests advance as kvlab's schedule() does
        return out


# 12 blocks of 4 tokens for five requests of about 20 tokens, three seats: admission waits for
# seats and blocks, and running requests are preempted when they grow into the last blocks.
# The synchronous loop and no prefix cache: the exercise's rule, one token read per step.
_ENGINE = dict(block_size=4, max_model_len=48, kv_cache_tokens=48, max_num_seqs=3,
               enable_chunked_prefill=False, max_num_batched_tokens=48,
               async_scheduling=False, enable_prefix_caching=False)


def _batches():
    prompts = _real_engine.prompt_ids([6, 13, 8, 11, 9])
    return [[(f"r{i}", {"prompt_token_ids": p}, _real_engine.GREEDY) for i, p in enumerate(prompts)]]


def _real_model(impl) -> None:
    expected = _real_engine.reference_workload(
        "schedule", _ENGINE, _batches,
        lambda engine, _run: engine.scheduler.num_preemptions > 0,
        "the workload no longer preempts")
    engine, got = _real_engine.run_with(
        _ENGINE, _batches,
        scheduler_cls=_real_engine.with_attrs(_ParticipantScheduler, impl=impl))
    _real_engine.compare_traces(expected, got, "yours")
    _real_engine.compare_tokens(expected, got, "your scheduler")
    _real_engine.check_bookkeeping(engine)


# ---- the chapter's evidence: kvlab's own decisions, step by step, on a real engine -------------
class _RecordingScheduler(Scheduler):
    """kvlab's Scheduler, unchanged, writing down each step's state and decision."""

    rows = None

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        before = dict(
            running=[(r.request_id, r.num_computed_tokens, len(kv.get_block_ids(r.request_id)))
                     for r in self.running],
            waiting=[(r.request_id, r.num_tokens) for r in self.waiting],
            free=kv.block_pool.get_num_free_blocks())
        out = super().schedule()
        self.rows.append(dict(step=len(self.rows) + 1, **before,
                              scheduled={r.request_id: n for r, n in out.scheduled},
                              preempted=[r.request_id for r in out.preempted]))
        return out


def trace_steps(prompt_lens, max_tokens, *, block_size, kv_cache_tokens, max_num_seqs,
                max_num_batched_tokens) -> list[dict]:
    """Requests r0, r1, ... (prompts of these lengths, max_tokens new tokens each, all added
    at once) through a real engine with kvlab's scheduler, in the synchronous loop with the
    prefix cache and chunked prefill off, as the exercise has it: one dict per step, with the
    state the scheduler saw (running [(id, computed tokens, blocks)], waiting [(id, tokens)],
    free blocks) and what it decided (scheduled {id: new tokens}, preempted [ids])."""
    from kvlab.sampling import SamplingParams

    rows: list[dict] = []
    engine = _real_engine.new_engine(
        block_size=block_size, kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_num_batched_tokens,
        enable_chunked_prefill=False, async_scheduling=False, enable_prefix_caching=False,
        scheduler_cls=_real_engine.with_attrs(_RecordingScheduler, rows=rows))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(_real_engine.prompt_ids(prompt_lens)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return rows


def format_trace(rows) -> str:
    """The trace as a table: a running request as id:computed tokens/blocks held, a waiting
    one as id(tokens), then the step's decision."""
    lines = [f"{'step':>4} {'free':>4}  {'running (id:computed/blocks)':<28} "
             f"{'waiting (id(tokens))':<32} scheduled {{id: new tokens}}, preempted"]
    for r in rows:
        running = " ".join(f"{rid}:{c}/{b}" for rid, c, b in r["running"]) or "-"
        waiting = " ".join(f"{rid}({n})" for rid, n in r["waiting"]) or "-"
        decided = str(r["scheduled"]) + (f", preempted {r['preempted']}" if r["preempted"]
                                         else "")
        lines.append(f"{r['step']:>4} {r['free']:>4}  {running:<28} {waiting:<32} {decided}")
    return "\n".join(lines)


def _d(rid, n, bs=4):
    return _decode(rid, n, bs)


EXERCISE = Exercise(
    name="schedule",
    chapter="03_continuous_batching",
    title="One scheduling step",
    prompt=(
        "Write one step of kvlab's scheduler: which requests compute how many tokens, and which "
        "running requests are preempted. Which requests are served first, who gives way when "
        "blocks run out, and when waiting requests may start: work them out from the trace "
        "above, where each line is the state kvlab's scheduler saw and what it decided. The "
        "check compares your decisions with kvlab's scheduler, then lets yours drive a real "
        "engine."
    ),
    full_version=(
        "kvlab's Scheduler.schedule (kvlab/scheduler.py) follows vLLM's shape: one token budget "
        "for prefills and decodes alike, so a prompt can be cut into chunks (chapter 04); waiting"
        " requests start with their prefix-cache hits (chapter 05); admission can require the "
        "whole prompt to fit (scheduler_reserve_full_isl, chapter 04); a preempted request goes "
        "back to the head of the waiting queue as PREEMPTED; forks and beams take seats as a "
        "group (chapter 02, kvlab/group_scheduler.py). It returns a SchedulerOutput (the step's "
        "tokens per request and block tables) that the model runner reads."
    ),
    stub=STUB,
    hint=(
        "Replay the trace with three running totals: free blocks, budget, seats. At step 4, r0 "
        "needs a block and none is free: who goes? Then r1 needs one: who goes now? After that "
        "step 3 blocks are free and two seats are empty: is r3 admitted? At step 1, r1 does not fit "
        "the budget left: is r2, which would? A decode needs ceil((num_computed_tokens + 1) / "
        "block_size) - num_blocks new blocks."
    ),
    solution=schedule_step,
    cases=[
        Case("running requests decode, waiting ones are admitted",
             _scene([_d("a", 5)], [_prompt("b", 5)], free=4),
             "Each running request gets 1 token, a waiting one its whole prompt (chapter 03's "
             "trace, step 2: r0 1, r1 11, r2 2)."),
        Case("decodes come first when the budget is short",
             _scene([_d("a", 5), _d("b", 6)], [_prompt("c", 3)], free=4, budget=2),
             "Running requests are served before any waiting one (chapter 03's trace, step 6: "
             "r2's decode took one of the 2 free blocks before r3, which needed both, was "
             "considered; r3 waited)."),
        Case("the budget also limits decodes", _scene([_d("a", 5), _d("b", 6), _d("c", 7)], [],
                                                      free=4, budget=2),
             "Every token spends the budget, a decode's too, oldest first: the third decode "
             "waits for the next step and keeps its seat."),
        Case("a prompt that exactly fills the budget is admitted",
             _scene([_d("a", 5)], [_prompt("b", 7)], free=4, budget=8),
             "num_new_tokens <= budget left: a prompt may spend the budget's last token."),
        Case("first come, first served: a waiting prompt that does not fit stops admission",
             _scene([], [_prompt("a", 9), _prompt("b", 2)], free=8, budget=8),
             "Chapter 03's trace, step 1: r1 (11 tokens) did not fit the budget left, and r2 (2 "
             "tokens), which would have, was not admitted either: nobody overtakes the head of "
             "the queue."),
        Case("seats: at most max_num_seqs running", _scene(
            [_d("a", 5)], [_prompt("b", 3), _prompt("c", 3), _prompt("d", 3)], free=8, seats=3),
             "Running requests hold seats too (the docstring: at most max_num_seqs running; in "
             "chapter 03's trace, step 3, three run in three seats, and no free block either): "
             "1 running + 2 admitted = 3."),
        Case("a prompt needs all its blocks free", _scene(
            [], [_prompt("a", 9), _prompt("b", 1)], free=2),
             "9 tokens in blocks of 4 need 3 blocks; with 2 free it waits, and b behind it too "
             "(chapter 03's trace, step 6: r3 needed 2 blocks, 1 was left, nobody was admitted)."),
        Case("a prompt that needs exactly the free blocks is admitted",
             _scene([], [_prompt("a", 8)], free=2), "needed <= free."),
        Case("a decode that fills its last slot needs no new block",
             _scene([_d("a", 6), _d("b", 7)], [], free=0),
             "Positions 6 and 7 are still in block 1: no block needed (chapter 03's trace, step "
             "3: r0 at position 11 decoded in its 3 blocks)."),
        Case("a decode at a block boundary takes the last free block",
             _scene([_d("a", 8), _d("b", 6)], [], free=1),
             "Position 8 starts block 2: one new block, and exactly one is free (chapter 03's "
             "trace, step 6: r2 at position 4 took a block)."),
        Case("out of blocks: the newest running request is preempted",
             _scene([_d("a", 8), _d("b", 4), _d("c", 3)], [], free=1),
             "Chapter 03's trace, step 4: r0, the oldest, needed a block and none was free; r2, "
             "the newest, was preempted, and its block went to r0 in the same step. Here a takes"
             " the free block; b needs one: preempt c, the newest."),
        Case("a request that is itself the newest preempts itself",
             _scene([_d("a", 8), _d("b", 8)], [], free=1),
             "Chapter 03's trace, step 4: r1 needed a block when it was itself the newest "
             "running request, and r1 was the one preempted."),
        Case("several preemptions, newest first", _scene(
            [_d("a", 8), _d("b", 4), _d("c", 3), _d("d", 2)], [], free=0),
             "Chapter 03's trace, step 4: preempted ['r2', 'r1'], the newest first, listed in "
             "the order they were preempted. Here a needs a block: preempt d; then b needs one: "
             "preempt c."),
        Case("after a preemption nobody is admitted",
             _scene([_d("a", 8), _d("b", 9)], [_prompt("w", 1)], free=0),
             "Chapter 03's trace, step 4: after the preemptions 3 blocks were free and two "
             "seats were empty, yet r3 (8 tokens, 2 blocks) was not admitted. Memory is short: a step "
             "that preempts admits nobody."),
        Case("400 random states, compared with kvlab's Scheduler", _random,
             "The state and kvlab's decision are printed above; replay it as chapter 03's trace "
             "does: running requests oldest first, the newest giving way, then the queue's head."),
        Case("real model: your decisions drive the engine, same steps and tokens as kvlab",
             _real_model,
             "The first step where yours and kvlab's differ is printed above, "
             "in the form of chapter 03's trace.", real_model=True),
    ],
)
EXERCISES = [EXERCISE]

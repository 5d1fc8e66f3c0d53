"""Chapter 04 exercise: chunked prefill's share of the token budget.

What it teaches: with chunked prefill a step is a budget of `max_num_batched_tokens` tokens,
handed out in scheduling order: running requests first (decodes, and prompts already being
chunked), then waiting ones in arrival order. Each takes what it still needs
(`num_tokens - num_computed_tokens`), capped by what is left; a long prompt takes the rest of the
budget and continues next step. So a decode is never crowded out by a prefill, and no step is
longer than the budget: the generation stall shrinks to one chunk.

Checked against kvlab's own scheduler on hand-made and random states, then as the token split
of a real engine with a 12-token budget: the same chunks every step, the same tokens.
"""

from __future__ import annotations

import random

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, RequestView, cdiv, short
from kvlab.workbook.exercises.ch03_scheduling import kvlab_schedule
from kvlab.scheduler import Scheduler


def split_token_budget(running, waiting, max_num_batched_tokens):
    """{request_id: num_new_tokens} for every request that computes something this step."""
    num_scheduled = {}
    budget = max_num_batched_tokens
    # Running requests first (decodes, and prompts already being chunked), then waiting ones in
    # arrival order: a decode is never crowded out by a prefill.
    for request in [*running, *waiting]:
        # What the request still needs, capped by what is left of the budget: a long prompt
        # takes the rest now and continues next step (its next chunk).
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if num_new > 0:
            num_scheduled[request.request_id] = num_new
            budget -= num_new
    return num_scheduled


STUB = '''def split_token_budget(running, waiting, max_num_batched_tokens):
    """How many new tokens each request computes this step, with chunked prefill.

    running: requests already running (decodes, or prompts partly computed), in scheduling
    order; waiting: requests not started, in arrival order. Each has .request_id, .num_tokens
    and .num_computed_tokens; it still needs num_tokens - num_computed_tokens tokens.
    Return {request_id: num_new_tokens} for the requests that compute at least one token this
    step. Blocks and seats are plentiful here: only the budget limits the step. Afterwards:
    the values add up to at most max_num_batched_tokens, and no request gets more than it
    still needs.
    Example (everything fits): budget 32, running [a: 8 of 9 computed], waiting [b: 5 tokens]
    -> {"a": 1, "b": 5}.
    """
    raise NotImplementedError("your turn")
'''


def _parse(result) -> dict[str, int]:
    try:
        items = dict(result).items()
        return {str(k): v for k, v in items if v != 0}
    except (TypeError, ValueError):
        raise Mismatch("a dict {request_id: num_new_tokens}", short(result)) from None


def _compare(impl, running, waiting, budget) -> None:
    # Seats and blocks plentiful: only the budget decides.
    plenty = sum(cdiv(v.num_tokens, 4) for v in [*running, *waiting]) + 1
    want, _ = kvlab_schedule(running, waiting, plenty, 4, 10_000, budget, True)
    got = _parse(impl(list(running), list(waiting), budget))
    if got != want:
        run_desc = [f"{v.request_id}: {v.num_computed_tokens} of {v.num_tokens} computed"
                    for v in running]
        wait_desc = [f"{v.request_id}: {v.num_tokens} tokens" for v in waiting]
        describe = f"budget {budget}; running {run_desc}; waiting {wait_desc}"
        raise Mismatch(str(want), str(got), describe)


def _r(rid: str, num_tokens: int, num_computed: int) -> RequestView:
    """A running request: its blocks (block_size 4) cover its computed tokens."""
    return RequestView(rid, num_tokens, num_computed, cdiv(num_computed, 4))


def _w(rid: str, num_tokens: int) -> RequestView:
    return RequestView(rid, num_tokens)


def _scene(running, waiting, budget):
    return lambda impl: _compare(impl, running, waiting, budget)


def _random(impl) -> None:
    rng = random.Random(5)
    for _ in range(400):
        running = []
        for j in range(rng.randint(0, 4)):
            num_tokens = rng.randint(2, 60)
            computed = num_tokens - 1 if rng.random() < 0.6 else rng.randint(1, num_tokens - 1)
            running.append(_r(f"r{j}", num_tokens, computed))
        waiting = [_w(f"w{j}", rng.randint(1, 60)) for j in range(rng.randint(0, 4))]
        _compare(impl, running, waiting, rng.randint(1, 48))


class _ParticipantChunkScheduler(Scheduler):
    """kvlab's Scheduler, taking each request's number of new tokens from the participant's
    split of the budget (computed once per step, before anything is scheduled)."""

    impl = None
    split: dict[str, int] = {}

    def schedule(self):
        kv = self.kv_cache_manager

        def view(r):
            return RequestView(r.request_id, r.num_tokens, r.num_computed_tokens,
                               len(kv.get_block_ids(r.request_id)))

        self.split = _parse(self.impl([view(r) for r in self.running],
                                      [view(r) for r in self.waiting],
                                      self.config.max_num_batched_tokens))
        return super().schedule()

    def _num_new_tokens(self, request, budget, num_computed=None):
        if num_computed is None:
            num_computed = request.num_computed_tokens
        n = self.split.get(request.request_id, 0)
        need = request.num_tokens - num_computed
        if not isinstance(n, int) or n < 0 or n > need:
            raise Mismatch(f"{request.request_id} to get at most the {need} tokens it needs",
                           short(n))
        if n > budget:
            raise Mismatch(f"at most the {budget} tokens left of the budget for "
                           f"{request.request_id}", f"{n}")
        return n


# A 12-token budget: the 30- and 45-token prompts are chunked, and the short one's decodes run
# beside their chunks.
_ENGINE = dict(block_size=4, max_model_len=96, kv_cache_tokens=1024,
               async_scheduling=False, enable_prefix_caching=False,
               max_num_batched_tokens=12)


def _batches():
    prompts = _real_engine.prompt_ids([7, 30, 45])
    return [[(f"r{i}", {"prompt_token_ids": p}, _real_engine.GREEDY) for i, p in enumerate(prompts)]]


def _real_model(impl) -> None:
    expected = _real_engine.reference_workload("chunked_prefill", _ENGINE, _batches)
    engine, got = _real_engine.run_with(
        _ENGINE, _batches,
        scheduler_cls=_real_engine.with_attrs(_ParticipantChunkScheduler, impl=impl))
    _real_engine.compare_traces(expected, got, "yours")
    _real_engine.compare_tokens(expected, got, "your budget split")
    _real_engine.check_bookkeeping(engine)


EXERCISE = Exercise(
    name="chunked_prefill",
    chapter="04_chunked_prefill",
    title="Chunked prefill: sharing the token budget",
    prompt=(
        "Write how chunked prefill shares a step's budget of max_num_batched_tokens tokens "
        "among the running and waiting requests. Work out from the explorer's budget bar "
        "above who is served first and how much a request gets when it needs more than is "
        "left. The check compares you with kvlab's scheduler, then runs the real model with "
        "your split."
    ),
    full_version=(
        "In kvlab's Scheduler.schedule (kvlab/scheduler.py) this rule is _num_new_tokens, one "
        "line, and the rest of the step is around it: each request's share must also get its "
        "blocks (allocate_slots, or a preemption, chapter 03), a waiting request's need starts "
        "after its prefix-cache hits (chapter 05), and with enable_chunked_prefill=False a prompt"
        " that does not fit in what is left waits for a later step instead of being cut."
    ),
    stub=STUB,
    hint=(
        "Step the explorer again and read one step's budget bar: whose token is drawn first, "
        "and how large is the long prompt's chunk beside it? Then walk the requests in that "
        "order, keeping what is left of the budget."
    ),
    solution=split_token_budget,
    cases=[
        Case("everything fits: each request takes what it needs",
             _scene([_r("a", 9, 8)], [_w("b", 5)], budget=32),
             "The explorer's first steps: a decode needs 1 token, a waiting prompt all of its "
             "tokens."),
        Case("a long prompt takes what is left of the budget",
             _scene([_r("a", 9, 8)], [_w("b", 20)], budget=10),
             "The explorer's budget bar: the long prompt's chunk is what the decode left, "
             "min(needed, left); b needs 20 but only 9 are left after a's decode."),
        Case("decodes come before a waiting prompt", _scene(
            [_r("a", 9, 8), _r("b", 7, 6)], [_w("c", 40)], budget=3),
             "The explorer's budget bar: the decode's token is drawn first. Running requests "
             "first: two decodes, then c gets the 1 token left."),
        Case("a prompt already being chunked continues from num_computed_tokens",
             _scene([_r("a", 30, 12)], [], budget=12),
             "The explorer's later steps: a chunked prompt continues where it stopped; it still "
             "needs 30 - 12 = 18 tokens, the budget allows 12."),
        Case("the last chunk is what is left of the prompt",
             _scene([_r("a", 30, 24)], [_w("b", 10)], budget=12),
             "The explorer's last chunk is smaller than the others: a needs its last 6 tokens; b "
             "gets the other 6."),
        Case("a budget spent exactly leaves nothing for later requests",
             _scene([_r("a", 9, 8)], [_w("b", 7), _w("c", 3)], budget=8),
             "The budget bar never overflows: after a (1) and b (7) the budget is 0, c gets "
             "nothing and is left out of the dict."),
        Case("several prompts in one step, in arrival order",
             _scene([], [_w("a", 3), _w("b", 4), _w("c", 20)], budget=12),
             "Waiting prompts in arrival order, each min(needed, left): a 3, b 4, c the remaining "
             "5."),
        Case("400 random states, compared with kvlab's scheduler", _random,
             "The explorer's budget bar, step by step: running requests first, then waiting "
             "ones, each taking min(what it still needs, what is left)."),
        Case("real model: a 12-token budget, same chunks and tokens as kvlab", _real_model,
             "The chunks of chapter 04's explorer, on the real model: a wrong share changes "
             "which tokens each step computes.", real_model=True),
    ],
)
EXERCISES = [EXERCISE]

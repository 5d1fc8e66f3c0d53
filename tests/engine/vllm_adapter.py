"""The one adapter between vLLM 0.33.0's unit-test vocabulary and kvlab's classes.

`tests/engine/test_vllm_conformance.py` re-expresses vLLM's own unit tests (tests/v1/core/...) against
kvlab. kvlab differs from vLLM on purpose in a few places; every such difference is bridged HERE,
in one small place, and nowhere else. No expectation is loosened: the tests keep vLLM's block
sizes, pool sizes, token ids, call order and expected outcomes.

Block ids and counts are vLLM's, read as they are, with no translation: kvlab's BlockPool
reserves block 0 as vLLM's null block (vllm/v1/core/block_pool.py), so a pool of N blocks is
built as `BlockPool(N)` (or `make_manager(N, ...)`, `create_scheduler(num_blocks=N)`), hands out
ids 1..N-1 and reports N - 1 free blocks when empty, as vLLM's does. `block_ids()` only lists
the ids of some blocks.

The differences, and how they are bridged:

1. `allocate_slots`. vLLM's takes (request, num_new_tokens, num_new_computed_tokens,
   new_computed_blocks) and returns the newly allocated blocks or None. kvlab's takes totals
   (num_tokens the table must cover, num_computed_tokens incl. adopted prefix hits) and returns
   True/False. `allocate_slots()` below calls kvlab's and returns the blocks it added (the new
   tail of the block table, hits excluded) or None.
2. `get_computed_blocks` returns (list of blocks, num_tokens) in kvlab; vLLM returns
   (KVCacheBlocks, num_tokens, shared_prefix_boundary). The tests read kvlab's directly.
3. Requests: kvlab requests take ids, an `eos_token_ids` set and `RequestMetrics`
   (`make_request()`). kvlab's engine gives each request a block hasher, as vLLM's does
   (keys computed at creation and on every appended token); requests built here have none,
   and the manager keys their blocks when it first needs them, with the same keys.
4. The scheduler's output. kvlab's SchedulerOutput lists `scheduled` (request, num_new_tokens)
   pairs, `num_scheduled_tokens` (vLLM's name) and `block_ids` = the WHOLE block table of each
   scheduled request (copy-on-write can replace a block mid-table, so kvlab always sends whole
   tables). vLLM sends new requests' full tables and, for running ones, only the ids appended
   this step. `SchedulerAdapter` rebuilds vLLM's view (new / cached / resumed requests and their
   new block ids) from consecutive outputs, and checks it against kvlab's own
   `scheduled_new_reqs` (NewRequestData: first admissions and re-admissions after a preemption;
   vLLM's V1 runner lists the latter among the cached requests) and `resumed_req_ids`.
5. Running a step without a model: `runner_output()` builds a ModelRunnerOutput with a sampled
   token for every scheduled request whose sequence reaches its end this step (vLLM: every
   request that is not mid-prefill gets a sampled token). Where a step starts is read from its
   SchedulerOutput (`num_computed_tokens`): schedule() advances the request's own count before
   it returns, as vLLM's does.
6. Configuration: vLLM's scheduler fixture with `num_blocks=N` (null block included) is
   kvlab's `kv_cache_tokens=(N - 1) * block_size` (`create_scheduler()`): kvlab's
   kv_cache_tokens are the tokens requests can hold, and its pool adds block 0 to them.
7. Async scheduling: vLLM's fixture builds an `AsyncScheduler` when given
   `async_scheduling=True` and a plain `Scheduler` otherwise (its default); kvlab has one
   Scheduler whose `EngineConfig.async_scheduling` (default True) adds the output placeholders,
   so `create_scheduler()` passes False unless a test asks (`test_vllm_async_conformance.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvlab.block_pool import KVCacheBlock
from kvlab.config import EngineConfig
from kvlab.kv_cache import KVCacheManager, make_kv_cache_manager
from kvlab.outputs import ModelRunnerOutput
from kvlab.request import Request
from kvlab.scheduler import Scheduler
from tests import helpers

EOS_TOKEN_ID = 50256  # tests/v1/core/utils.py


# ---- block ids (vLLM's, as they are) -----------------------------------------------------------
def block_ids(blocks) -> list[int]:
    """The ids of `blocks`, in order (vLLM's tests: `[b.block_id for b in ...]`)."""
    return [b.block_id for b in blocks]


# ---- 1-3. manager and requests -----------------------------------------------------------------
def make_manager(num_blocks: int, block_size: int, *, max_model_len: int = 8192,
                 enable_caching: bool = True, **kwargs) -> KVCacheManager:
    """vLLM's `make_kv_cache_manager(make_kv_cache_config(block_size, N), max_model_len=...,
    enable_caching=...)` for one full-attention group: a manager over a pool of N blocks,
    block 0 the null block."""
    return KVCacheManager(num_blocks, block_size, max_model_len,
                          enable_prefix_caching=enable_caching, **kwargs)


def make_request(request_id: str, prompt_token_ids, *, max_tokens: int = 17,
                 eos_token_id: int = 100, cache_salt: str | None = None,
                 ignore_eos: bool = False, stop_token_ids=None) -> Request:
    """vLLM's make_request (test_prefix_caching.py: max_tokens=17, eos 100) in kvlab's form."""
    return helpers.make_request(request_id, prompt_token_ids, max_tokens=max_tokens,
                                eos_token_ids={eos_token_id}, cache_salt=cache_salt,
                                ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)


def append_output_token_ids(request: Request, token_ids) -> None:
    """vLLM's Request.append_output_token_ids (no timing needed here)."""
    if isinstance(token_ids, int):
        token_ids = [token_ids]
    request.output_token_ids.extend(token_ids)


def allocate_slots(manager: KVCacheManager, request: Request, num_new_tokens: int,
                   num_new_computed_tokens: int = 0, new_computed_blocks=(),
                   **kwargs) -> list[KVCacheBlock] | None:
    """vLLM's `allocate_slots(request, num_new_tokens, num_new_computed_tokens,
    new_computed_blocks, ...)` on kvlab's: totals in, and the blocks it added out (or None).

    vLLM's layout: | comp | new_comp | new |, comp = request.num_computed_tokens,
    new_comp = num_new_computed_tokens (the adopted hits), new = num_new_tokens. kvlab's table
    must cover comp + new_comp + new tokens, with comp + new_comp of them already computed.
    `kwargs` (full_sequence_must_fit, has_scheduled_reqs) are passed through by name.
    """
    hits = list(new_computed_blocks or ())
    num_computed = request.num_computed_tokens + num_new_computed_tokens
    before = len(manager.req_to_blocks.get(request.request_id, ()))
    ok = manager.allocate_slots(request.request_id, num_computed + num_new_tokens, num_computed,
                                hits, request=request, **kwargs)
    assert ok in (True, False), f"kvlab's allocate_slots returns a bool, got {ok!r}"
    if not ok:
        return None
    return list(manager.req_to_blocks[request.request_id][before + len(hits):])


# ---- 4-6. scheduler ----------------------------------------------------------------------------
def create_scheduler(*, max_num_seqs: int = 16, max_num_batched_tokens: int = 8192,
                     enable_prefix_caching: bool = True, num_blocks: int = 10000,
                     block_size: int = 16, max_model_len: int | None = None,
                     enable_chunked_prefill: bool = True, async_scheduling: bool = False,
                     **new_knobs) -> Scheduler:
    """vLLM's tests/v1/core/utils.py `create_scheduler` without a model.

    vLLM 0.33.0's CacheConfig.enable_prefix_caching defaults to True (vllm/config/cache.py),
    hence the default here. `async_scheduling` defaults to False as in vLLM's fixture, which
    builds a plain `Scheduler` unless asked for an `AsyncScheduler` (kvlab has one Scheduler
    class; EngineConfig.async_scheduling, whose own default is True, switches on the output
    placeholders). `new_knobs` (scheduler_reserve_full_isl, watermark,
    long_prefill_token_threshold, policy, ...) are only passed when a test sets them.
    """
    if max_model_len is None:
        max_model_len = max_num_batched_tokens
    kv_tokens = (num_blocks - 1) * block_size  # a pool of num_blocks: these + the null block
    config = EngineConfig(block_size=block_size, kv_cache_tokens=kv_tokens,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=enable_prefix_caching,
                          enable_chunked_prefill=enable_chunked_prefill,
                          async_scheduling=async_scheduling, **new_knobs)
    config = config.resolve(model_max_len=max_model_len, default_kv_tokens=kv_tokens)
    return Scheduler(config, make_kv_cache_manager(config))


def create_requests(num_requests: int, num_tokens: int = 10, *, max_tokens: int = 16,
                    stop_token_ids=None, same_prompt: bool = False, req_ids=None,
                    ignore_eos: bool = False, starting_idx: int = 0,
                    prompt_logprobs: int | None = None) -> list[Request]:
    """tests/v1/core/utils.py `create_requests`: prompt [i] * num_tokens, EOS 50256.
    `prompt_logprobs` as vLLM's: such a request skips reading the prefix cache
    (SamplingParams.skip_reading_prefix_cache), and starts its prompt logprobs as the engine
    does ([None]: the first prompt token has no prediction)."""
    if req_ids is None:
        req_ids = [f"{i + starting_idx}" for i in range(num_requests)]
    requests = [
        make_request(req_ids[i], [starting_idx if same_prompt else i + starting_idx] * num_tokens,
                     max_tokens=max_tokens, eos_token_id=EOS_TOKEN_ID, ignore_eos=ignore_eos,
                     stop_token_ids=stop_token_ids)
        for i in range(num_requests)
    ]
    if prompt_logprobs is not None:
        for r in requests:
            r.sampling_params = dataclasses.replace(r.sampling_params,
                                                    prompt_logprobs=prompt_logprobs,
                                                    skip_reading_prefix_cache=None)
            r.prompt_logprobs = [None]
    return requests


def create_scheduler_with_priority(**kwargs) -> Scheduler:
    """tests/v1/core/test_scheduler.py `create_scheduler_with_priority`: `create_scheduler`
    with policy="priority" (vllm/config/scheduler.py)."""
    return create_scheduler(policy="priority", **kwargs)


def create_requests_with_priority(num_requests: int, priorities, arrival_times=None,
                                  num_tokens: int = 10, *, max_tokens: int = 16,
                                  starting_idx: int = 0, req_ids=None) -> list[Request]:
    """tests/v1/core/test_scheduler.py `create_requests_with_priority`: prompt
    [i + starting_idx] * num_tokens, arrival times 0.0, 1.0, ... unless given, EOS 50256."""
    assert len(priorities) == num_requests
    if arrival_times is None:
        arrival_times = [float(i) for i in range(num_requests)]
    if req_ids is None:
        req_ids = [f"{i + starting_idx}" for i in range(num_requests)]
    return [helpers.make_request(req_ids[i], [i + starting_idx] * num_tokens,
                                 max_tokens=max_tokens, eos_token_ids={EOS_TOKEN_ID},
                                 priority=priorities[i], arrival_time=arrival_times[i])
            for i in range(num_requests)]


def runner_output(out, token=1000) -> ModelRunnerOutput:
    """A model runner's output for one kvlab step: `token` (an int, or a dict req_id -> int) for
    every scheduled request whose sequence reaches its end this step. Where the step starts is
    `out.num_computed_tokens[request_id]` (the count when the step was scheduled): schedule()
    has already advanced the request's own count, as vLLM's _update_after_schedule does. A
    step that completes the sequence reaches its end even when, under async scheduling, its
    last input is an output placeholder (start + new > num_tokens); so does the model runner's
    test (kvlab/model_runner.py). May be called any time before update_from_output."""
    mro = ModelRunnerOutput()
    for request, num_new in out.scheduled:
        if out.num_computed_tokens[request.request_id] + num_new >= request.num_tokens:
            tok = token.get(request.request_id) if isinstance(token, dict) else token
            if tok is not None:
                mro.sampled_token_ids[request.request_id] = tok
    return mro


@dataclass
class Step:
    """One kvlab step in vLLM's SchedulerOutput shape (ids are vLLM block ids)."""

    raw: object
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_new_reqs: list[str] = field(default_factory=list)  # req ids, in order
    new_req_block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_cached_reqs: list[str] = field(default_factory=list)
    cached_new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    resumed_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)


class SchedulerAdapter:
    """Drives a kvlab Scheduler and reports each step as vLLM would (see module doc, item 4)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.seen: set[str] = set()  # ever scheduled
        self.sent_tables: dict[str, list[int]] = {}  # block ids last sent, per live request

    def schedule(self) -> Step:
        out = self.scheduler.schedule()
        pairs = {r.request_id: n for r, n in out.scheduled}
        # kvlab's vLLM-named fields must agree with its own list of (request, tokens).
        assert out.num_scheduled_tokens == pairs, (out.num_scheduled_tokens, pairs)
        assert out.total_num_scheduled_tokens == sum(pairs.values())
        assert set(out.block_ids) == set(pairs), (out.block_ids, pairs)
        step = Step(out, dict(out.num_scheduled_tokens), out.total_num_scheduled_tokens,
                    preempted_req_ids=[r.request_id for r in out.preempted])
        for rid in step.preempted_req_ids:
            self.sent_tables.pop(rid, None)
        for rid in pairs:
            table = list(out.block_ids[rid])
            if rid not in self.seen:
                step.scheduled_new_reqs.append(rid)
                step.new_req_block_ids[rid] = list(table)
            else:
                step.scheduled_cached_reqs.append(rid)
                prev = self.sent_tables.get(rid)
                if prev is None:  # resumed after a preemption: its whole new table
                    step.resumed_req_ids.add(rid)
                    step.cached_new_block_ids[rid] = list(table)
                else:
                    assert table[: len(prev)] == prev, "no copy-on-write in these tests"
                    step.cached_new_block_ids[rid] = table[len(prev):]
            self.seen.add(rid)
            self.sent_tables[rid] = table
        # kvlab's own NewRequestData list holds first admissions AND re-admissions after a
        # preemption (vLLM's V1 runner lists the latter among scheduled_cached_reqs, as resumed;
        # the view above does the same): both must agree with the view rebuilt from the tables.
        admitted = [nr.req_id for nr in out.scheduled_new_reqs]
        assert set(admitted) == set(step.scheduled_new_reqs) | step.resumed_req_ids, admitted
        assert set(out.resumed_req_ids) == step.resumed_req_ids, out.resumed_req_ids
        for nr in out.scheduled_new_reqs:
            assert list(nr.block_ids) == list(out.block_ids[nr.req_id])
        return step

    def update(self, step: Step, token=1000, output: ModelRunnerOutput | None = None):
        if output is None:
            output = runner_output(step.raw, token)
        result = self.scheduler.update_from_output(step.raw, output)
        for request, _ in step.raw.scheduled:
            if request.is_finished:
                self.sent_tables.pop(request.request_id, None)
        return result


def check_not_ported(not_ported, namespace: dict) -> None:
    """A vLLM test is either ported (a test of that name in `namespace`, a test module's
    globals) or listed, once and with a reason, in `not_ported` (name, file, reason)."""
    names = [name for name, _, _ in not_ported]
    assert len(names) == len(set(names)), "duplicate NOT_PORTED entries"
    defined = {name for name, obj in namespace.items() if name.startswith("test_")
               and callable(obj)}
    assert not set(names) & defined, sorted(set(names) & defined)
    assert all(reason for _, _, reason in not_ported)

"""The one adapter between vLLM 0.33.0's unit-test vocabulary and kvlab's classes.

`tests/engine/test_vllm_conformance.py` re-expresses vLLM's own unit tests (tests/v1/core/...) against
kvlab. kvlab differs from vLLM on purpose in a few places; every such difference is bridged HERE,
in one small place, and nowhere else. No expectation is loosened: the tests keep vLLM's block
sizes, pool sizes, token ids, call order and expected outcomes, written in vLLM's numbering.

The differences, and how they are bridged:

1. The null block. vLLM reserves block 0 of its pool as the null block (never handed out, never
   freed), so a vLLM pool of N blocks hands out ids 1..N-1. kvlab has no null block. A vLLM pool
   of N blocks is therefore a kvlab pool of N - 1 blocks, and vLLM's block id k is kvlab's k - 1.
   `vids()` turns kvlab blocks/ids into vLLM ids so the tests can state vLLM's literal ids.
   Free-block COUNTS need no translation: vLLM's `get_num_free_blocks()` already leaves the null
   block out, so both report the same number.
2. `allocate_slots`. vLLM's takes (request, num_new_tokens, num_new_computed_tokens,
   new_computed_blocks) and returns the newly allocated blocks or None. kvlab's takes totals
   (num_tokens the table must cover, num_computed_tokens incl. adopted prefix hits) and returns
   True/False. `allocate_slots()` below calls kvlab's and returns the blocks it added (the new
   tail of the block table, hits excluded) or None.
3. `get_computed_blocks` returns (list of blocks, num_tokens) in kvlab; vLLM returns
   (KVCacheBlocks, num_tokens, shared_prefix_boundary). The tests read kvlab's directly.
4. Requests: kvlab requests take ids, an `eos_token_ids` set and `RequestMetrics`; block hashes
   are filled lazily by the manager (vLLM: a block hasher at construction). `make_request()`.
5. The scheduler's output. kvlab's SchedulerOutput lists `scheduled` (request, num_new_tokens)
   pairs, `num_scheduled_tokens` (vLLM's name) and `block_ids` = the WHOLE block table of each
   scheduled request (copy-on-write can replace a block mid-table, so kvlab always sends whole
   tables). vLLM sends new requests' full tables and, for running ones, only the ids appended
   this step. `SchedulerAdapter` rebuilds vLLM's view (new / cached / resumed requests and their
   new block ids) from consecutive outputs, and checks it against kvlab's own
   `scheduled_new_reqs` (NewRequestData: first admissions and re-admissions after a preemption;
   vLLM's V1 runner lists the latter among the cached requests) and `resumed_req_ids`.
6. Running a step without a model: `runner_output()` builds a ModelRunnerOutput with a sampled
   token for every scheduled request whose sequence reaches its end this step (vLLM: every
   request that is not mid-prefill gets a sampled token).
7. Configuration: vLLM's scheduler fixture with `num_blocks=N` is kvlab's
   `kv_cache_tokens=(N - 1) * block_size` (`create_scheduler()`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.block_pool import KVCacheBlock
from kvlab.config import EngineConfig
from kvlab.kv_cache import KVCacheManager, make_kv_cache_manager
from kvlab.outputs import ModelRunnerOutput
from kvlab.request import Request
from kvlab.scheduler import Scheduler
from tests import helpers

NUM_NULL_BLOCKS = 1  # vLLM's block 0
EOS_TOKEN_ID = 50256  # tests/v1/core/utils.py


# ---- 1. the null block -------------------------------------------------------------------------
def kvlab_num_blocks(vllm_num_blocks: int) -> int:
    """A vLLM pool of N blocks (null block included) is a kvlab pool of N - 1."""
    return vllm_num_blocks - NUM_NULL_BLOCKS


def vllm_id(kvlab_block_id: int) -> int:
    return kvlab_block_id + NUM_NULL_BLOCKS


def vids(blocks) -> list[int]:
    """vLLM block ids of kvlab blocks (or kvlab block ids)."""
    return [vllm_id(b if isinstance(b, int) else b.block_id) for b in blocks]


def vblock(pool, vllm_block_id: int) -> KVCacheBlock:
    """The kvlab block that vLLM's test calls `block_pool.blocks[vllm_block_id]`."""
    return pool.blocks[vllm_block_id - NUM_NULL_BLOCKS]


def free_queue_vids(pool) -> list[int]:
    """The free queue head first, in vLLM ids (vLLM: free_block_queue.get_all_free_blocks())."""
    return vids(list(pool.free_queue))


# ---- 2-4. manager and requests -----------------------------------------------------------------
def make_manager(vllm_num_blocks: int, block_size: int, *, max_model_len: int = 8192,
                 enable_caching: bool = True, **kwargs) -> KVCacheManager:
    """vLLM's `make_kv_cache_manager(make_kv_cache_config(block_size, N), max_model_len=...,
    enable_caching=...)` for one full-attention group."""
    return KVCacheManager(kvlab_num_blocks(vllm_num_blocks), block_size, max_model_len,
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


# ---- 5-7. scheduler ----------------------------------------------------------------------------
def create_scheduler(*, max_num_seqs: int = 16, max_num_batched_tokens: int = 8192,
                     enable_prefix_caching: bool = True, num_blocks: int = 10000,
                     block_size: int = 16, max_model_len: int | None = None,
                     enable_chunked_prefill: bool = True, **new_knobs) -> Scheduler:
    """vLLM's tests/v1/core/utils.py `create_scheduler` without a model.

    vLLM 0.33.0's CacheConfig.enable_prefix_caching defaults to True (vllm/config/cache.py),
    hence the default here. `new_knobs` (scheduler_reserve_full_isl, watermark,
    long_prefill_token_threshold, policy, ...) are only passed when a test sets them.
    """
    if max_model_len is None:
        max_model_len = max_num_batched_tokens
    kv_tokens = kvlab_num_blocks(num_blocks) * block_size
    config = EngineConfig(block_size=block_size, kv_cache_tokens=kv_tokens,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=enable_prefix_caching,
                          enable_chunked_prefill=enable_chunked_prefill, **new_knobs)
    config = config.resolve(model_max_len=max_model_len, default_kv_tokens=kv_tokens)
    return Scheduler(config, make_kv_cache_manager(config))


def create_requests(num_requests: int, num_tokens: int = 10, *, max_tokens: int = 16,
                    stop_token_ids=None, same_prompt: bool = False, req_ids=None,
                    ignore_eos: bool = False, starting_idx: int = 0) -> list[Request]:
    """tests/v1/core/utils.py `create_requests`: prompt [i] * num_tokens, EOS 50256."""
    if req_ids is None:
        req_ids = [f"{i + starting_idx}" for i in range(num_requests)]
    return [
        make_request(req_ids[i], [starting_idx if same_prompt else i + starting_idx] * num_tokens,
                     max_tokens=max_tokens, eos_token_id=EOS_TOKEN_ID, ignore_eos=ignore_eos,
                     stop_token_ids=stop_token_ids)
        for i in range(num_requests)
    ]


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
    every scheduled request whose sequence reaches its end this step. Call before
    update_from_output (it reads num_computed_tokens before they advance)."""
    mro = ModelRunnerOutput()
    for request, num_new in out.scheduled:
        if request.num_computed_tokens + num_new >= request.num_tokens:
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
    """Drives a kvlab Scheduler and reports each step as vLLM would (see module doc, item 5)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.seen: set[str] = set()  # ever scheduled
        self.sent_tables: dict[str, list[int]] = {}  # kvlab ids last sent, per live request

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
                step.new_req_block_ids[rid] = vids(table)
            else:
                step.scheduled_cached_reqs.append(rid)
                prev = self.sent_tables.get(rid)
                if prev is None:  # resumed after a preemption: its whole new table
                    step.resumed_req_ids.add(rid)
                    step.cached_new_block_ids[rid] = vids(table)
                else:
                    assert table[: len(prev)] == prev, "no copy-on-write in these tests"
                    step.cached_new_block_ids[rid] = vids(table[len(prev):])
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

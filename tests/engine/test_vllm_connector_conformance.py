"""vLLM 0.33.0's KV connector and KV offloading unit tests, re-expressed against kvlab.

The scenarios come from vllm-project/vllm's
- tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py (RP below): a request whose
  prompt K/V another engine computed waits in WAITING_FOR_REMOTE_KVS holding blocks, resumes
  once the worker reports the transfer done, and its blocks are keyed only then;
- tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py (LF): an asynchronous load that
  fails is recomputed (kv_load_failure_policy "recompute") or ends the request ("fail");
- tests/v1/kv_offload/test_cpu_manager.py (CM): the CPU tier's LRU, what a store may evict,
  and a store refused when nothing can be evicted;
- tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py and the older
  tests/v1/kv_connector/unit/test_offloading_connector.py it grew from (OC): which blocks the
  offloading connector stores step by step, what a preempted request loads back.
Each test names the vLLM test it re-expresses. The code is kvlab's own; only the scenarios
(sizes, order of events, expected outcomes) are vLLM's. The test copies read are newer than
0.33.0; every expectation was checked against the 0.33.0 source
(vllm/v1/core/sched/scheduler.py, vllm/v1/kv_offload/cpu/manager.py and policies/lru.py,
vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py) and where they differ
0.33.0 is followed, with a comment. Tests named `test_src_*` pin a 0.33.0 behaviour no
portable vLLM test covers.

How vLLM's vocabulary maps onto kvlab's:
- vLLM's scheduler fixture (create_vllm_config + create_scheduler: block size 16, 64-token
  budget, 16 seats, prefix caching on, 10000 blocks) is `make_scheduler()` below, over
  `tests/engine/vllm_adapter.create_scheduler`; its NixlConnector (kv_role kv_consumer) is
  `RemotePrefill`, a KVConnectorBase subclass that, like NIXL for a request marked
  do_remote_prefill, offers the whole prompt past the local hit once, asynchronously.
- `create_model_runner_output(reqs, finished_recving=...)` is `runner(out, ...)`: a token for
  every scheduled request that reaches its end, and a KVConnectorOutput. vLLM reports failed
  loads per block (invalid_block_ids) or per request (failed_recving); kvlab's connectors
  report per request only, so only the per-request form is ported.
- vLLM's CPUOffloadingManager (prepare_store / complete_store / prepare_load / complete_load /
  lookup / touch) is the scheduler side of kvlab's OffloadingConnector, driven through its
  connector hooks (`store`, `load`, `lookup` below): a store is a request admitted with
  nothing to load whose prompt a step computes (build_connector_meta plans the store, whose
  slots are then pending: not served, not evicted; a refused one is an allocation failure),
  its complete_store is the worker's report of the write, KVConnectorOutput.finished_stores
  (failed_stores for complete_store(success=False)), a load is pinned by
  update_state_after_alloc and released by update_connector_output, a lookup is
  get_num_new_matched_tokens, a touch is a re-offer of stored keys. kvlab's tier block is one
  pool block (vLLM's offloaded block may span several GPU blocks; here the factor is 1).

vLLM tests that were read but cannot be expressed against kvlab are in NOT_PORTED at the end.
"""

from __future__ import annotations

import types

import pytest

from kvlab.kv_transfer import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from kvlab.kv_transfer.kv_transfer_config import KVTransferConfig
from kvlab.kv_transfer.offloading_connector import OffloadingConnector
from kvlab.prefix_cache import get_request_block_hasher
from kvlab.request import RequestStatus
from tests import helpers
from tests.engine.vllm_adapter import (EOS_TOKEN_ID, check_not_ported, create_scheduler,
                                      runner_output)

RP = "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py"
LF = "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py"
CM = "tests/v1/kv_offload/test_cpu_manager.py"
OC = "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py"
OCOLD = "tests/v1/kv_connector/unit/test_offloading_connector.py"
BLOCK = 16


# =================================================================================================
# vLLM's fixtures in kvlab's terms
# =================================================================================================
class RemotePrefill(KVConnectorBase):
    """A connector whose `remote` requests' prompts were computed elsewhere (NIXL's
    do_remote_prefill): asked for one of them, it offers every prompt token past the local hit
    (or `matches[request_id]` tokens when given), to load asynchronously, once; after its
    blocks are allocated the request is no longer remote (NIXL clears do_remote_prefill).
    Every hook call is recorded."""

    def __init__(self, remote=(), matches=None, block_size: int = BLOCK) -> None:
        super().__init__(None, KVConnectorRole.SCHEDULER, block_size)
        self.remote = set(remote)
        self.matches = dict(matches or {})
        self.lookups: list[tuple[str, int]] = []
        self.allocs: list[tuple[str, list[int], int]] = []
        self.reports: list[KVConnectorOutput] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.lookups.append((request.request_id, num_computed_tokens))
        rid = request.request_id
        if rid not in self.remote:
            return 0, False
        n = self.matches.get(rid, request.num_prompt_tokens - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))
        if num_external_tokens:
            self.remote.discard(request.request_id)

    def update_connector_output(self, output):
        self.reports.append(output)

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return False, None


def make_scheduler(connector=None, *, num_blocks: int = 10000, failure_policy: str = "fail",
                   max_num_batched_tokens: int = 64, block_size: int = BLOCK, **kwargs):
    """vLLM's create_scheduler(create_vllm_config(...), num_blocks) with a connector and its
    kv_load_failure_policy; other knobs (policy="priority", ...) go to EngineConfig."""
    max_model_len = min(10000, (num_blocks - 1) * block_size)
    sched = create_scheduler(num_blocks=num_blocks, max_num_seqs=kwargs.pop("max_num_seqs", 16),
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, block_size=block_size, **kwargs)
    sched.connector = connector
    sched.kv_load_failure_policy = failure_policy
    return sched


def create_request(request_id: int, num_tokens: int, *, all_ones: bool = False,
                   max_tokens: int = 16, block_size: int = BLOCK, ignore_eos: bool = False,
                   prompt=None):
    """vLLM's create_request: prompt [i * request_id] (or `prompt`), EOS 50256, a block
    hasher."""
    tokens = [1] * num_tokens if all_ones else [i * request_id for i in range(num_tokens)]
    if prompt is not None:
        tokens = list(prompt)
    req = helpers.make_request(f"id-{request_id}", tokens, max_tokens=max_tokens,
                               eos_token_ids={EOS_TOKEN_ID}, ignore_eos=ignore_eos)
    req.block_hasher = get_request_block_hasher(block_size, "sha256")
    req.block_hasher(req)
    return req


def runner(out, *, finished_recving=(), failed_recving=(), use_eos: bool = False):
    """vLLM's create_model_runner_output: a token (EOS if use_eos) for each scheduled request
    that reaches its end, and the connector's report."""
    mro = runner_output(out, EOS_TOKEN_ID if use_eos else 1000)
    mro.kv_connector_output = KVConnectorOutput(finished_recving=set(finished_recving),
                                                failed_recving=set(failed_recving))
    return mro


def step(sched, **kwargs):
    out = sched.schedule()
    touched = sched.update_from_output(out, runner(out, **kwargs))
    return out, touched


def blocks_of(sched, rid):
    return sched.kv_cache_manager.req_to_blocks.get(rid, [])


def assert_scheduler_empty(sched):
    """vLLM's assert_scheduler_empty: no request, no transfer state, every block free."""
    assert not sched.waiting and not sched.running
    assert not sched.finished_recving_kv_req_ids and not sched.failed_recving_kv_req_ids
    kv = sched.kv_cache_manager
    assert not kv.req_to_blocks and not kv.num_registered_blocks
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    kv.check_invariants()


# =================================================================================================
# test_remote_prefill_lifecycle.py
# =================================================================================================
def test_basic_lifecycle():
    """RP test_basic_lifecycle: 2.5 blocks, computed remotely."""
    conn = RemotePrefill(remote={"id-1"})
    sched = make_scheduler(conn)
    pool = sched.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    num_tokens = int(BLOCK * 2.5)
    request = create_request(1, num_tokens)
    sched.add_request(request)

    # (1) Nothing runs; the request waits for its K/V with (unkeyed) blocks allocated.
    out = sched.schedule()
    assert not sched.running and not out.scheduled_new_reqs and not out.scheduled
    assert out.total_num_scheduled_tokens == 0
    assert list(sched.waiting) == [request]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # vLLM's test copy expects 0 here; 0.33.0 sets the count to the tokens being loaded at
    # admission (Scheduler.schedule: "Set num_computed_tokens even though KVs are not yet
    # loaded"), and so does kvlab.
    assert request.num_computed_tokens == num_tokens
    assert pool.get_num_free_blocks() < free_at_start
    assert not pool.cached_block_hash_to_block
    assert all(blk.block_hash is None for blk in blocks_of(sched, "id-1"))
    assert not sched.update_from_output(out, runner(out))

    # (2) Still loading: nothing happens; then the worker reports the load done.
    out = sched.schedule()
    assert len(sched.waiting) == 1 and not sched.running
    sched.update_from_output(out, runner(out, finished_recving={"id-1"}))
    assert len(sched.waiting) == 1
    assert "id-1" in sched.finished_recving_kv_req_ids

    # (3) Scheduled now: its 2 full blocks are keyed, the rest of the prompt runs (here the
    # last token, since the remote engine sent the whole prompt).
    out = sched.schedule()
    assert len(sched.running) == 1
    blocks = blocks_of(sched, "id-1")
    assert all(blk.ref_cnt == 1 for blk in blocks)
    assert sum(blk.block_hash is not None for blk in blocks) == 2
    (new,) = out.scheduled_new_reqs
    assert out.num_scheduled_tokens["id-1"] == len(new.prompt_token_ids) - new.num_computed_tokens
    sched.update_from_output(out, runner(out))

    # (4) EOS.
    out, touched = step(sched, use_eos=True)
    sched.schedule()
    assert [r.request_id for r in touched] == ["id-1"] and touched[0].finish_reason == "stop"
    assert_scheduler_empty(sched)


def test_interleaved_lifecycle():
    """RP test_interleaved_lifecycle: a remote prefill beside two local requests."""
    conn = RemotePrefill(remote={"id-1"})
    sched = make_scheduler(conn)
    num_tokens = int(BLOCK * 2.5)
    remote, local_a, local_b = (create_request(i, num_tokens) for i in (1, 2, 3))

    sched.add_request(local_a)
    step(sched)
    assert len(sched.running) == 1

    sched.add_request(local_b)
    sched.add_request(remote)
    out, _ = step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 1
    assert [n.req_id for n in out.scheduled_new_reqs] == ["id-3"]
    assert set(out.num_scheduled_tokens) == {"id-2", "id-3"}

    for _ in range(2):  # K/V not arrived yet
        out, _ = step(sched)
        assert len(sched.running) == 2 and len(sched.waiting) == 1
        assert not out.scheduled_new_reqs and set(out.num_scheduled_tokens) == {"id-2", "id-3"}

    out = sched.schedule()  # K/V arrive with this step's output
    assert len(sched.running) == 2 and len(sched.waiting) == 1
    sched.update_from_output(out, runner(out, finished_recving={"id-1"}))

    out, _ = step(sched)  # the remote request joins
    assert len(sched.running) == 3 and not sched.waiting
    assert [n.req_id for n in out.scheduled_new_reqs] == ["id-1"]
    assert set(out.num_scheduled_tokens) == {"id-1", "id-2", "id-3"}

    step(sched, use_eos=True)
    sched.schedule()
    assert_scheduler_empty(sched)


def test_no_spurious_prefix_caching():
    """RP test_no_spurious_prefix_caching: blocks allocated for a load are not keyed, so a
    local request with the same prompt does not hit K/V that has not arrived."""
    conn = RemotePrefill(remote={"id-1"})
    sched = make_scheduler(conn)
    num_tokens = int(BLOCK * 2.5)
    remote = create_request(1, num_tokens, all_ones=True)
    local = create_request(2, num_tokens, all_ones=True)

    sched.add_request(remote)
    out = sched.schedule()
    sched.update_from_output(out, runner(out))
    assert len(sched.waiting) == 1

    sched.add_request(local)
    out = sched.schedule()
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit on the remote's blocks
    local_blocks, remote_blocks = blocks_of(sched, "id-2"), blocks_of(sched, "id-1")
    assert all(blk.ref_cnt == 1 for blk in local_blocks + remote_blocks)
    assert sum(blk.block_hash is not None for blk in local_blocks) > 0
    assert all(blk.block_hash is None for blk in remote_blocks)


def test_full_block_prompt():
    """RP test_full_block_prompt: a prompt of exactly 2 blocks, all remote: the last token is
    computed again for its logits, in the blocks already held."""
    conn = RemotePrefill(remote={"id-1"})
    sched = make_scheduler(conn)
    num_tokens = 2 * BLOCK
    request = create_request(1, num_tokens)
    sched.add_request(request)

    out = sched.schedule()
    assert len(blocks_of(sched, "id-1")) == 2
    sched.update_from_output(out, runner(out))

    out = sched.schedule()
    sched.update_from_output(out, runner(out, finished_recving={"id-1"}))
    assert len(sched.waiting) == 1 and "id-1" in sched.finished_recving_kv_req_ids

    out = sched.schedule()
    assert len(blocks_of(sched, "id-1")) == 2
    assert out.scheduled_new_reqs[0].num_computed_tokens == num_tokens - 1
    assert out.num_scheduled_tokens["id-1"] == 1
    sched.update_from_output(out, runner(out))

    _, touched = step(sched, use_eos=True)
    sched.schedule()
    assert touched[0].finish_reason == "stop"
    assert_scheduler_empty(sched)


def test_cannot_schedule_after_recv():
    """RP test_cannot_schedule_after_recv: 5 usable blocks. The remote request, loaded, runs,
    then is preempted for its decode block; it comes back with its 2 blocks from the pool."""
    conn = RemotePrefill(remote={"id-2"})
    sched = make_scheduler(conn, num_blocks=6)
    num_tokens = 2 * BLOCK
    normal, remote = create_request(1, num_tokens), create_request(2, num_tokens)

    sched.add_request(normal)  # 1: 2 prompt blocks (+1 at the next decode)
    step(sched)
    assert len(sched.running) == 1 and not sched.waiting

    sched.add_request(remote)  # 2: 5 blocks in use (2 for the remote request)
    step(sched)
    assert len(sched.running) == 1 and len(sched.waiting) == 1

    step(sched, finished_recving={"id-2"})  # 3: received, 5 blocks in use
    assert len(sched.running) == 1 and len(sched.waiting) == 1

    step(sched)  # 4: the remote request runs (its last prompt token)
    assert len(sched.running) == 2 and not sched.waiting

    out, _ = step(sched)  # 5: it needs a block for its next token: preempted
    assert [r.request_id for r in out.preempted] == ["id-2"]
    assert len(sched.running) == 1 and len(sched.waiting) == 1

    step(sched, use_eos=True)  # 6: the other ends
    assert not sched.running and len(sched.waiting) == 1

    out, _ = step(sched)  # 7: back, with its 2 prompt blocks found in the pool
    assert out.num_computed_tokens["id-2"] == 2 * BLOCK
    assert len(sched.running) == 1 and not sched.waiting

    step(sched, use_eos=True)  # 8
    sched.schedule()
    assert_scheduler_empty(sched)


def test_cannot_recv():
    """RP test_cannot_recv: no room for the remote blocks: no transfer starts until there is."""
    conn = RemotePrefill(remote={"id-2"})
    sched = make_scheduler(conn, num_blocks=6)
    normal = create_request(1, 2 * BLOCK)
    remote = create_request(2, int(BLOCK * 2.5))

    sched.add_request(normal)
    step(sched)
    assert len(sched.running) == 1 and not sched.waiting

    sched.add_request(remote)  # needs 3 blocks, 2 are free
    step(sched)
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    assert remote.status != RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not conn.allocs[1:]  # only the normal request was admitted

    step(sched, use_eos=True)
    assert not sched.running and len(sched.waiting) == 1

    step(sched)  # the transfer starts now
    assert not sched.running and len(sched.waiting) == 1
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    step(sched, finished_recving={"id-2"})
    assert not sched.running and len(sched.waiting) == 1

    step(sched)
    assert len(sched.running) == 1 and not sched.waiting

    step(sched, use_eos=True)
    sched.schedule()
    assert_scheduler_empty(sched)


# =================================================================================================
# test_kv_load_failure_recovery.py (per-request failures: kvlab's connectors report those)
# =================================================================================================
def three_loading_requests(policy):
    num_prompt, num_external = 100 * BLOCK, 99 * BLOCK
    reqs = [create_request(i, num_prompt) for i in (1, 2, 3)]
    conn = RemotePrefill(remote={r.request_id for r in reqs},
                         matches={r.request_id: num_external for r in reqs})
    sched = make_scheduler(conn, failure_policy=policy, max_num_batched_tokens=num_external * 3)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert not sched.running and len(sched.waiting) == 3
    for r in reqs:
        assert r.num_computed_tokens == num_external
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(conn.lookups) == 3
    return sched, conn, reqs, out


def test_async_load_failure():
    """LF test_async_load_failure, with request2's load failing as a whole (vLLM's
    failed_recving form; its invalid_block_ids form is in NOT_PORTED). Policy "recompute":
    request2 stays queued, marked failed; at the next step it gives its blocks back and is
    looked up again, while the others run from their loaded K/V."""
    sched, conn, (r1, r2, r3), out = three_loading_requests("recompute")
    sched.update_from_output(out, runner(out, finished_recving={"id-1", "id-3"},
                                         failed_recving={"id-2"}))
    assert len(sched.waiting) == 3 and not sched.running
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in (r1, r2, r3))
    assert sched.failed_recving_kv_req_ids == {"id-2"}
    assert sched.num_kv_load_failures == 1
    assert len(conn.lookups) == 3

    out = sched.schedule()
    # 0.33.0 (_handle_failed_recving): the failed request's computed tokens go back to 0 and
    # its blocks are freed; it is admitted again after a fresh lookup (the connector no longer
    # offers it: NIXL's do_remote_prefill was cleared), computing from its first token.
    assert len(conn.lookups) == 4 and conn.lookups[-1] == ("id-2", 0)
    assert out.num_computed_tokens == {"id-1": 99 * BLOCK, "id-2": 0, "id-3": 99 * BLOCK}
    assert out.num_scheduled_tokens["id-1"] == out.num_scheduled_tokens["id-3"] == BLOCK
    assert not sched.failed_recving_kv_req_ids and not sched.finished_recving_kv_req_ids
    sched.kv_cache_manager.check_invariants()


def test_src_async_load_failure_fails_the_request_by_default():
    """LF's failure-policy cases, 0.33.0's default policy "fail" (vllm/config/kv_transfer.py;
    Scheduler.update_from_output finishes the requests _handle_failed_recving returns with
    FINISHED_ERROR): request2 ends with an error, its blocks come back; the others run."""
    sched, conn, (r1, r2, r3), out = three_loading_requests("fail")
    touched = sched.update_from_output(out, runner(out, finished_recving={"id-1", "id-3"},
                                                   failed_recving={"id-2"}))
    assert touched == [r2] and r2.finish_reason == "error" and r2.is_finished
    assert not blocks_of(sched, "id-2") and "id-2" in conn.finished
    assert sched.num_kv_load_failures == 1
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"id-1", "id-3"}
    assert len(conn.lookups) == 3
    sched.kv_cache_manager.check_invariants()


def test_async_load_deadlock_head_of_line_blocking():
    """LF test_async_load_deadlock_head_of_line_blocking (the newer test reaches the state by
    hand; here kvlab's own admission reaches it). 8 usable blocks: id-1 (4.5 blocks) loads 4
    and needs a 5th; id-2 (4 blocks) loads all 4. 0.33.0 admits id-2's load only if it fits
    beside what id-1 still needs, so both finish."""
    r1, r2 = create_request(1, int(BLOCK * 4.5)), create_request(2, 4 * BLOCK)
    conn = RemotePrefill(remote={"id-1", "id-2"}, matches={"id-1": 4 * BLOCK})
    sched = make_scheduler(conn, num_blocks=9)
    sched.add_request(r1)
    sched.add_request(r2)
    finished = set()
    for _ in range(40):  # every load reported done at once; every token sampled is EOS
        out = sched.schedule()
        loading = {r.request_id for r in sched.waiting
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
        touched = sched.update_from_output(out, runner(out, finished_recving=loading,
                                                       use_eos=True))
        finished |= {r.request_id for r in touched if r.is_finished}
        if finished == {"id-1", "id-2"}:
            break
    assert finished == {"id-1", "id-2"}
    assert_scheduler_empty(sched)


def test_src_in_flight_load_reserves_the_blocks_its_request_still_needs():
    """0.33.0 Scheduler.schedule (reserved_blocks = _inflight_prefill_reserved_blocks()): while
    a request waits for its load, the blocks it still needs to run its prompt are held back
    from every other admission. 8 usable blocks: id-1 (4.5 blocks) loads 4 and needs a 5th;
    id-2 (a local 4-block prompt, budget and seats to spare) would fit the 4 free blocks only
    by taking that 5th: it is not admitted while the load is in flight, id-1 gets its block
    once loaded, and id-2 runs when blocks come back."""
    r1, r2 = create_request(1, int(BLOCK * 4.5)), create_request(2, 4 * BLOCK)
    conn = RemotePrefill(remote={"id-1"}, matches={"id-1": 4 * BLOCK})
    sched = make_scheduler(conn, num_blocks=9)
    pool = sched.kv_cache_manager.block_pool
    sched.add_request(r1)
    sched.add_request(r2)

    # 1: id-1 holds 4 blocks for its load; the 4 free blocks would cover id-2's whole prompt,
    # but one of them is id-1's.
    out, _ = step(sched)
    assert r1.status == RequestStatus.WAITING_FOR_REMOTE_KVS and len(blocks_of(sched, "id-1")) == 4
    assert pool.get_num_free_blocks() == 4 and not out.scheduled
    assert r2.status == RequestStatus.WAITING and not blocks_of(sched, "id-2")
    assert [a[0] for a in conn.allocs] == ["id-1"]

    # 2: the load is still in flight: the reservation still holds; the load is reported done.
    out, _ = step(sched, finished_recving={"id-1"})
    assert not out.scheduled and not blocks_of(sched, "id-2") and pool.get_num_free_blocks() == 4

    # 3: id-1 runs the rest of its prompt in its 5th block; 3 blocks left: id-2 still waits.
    out, touched = step(sched, use_eos=True)
    assert out.num_scheduled_tokens == {"id-1": BLOCK // 2} and len(out.block_ids["id-1"]) == 5
    assert [r.request_id for r in touched] == ["id-1"] and r1.finish_reason == "stop"
    assert r2.status == RequestStatus.WAITING and not blocks_of(sched, "id-2")

    # 4: id-1's blocks are back: id-2 runs.
    out, _ = step(sched, use_eos=True)
    assert out.num_scheduled_tokens == {"id-2": 4 * BLOCK}
    sched.schedule()
    assert_scheduler_empty(sched)


@pytest.mark.xfail(strict=True, reason=(
    "kvlab differs from 0.33.0: a request holding loaded blocks waits in the one waiting "
    "queue in priority order, so a newer higher-priority request is admitted before it; "
    "0.33.0 drains kv_holding_waiting first"))
def test_priority_scheduling_promotes_async_loads_behind_new_request():
    """LF test_priority_scheduling_promotes_async_loads_behind_new_request: two requests have
    loaded their K/V (holding blocks); a new request of a better priority arrives; 2 seats: the
    two loaded requests run, the newcomer waits (0.33.0 Scheduler.schedule: requests holding
    KV blocks are always drained first)."""
    loading = [create_request(i, 2 * BLOCK) for i in (1, 2)]
    for prio, r in enumerate(loading, start=1):
        r.priority = prio
    conn = RemotePrefill(remote={"id-1", "id-2"}, matches={"id-1": BLOCK, "id-2": BLOCK})
    sched = make_scheduler(conn, max_num_seqs=2, failure_policy="recompute", policy="priority")
    for r in loading:
        sched.add_request(r)
    out = sched.schedule()
    assert not sched.running and len(conn.lookups) == 2
    sched.update_from_output(out, runner(out, finished_recving={"id-1", "id-2"}))

    newcomer = create_request(3, 2 * BLOCK)
    newcomer.priority = 0
    sched.add_request(newcomer)
    out = sched.schedule()
    assert {r.request_id for r in sched.running} == {"id-1", "id-2"}
    assert newcomer.status == RequestStatus.WAITING
    assert out.total_num_scheduled_tokens == 2 * BLOCK


# =================================================================================================
# test_cpu_manager.py: the tier's index (OffloadingConnector's scheduler side)
# =================================================================================================
def tier(num_slots: int, block_size: int = BLOCK) -> OffloadingConnector:
    config = KVTransferConfig(kv_connector="OffloadingConnector",
                              kv_connector_extra_config={"cpu_bytes_to_use": num_slots})
    return OffloadingConnector(config, KVConnectorRole.SCHEDULER, block_size, block_bytes=1)


def key(i: int) -> bytes:
    return str(i).encode()


def keys(*ints):
    return [key(i) for i in ints]


_ids = iter(range(1 << 30))


def fake_request(conn, *ints):
    """A request whose full prompt blocks have keys `ints` (pool block 100 + i holds key i)."""
    n = len(ints) * conn.block_size
    return types.SimpleNamespace(request_id=f"r{next(_ids)}", block_hashes=keys(*ints),
                                 num_tokens=n, num_prompt_tokens=n)


def run_meta(conn, scheduled=()):
    """The connector's build_connector_meta for a step that computed `scheduled` requests'
    whole prompts from token 0."""
    out = types.SimpleNamespace(
        scheduled=[(r, r.num_tokens) for r in scheduled],
        num_computed_tokens={r.request_id: 0 for r in scheduled},
        block_ids={r.request_id: [100 + int(k) for k in r.block_hashes] for r in scheduled})
    return conn.build_connector_meta(out)


def lookup(conn, *ints) -> int:
    """vLLM's manager.lookup: how many of these keys, from the first, the tier serves (asked
    through get_num_new_matched_tokens, and forgotten: the request is never admitted)."""
    req = fake_request(conn, *ints)
    n, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.request_finished(req, [])
    return n // conn.block_size


def store(conn, *ints, complete: bool = True):
    """vLLM's prepare_store + complete_store, through kvlab's hooks: a request of its own is
    admitted with nothing to load and computes its whole prompt in one step; the step's store
    job for it is returned (keys: its new slots, block_ids: the pool blocks written), or None
    when the store was refused (an allocation failure). With `complete` the worker then
    reports the write done (finished_stores, vLLM's complete_store); without it the slots
    stay pending until the caller reports them (`complete_store`)."""
    req = fake_request(conn, *ints)
    failures = conn.num_allocation_failures
    conn.update_state_after_alloc(req, [100 + i for i in ints], 0)
    meta = run_meta(conn, [req])
    conn.request_finished(req, [])
    if conn.num_allocation_failures > failures:
        assert not meta.stores
        return None
    (job,) = meta.stores or [types.SimpleNamespace(keys=[], block_ids=[])]
    assert set(job.keys) <= conn.pending_writes
    if complete:
        complete_store(conn, job)
    return job


def complete_store(conn, job, success: bool = True) -> None:
    """vLLM's complete_store(keys, success): the worker's report of a store job's write."""
    if job.keys:
        report = [list(job.keys)]
        conn.update_connector_output(KVConnectorOutput(finished_stores=report) if success
                                     else KVConnectorOutput(failed_stores=report))


def load(conn, *ints) -> str:
    """vLLM's prepare_load: a request that finds these keys in the tier is admitted to load
    them (the slots are pinned until the load is reported); returns its id."""
    req = fake_request(conn, *ints)
    assert conn.get_num_new_matched_tokens(req, 0) == (req.num_tokens, True)
    conn.update_state_after_alloc(req, [200 + i for i in ints], req.num_tokens)
    assert [job.req_id for job in run_meta(conn).loads] == [req.request_id]
    return req.request_id


def stored(conn) -> set[bytes]:
    return set(conn.index)


def test_cpu_manager():
    """CM test_cpu_manager (LRU policy), on a tier of 4 blocks, each store or load by a
    request of its own. 0.33.0's LRUCachePolicy orders keys by request (the later request's
    are more recent) and within a request tails before heads; a load is a use
    (CPUOffloadingManager.prepare_load records a request access); vLLM's older test copy has
    a plain insertion-order LRU, and evicts [2, 3, 4] where 0.33.0 keeps the loaded head 2.
    A store's slots are pending from prepare_store to complete_store (the worker's
    finished_stores): not served by a lookup, not evicted."""
    conn = tier(4)
    job = store(conn, 1, 2, complete=False)
    assert job.block_ids == [101, 102] and sorted(job.keys) == [0, 1]
    assert lookup(conn, 1, 2) == 0  # not ready
    complete_store(conn, job)
    assert not conn.pending_writes
    assert lookup(conn, 1) == 1 and lookup(conn, 1, 2) == 2 and lookup(conn, 1, 2, 3) == 2

    # [2, 3, 4, 5]: 2 is there (only refreshed), 3 new blocks, 2 free slots: evicts 1.
    job = store(conn, 2, 3, 4, 5, complete=False)
    assert job.block_ids == [103, 104, 105]
    assert stored(conn) == set(keys(2, 3, 4, 5))
    assert lookup(conn, 2, 3, 4) == 1  # 3 is still being written
    # [1, 6] needs 2 slots while [3, 4, 5] are being written: only 2 can be evicted: refused.
    assert store(conn, 1, 6) is None and conn.num_allocation_failures == 1
    assert stored(conn) == set(keys(2, 3, 4, 5))
    complete_store(conn, job)

    # A load of [2, 3] pins them: storing 3 more blocks finds only 2 to evict: refused.
    rid = load(conn, 2, 3)
    assert store(conn, 6, 7, 8) is None and conn.num_allocation_failures == 2
    assert stored(conn) == set(keys(2, 3, 4, 5))

    # The load completes: [6, 7, 8] evict 5 and 4 (b's, older), then the loaded request's
    # tail 3; its head 2 stays.
    conn.update_connector_output(KVConnectorOutput(finished_recving={rid}))
    job = store(conn, 6, 7, 8)
    assert job.block_ids == [106, 107, 108]
    assert stored(conn) == set(keys(2, 6, 7, 8))

    # A re-offer refreshes [6, 7]; one more block evicts 2, the least recently used.
    assert store(conn, 6, 7).keys == []
    store(conn, 9)
    assert stored(conn) == set(keys(6, 7, 8, 9))

    # [7, 10]: 7 belongs to the offer; 8 (older than 6 and 9) makes room. The write of 10
    # fails (vLLM: complete_store(success=False)): 10 is gone, 7 stays.
    job = store(conn, 7, 10, complete=False)
    assert job.block_ids == [110] and stored(conn) == set(keys(6, 7, 9, 10))
    complete_store(conn, job, success=False)
    assert lookup(conn, 7) == 1 and lookup(conn, 10) == 0
    assert conn.num_store_failures == 1 and stored(conn) == set(keys(6, 7, 9))
    assert not conn.pending_writes


def test_already_stored_block_not_evicted_during_prepare_store():
    """CM test_already_stored_block_not_evicted_during_prepare_store: store [1, 2]; touch 1
    (2 is now the least recent); store [2, 3, 4, 5]: 2 belongs to the offer and must stay,
    1 is evicted instead."""
    conn = tier(4)
    store(conn, 1, 2)
    assert store(conn, 1).keys == []  # touch
    job = store(conn, 2, 3, 4, 5)
    assert job.block_ids == [103, 104, 105]
    assert stored(conn) == set(keys(2, 3, 4, 5))
    assert lookup(conn, 2) == 1


def test_src_store_refused_when_the_offer_itself_fills_the_tier():
    """0.33.0 CPUOffloadingManager.prepare_store: the keys of the offer are protected from
    eviction; when only they could be evicted, the store returns None (an allocation failure,
    vllm:kv_offload_allocation_failure) and nothing changes."""
    conn = tier(3)
    store(conn, 1, 2)
    assert store(conn, 1, 2, 3, 4) is None
    assert stored(conn) == set(keys(1, 2)) and conn.num_allocation_failures == 1
    assert store(conn, 5, 6, 7, 8) is None  # larger than the tier: refused outright
    assert conn.num_allocation_failures == 2


def test_src_lookup_misses_a_store_not_yet_completed():
    """CM test_cpu_manager's 'lookup [1, 2] -> not ready' step: between prepare_store and
    complete_store a key is not served (0.33.0 CPUOffloadingManager.lookup stops at the first
    block that is not ready), so a request never loads a block whose write is unconfirmed;
    the worker's finished_stores makes it servable."""
    conn = tier(4)
    job = store(conn, 1, 2, complete=False)  # planned; the worker has not reported the write
    assert lookup(conn, 1, 2) == 0 and lookup(conn, 1) == 0
    complete_store(conn, job)
    assert lookup(conn, 1, 2) == 2


def test_src_lru_evicts_a_requests_tail_before_its_head():
    """0.33.0 vllm/v1/kv_offload/cpu/policies/lru.py: "ordered by token position so tails
    precede heads". Tier of 3: a's 2 blocks, then b's 1; c's block evicts one: a's tail, so a
    still hits its first block."""
    conn = tier(3)
    store(conn, 1, 2)  # a: head 1, tail 2
    store(conn, 3)  # b
    store(conn, 4)  # c
    assert stored(conn) == set(keys(1, 3, 4))
    assert lookup(conn, 1, 2) == 1


# =================================================================================================
# The offloading connector in the scheduler (test_scheduler.py / test_offloading_connector.py)
# =================================================================================================
class Worker:
    """The worker side reduced to what the scheduler sees: every load and store succeeds at
    once, is recorded (pool block ids), and is reported (finished_recving, finished_stores)."""

    def __init__(self):
        self.loaded: list[list[int]] = []
        self.stored: list[list[int]] = []

    def __call__(self, out) -> KVConnectorOutput:
        meta = out.kv_connector_metadata
        self.loaded += [job.block_ids for job in meta.loads]
        self.stored += [job.block_ids for job in meta.stores if job.keys]
        return KVConnectorOutput(finished_recving={job.req_id for job in meta.loads},
                                 finished_stores=[list(job.keys) for job in meta.stores
                                                  if job.keys])


def offload_step(sched, worker, use_eos=False):
    out = sched.schedule()
    mro = runner_output(out, EOS_TOKEN_ID if use_eos else 1000)
    mro.kv_connector_output = worker(out)
    touched = sched.update_from_output(out, mro)
    return out, touched


def offloading_scheduler(tier_blocks=64, block_size=4, **kwargs):
    conn = tier(tier_blocks, block_size)
    sched = make_scheduler(conn, block_size=block_size, **kwargs)
    return sched, conn, Worker()


def test_offloading_connector():
    """OC (test_offloading_connector, prompt-only as 0.33.0's default offload_prompt_only):
    full prompt blocks are stored as the steps complete them, a block short of one token is
    not; decode blocks never; a request differing in its last block stores only that block;
    after the pool forgets, the whole prompt comes back from the tier."""
    sched, conn, worker = offloading_scheduler(max_num_batched_tokens=6, max_num_seqs=4)
    prompt = [7] * 12  # 3 blocks of 4
    r1 = create_request(1, 12, block_size=4, prompt=prompt)
    sched.add_request(r1)
    ids = lambda rid: [b.block_id for b in blocks_of(sched, rid)]  # noqa: E731

    offload_step(sched, worker)  # tokens 0-5: block 0 full, block 1 short of 2 tokens
    assert worker.stored == [ids("id-1")[:1]]
    offload_step(sched, worker)  # tokens 6-11: blocks 1 and 2
    assert worker.stored[1:] == [ids("id-1")[1:3]]
    for _ in range(5):  # decode: nothing more stored (prompt only)
        offload_step(sched, worker)
    assert len(worker.stored) == 2 and conn.num_stored_blocks == 3
    r1_keys = list(r1.block_hashes[:3])
    offload_step(sched, worker, use_eos=True)
    assert not sched.running

    # Differs only in its last token: the first 2 blocks (pool hits) are already in the tier.
    r2 = create_request(2, 12, block_size=4, prompt=prompt[:-1] + [8])
    assert r2.block_hashes[:2] == r1_keys[:2] and r2.block_hashes[2] != r1_keys[2]
    sched.add_request(r2)
    out, _ = offload_step(sched, worker)
    assert out.num_computed_tokens["id-2"] == 8  # the pool's hit
    assert worker.stored[-1] == ids("id-2")[2:3] and conn.num_stored_blocks == 4
    offload_step(sched, worker, use_eos=True)
    while sched.running:
        offload_step(sched, worker, use_eos=True)

    # The pool forgets; the tier serves r1's whole prompt (the last token computed again).
    assert sched.reset_prefix_cache()
    r3 = create_request(3, 12, block_size=4, prompt=prompt)
    sched.add_request(r3)
    out, _ = offload_step(sched, worker)
    assert not out.scheduled and r3.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert worker.loaded == [ids("id-3")]
    stores_before = len(worker.stored)
    out, _ = offload_step(sched, worker)
    assert out.num_computed_tokens == {"id-3": 11} and out.num_scheduled_tokens == {"id-3": 1}
    assert len(worker.stored) == stores_before  # all 3 blocks were there already
    while sched.running or sched.waiting:
        offload_step(sched, worker, use_eos=True)
    assert_scheduler_empty(sched)


def test_request_preemption():
    """OCOLD test_request_preemption (prompt only): a preempted request whose prompt blocks the
    pool lost comes back with them loaded from the tier; its decode blocks are computed.
    6 usable blocks of 4 tokens; two 8-token prompts generate 12 tokens each: id-2 (the
    newest) is preempted when both need their 4th block, id-1 grows into id-2's freed blocks
    (the pool evicts a freed request's tail first, so id-2's first block survives, its second
    does not), and when id-2 returns the pool gives 1 block and the tier the other."""
    sched, conn, worker = offloading_scheduler(num_blocks=7, max_num_batched_tokens=64)
    for i in (1, 2):
        sched.add_request(create_request(i, 8, block_size=4, max_tokens=12, ignore_eos=True))
    preempted, loads = [], []
    for _ in range(40):
        out, _ = offload_step(sched, worker)
        preempted += [r.request_id for r in out.preempted]
        if len(worker.loaded) > len(loads):  # a load this step: into which of id-2's blocks
            table = [b.block_id for b in blocks_of(sched, "id-2")]
            loads += [[table.index(b) for b in ids] for ids in worker.loaded[len(loads):]]
        if not sched.running and not sched.waiting:
            break
    assert preempted == ["id-2"]
    assert sched.kv_cache_manager.prefix_cache_preempted_hits == 4
    assert sched.external_prefix_cache_preempted_hits == 4
    assert sched.external_prefix_cache_hits == 0  # first admissions: the tier was empty
    assert loads == [[1]]
    assert conn.num_stored_blocks == 4  # the 2 prompt blocks of each, nothing else
    assert_scheduler_empty(sched)


# =================================================================================================
# What was not ported, and why
# =================================================================================================
_NEWER = ("newer than 0.33.0: its scheduler does not count asynchronous loads toward the "
          "seats or the token budget (Scheduler.schedule admits a load with num_new_tokens 0 "
          "and leaves it out of self.running)")
_BLOCKS = ("block-level load failures (KVConnectorOutput.invalid_block_ids): kvlab's "
           "connectors report failures per request (failed_recving) only")
_SYNC = "synchronous external loads: every kvlab connector loads asynchronously"
NOT_PORTED = (
    ("test_async_loads_count_toward_active_request_limit", LF, _NEWER),
    ("test_async_loads_count_toward_token_budget", LF, _NEWER),
    ("test_large_async_load_is_limited_by_token_budget", LF, _NEWER),
    ("test_in_flight_async_loads_limit_later_async_admission", LF, _NEWER),
    ("test_sync_load_failure", LF, _SYNC + "; " + _BLOCKS),
    ("test_sync_load_failure_with_shared_blocks", LF, _SYNC + "; " + _BLOCKS),
    ("test_async_progressive_load_failure", LF, _BLOCKS),
    ("test_block_level_load_failure_fails_closed_with_multiple_groups", LF,
     _BLOCKS + "; and kvlab refuses a connector on a multi-group (hybrid) model"),
    ("test_arc_manager_basic", CM, "ARC eviction policy: kvlab's tier is LRU only"),
    ("test_arc_manager_t1_to_t2_promotion", CM, "ARC eviction policy"),
    ("test_arc_manager_eviction_with_load", CM, "ARC eviction policy"),
    ("test_arc_manager_adaptive_target", CM, "ARC eviction policy"),
    ("test_arc_manager_t1_t2_eviction_policy", CM, "ARC eviction policy"),
    ("test_arc_manager_ghost_list_bounds", CM, "ARC eviction policy"),
    ("test_arc_manager_touch_ordering", CM, "ARC eviction policy"),
    ("test_cpu_manager (events)", CM, "offloading KV events (BlockStored/BlockRemoved with a "
     "medium): kvlab's connectors publish none"),
    ("test_swa_offload_window_covers_unaligned_hit", OC, "sliding-window groups: kvlab refuses "
     "a connector on a hybrid model"),
    ("test_partial_tail_store_uses_attention_and_recurrent_cow_sources", OC,
     "partial-tail and Mamba stores: kvlab stores full blocks of one attention group"),
    ("test_aligned_boundary_store_uses_exact_source_with_partial_tail", OC, "as above"),
    ("test_aligned_boundary_store_maps_sparse_group_id_to_dense_transfer_slot", OC, "as above"),
    ("test_aligned_boundary_store_flushes_before_block_reuse", OC,
     "store flushing before a GPU block is reused: kvlab's stores finish in their own step"),
    ("test_normal_store_excludes_align_mode_mamba_sources", OC, "Mamba groups"),
    ("test_partial_lookup_returns_exact_boundary_and_group_load_keys", OC, "partial-tail "
     "lookups: kvlab hits whole blocks"),
    ("test_create_req_context_preserves_kv_hints", OC, "KV hints: kvlab has none"),
    ("test_offloading_connector (blocks spanning several GPU blocks, take_events)", OCOLD,
     "kvlab's tier block is one pool block; no offloading events"),
)


def test_not_ported_list_is_well_formed():
    check_not_ported(NOT_PORTED, globals())

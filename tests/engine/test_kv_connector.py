"""KV beyond the pool (chapter 10) on the real model: the offloading tier behind the pool
(`kv_offloading_size`, vLLM's OffloadingConnector) and the ExampleConnector that two engines
share for disaggregated prefill (kvlab/kv_transfer/).

Every tier test runs the same workload on an engine with the tier and on one without it, same
knobs otherwise, and asserts the greedy tokens are equal, and that the tier did the work the
test is about (its counters in `llm.stats()`, under vLLM's metric names). The pool is kept
small so that its own prefix cache loses what the tier must then supply.
"""

from __future__ import annotations

import pytest
from tests import helpers

from kvlab import LLM, SamplingParams
from kvlab.kv_transfer.offloading_connector import OffloadingConnector
from kvlab.request import RequestStatus

BLOCK = 16
PERIOD = 55  # text_ids repeats every ~55 tokens: prompts start at offsets within one period


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def block_bytes():
    """One pool block across every layer, the tier's unit (read off an engine with a tier)."""
    llm = LLM(block_size=BLOCK, kv_cache_tokens=64, max_model_len=64, kv_offloading_size=0.001)
    return llm.llm_engine.kv_connector.block_bytes


@pytest.fixture(scope="module")
def gib(block_bytes):
    """kv_offloading_size (GiB) for a tier of exactly n blocks."""
    return lambda n: (n + 0.5) * block_bytes / (1 << 30)


def prompts(text_ids, lengths, offsets=(0, 7, 13, 21, 29, 37, 44, 50)):
    """Prompts with pairwise different first blocks (so no two share a prefix-cache key)."""
    ps = [list(text_ids[o: o + n]) for o, n in zip(offsets, lengths)]
    firsts = [tuple(p[:BLOCK]) for p in ps]
    assert len(set(firsts)) == len(firsts)
    return ps


def make(tier_blocks=None, *, gib=None, policy=None, **kwargs) -> LLM:
    args = dict(block_size=BLOCK, kv_cache_tokens=128, max_model_len=128, debug_checks=True)
    args.update(kwargs)
    if tier_blocks is not None:
        if policy is None:
            args["kv_offloading_size"] = gib(tier_blocks)
        else:  # the policy needs kv_transfer_config, which then names the tier's bytes itself
            size = int(gib(tier_blocks) * (1 << 30))
            args["kv_transfer_config"] = {
                "kv_connector": "OffloadingConnector", "kv_load_failure_policy": policy,
                "kv_connector_extra_config": {"cpu_bytes_to_use": size}}
    llm = LLM(**args)
    if tier_blocks is not None:
        assert llm.stats()["kv_offload_tier_blocks"] == tier_blocks
    return llm


def tokens(llm: LLM, ps, n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(n))
    return [o.outputs[0].token_ids for o in outs]


def assert_no_blocks_held(llm: LLM) -> None:
    """tests.helpers' check (no request, every block free), and no transfer state left in the
    tier: no slot pinned by a load, none pending a write the worker never reported."""
    helpers.assert_no_blocks_held(llm)
    conn = llm.llm_engine.kv_connector
    if isinstance(conn, OffloadingConnector):
        assert not conn.pending_writes, sorted(conn.pending_writes)
        assert not any(conn.pinned.values()) and not conn._loading
    sched = llm.llm_engine.scheduler
    assert not sched.finished_recving_kv_req_ids and not sched.failed_recving_kv_req_ids


def run_steps(engine, max_steps: int = 200) -> dict:
    """Step an LLMEngine until it has nothing left (at most max_steps); finished outputs by id."""
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError(f"not done after {max_steps} steps: "
                         f"{[(r.request_id, r.status.value) for r in engine.scheduler.waiting]}")


# =================================================================================================
# The tier supplies what the pool lost: tokens unchanged
# =================================================================================================
def evicted_prefix_workload(text_ids):
    """Phase 1 runs prefix+s1; phases 2-4 run three unrelated prompts one after the other,
    which take every block of the 8-block pool (evicting the prefix's cached blocks); phase 5
    runs prefix+s2: the pool has nothing of the prefix, the tier has its 4 full blocks."""
    prefix = list(text_ids[:64])
    s1, s2 = list(text_ids[100:110]), list(text_ids[120:131])
    qs = prompts(text_ids, [60, 60, 60], offsets=(7, 21, 37))
    return [[prefix + s1]] + [[q] for q in qs] + [[prefix + s2]]


def run_phases(llm, phases, n=4):
    return [tokens(llm, ps, n) for ps in phases]


@pytest.mark.parametrize("backend,async_scheduling,budget", [
    ("auto", True, None), ("auto", False, None), ("auto", True, 24), ("auto", False, 24),
    ("reference", True, 24), ("reference", False, None)])
def test_tier_supplies_the_evicted_prefix_and_tokens_are_unchanged(
        text_ids, gib, backend, async_scheduling, budget):
    """A budget of 24 tokens splits every prompt in chunks that end mid-block."""
    kw = dict(backend=backend, async_scheduling=async_scheduling,
              max_num_batched_tokens=budget)
    phases = evicted_prefix_workload(text_ids)
    plain = run_phases(make(**kw), phases)
    llm = make(20, gib=gib, **kw)
    got = run_phases(llm, phases[:-1])
    before = llm.stats()
    got.append(tokens(llm, phases[-1], 4))
    after = llm.stats()
    assert got == plain
    # The last phase: no pool hit at all, 4 blocks from the tier.
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
    assert (after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
            == 4 * BLOCK)
    assert after["kv_offload_load_bytes"] - before["kv_offload_load_bytes"] == 4 * (
        llm.llm_engine.kv_connector.block_bytes)
    assert after["kv_load_failures"] == 0
    assert_no_blocks_held(llm)


def test_tier_with_prefix_caching_off_still_supplies_prefixes(text_ids, gib):
    """The connector keys blocks by their prefix-cache keys with the pool's cache off too."""
    prefix = list(text_ids[:48])
    ps = [[prefix + list(text_ids[100:105])], [prefix + list(text_ids[110:117])]]
    kw = dict(enable_prefix_caching=False, async_scheduling=False)
    plain = run_phases(make(**kw), ps)
    llm = make(10, gib=gib, **kw)
    assert run_phases(llm, ps) == plain
    s = llm.stats()
    assert s["prefix_cache_hits"] == 0 and s["external_prefix_cache_hits"] == 3 * BLOCK
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preempted_request_is_restored_from_the_tier(text_ids, gib, async_scheduling):
    """Three 48-token prompts in a 12-block pool, 60 tokens each: the newest is preempted, the
    others grow into its freed blocks (evicting its cached prompt blocks), and when it resumes
    the tier gives them back (preempted hits), tokens unchanged."""
    ps = prompts(text_ids, [48, 48, 48])
    kw = dict(kv_cache_tokens=192, max_model_len=160, async_scheduling=async_scheduling)
    plain = tokens(make(**kw), ps, 60)
    llm = make(14, gib=gib, **kw)
    assert tokens(llm, ps, 60) == plain
    s = llm.stats()
    assert s["num_preemptions"] > 0
    assert s["external_prefix_cache_preempted_hits"] > 0 and s["kv_offload_load_bytes"] > 0
    assert s["external_prefix_cache_hits"] == 0  # first admissions: the tier was empty
    assert_no_blocks_held(llm)


# =================================================================================================
# The request's life: WAITING_FOR_REMOTE_KVS, blocks keyed only once loaded
# =================================================================================================
def test_request_waits_for_its_load_and_blocks_are_keyed_only_after(text_ids, gib):
    prefix = list(text_ids[:40])  # 2 full blocks and 8 tokens
    llm = make(10, gib=gib, async_scheduling=False)
    tokens(llm, [prefix], 1)  # the tier now holds the 2 full blocks
    assert llm.stats()["kv_offload_tier_blocks_used"] == 2
    assert llm.reset_prefix_cache()  # the pool forgets; the tier keeps (vLLM's default)
    engine = llm.llm_engine
    kv, sched = engine.kv_cache_manager, engine.scheduler
    pool = kv.block_pool
    engine.add_request("a", {"prompt_token_ids": prefix + [11, 12]}, greedy(3))
    engine.add_request("b", {"prompt_token_ids": prefix + [13, 14]}, greedy(3))

    engine.step()  # both admitted with 2 blocks each, to be loaded; nothing computed
    out = engine.last_scheduler_output
    assert out.scheduled == [] and len(out.kv_connector_metadata.loads) == 2
    waiting = {r.request_id: r for r in sched.waiting}
    assert set(waiting) == {"a", "b"} and not sched.running
    for rid, r in waiting.items():
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert r.num_computed_tokens == 2 * BLOCK
        blocks = kv.req_to_blocks[rid]
        assert len(blocks) == 2 and all(blk.block_hash is None for blk in blocks)
    # b's lookup did not find a's blocks: they hold no K/V yet (no spurious prefix hit).
    assert kv.prefix_cache_hits == 0 and not pool.cached_block_hash_to_block
    assert llm.stats()["external_prefix_cache_hits"] == 4 * BLOCK
    # The load ran with that step and was reported done; the blocks are keyed only when the
    # scheduler reads that report, at the next schedule.
    assert sched.finished_recving_kv_req_ids == {"a", "b"}
    assert all(blk.block_hash is None for blk in kv.req_to_blocks["a"])

    engine.step()
    assert not sched.finished_recving_kv_req_ids
    assert {r.request_id for r in sched.running} == {"a", "b"}
    assert engine.last_scheduler_output.num_computed_tokens == {"a": 32, "b": 32}
    assert engine.last_scheduler_output.num_scheduled_tokens == {"a": 10, "b": 10}
    for rid in ("a", "b"):
        assert all(blk.block_hash is not None for blk in kv.req_to_blocks[rid][:2])
    done = run_steps(engine)
    plain = tokens(make(async_scheduling=False), [prefix + [11, 12], prefix + [13, 14]], 3)
    assert [done["a"].outputs[0].token_ids, done["b"].outputs[0].token_ids] == plain
    assert_no_blocks_held(llm)


def test_whole_prompt_from_the_tier_leaves_its_last_token_to_compute(text_ids, gib):
    """A prompt of exactly 3 blocks: the pool (after a reset) has none, the tier all three; the
    scheduler computes the last token again for its logits, in the same block."""
    p = list(text_ids[:48])
    llm = make(10, gib=gib, async_scheduling=False)
    first = tokens(llm, [p], 4)
    assert llm.reset_prefix_cache()
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": p}, greedy(4))
    engine.step()
    (req,) = list(engine.scheduler.waiting)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 48
    engine.step()
    assert engine.last_scheduler_output.num_computed_tokens == {"r": 47}
    assert engine.last_scheduler_output.num_scheduled_tokens == {"r": 1}
    assert len(engine.kv_cache_manager.req_to_blocks["r"]) == 3
    assert run_steps(engine)["r"].outputs[0].token_ids == first[0]
    assert_no_blocks_held(llm)


# =================================================================================================
# Failures
# =================================================================================================
def stored_then_reset(llm, prefix):
    tokens(llm, [prefix], 1)
    assert llm.reset_prefix_cache()


def failing_read(calls):
    def read(slots):
        calls.append(list(slots))
        raise OSError("tier read failed")
    return read


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_load_is_recomputed_under_the_recompute_policy(text_ids, gib, monkeypatch,
                                                              async_scheduling):
    prefix = list(text_ids[:64])
    p = prefix + list(text_ids[100:106])
    kw = dict(async_scheduling=async_scheduling)
    plain = tokens(make(**kw), [p], 5)
    llm = make(10, gib=gib, policy="recompute", **kw)
    stored_then_reset(llm, prefix)
    assert llm.stats()["kv_offload_tier_blocks_used"] == 4
    worker = llm.llm_engine.model_runner.kv_connector
    conn = llm.llm_engine.kv_connector
    calls, answers = [], []
    monkeypatch.setattr(worker.tier, "read", failing_read(calls))
    lookup = conn.get_num_new_matched_tokens
    monkeypatch.setattr(conn, "get_num_new_matched_tokens",
                        lambda r, n: answers.append(lookup(r, n)) or answers[-1])
    assert tokens(llm, [p], 5) == plain
    s = llm.stats()
    assert s["kv_load_failures"] == 1 and len(calls) == 1 and s["kv_offload_load_bytes"] == 0
    # The retry asked the tier again and found none of the slots that failed to read.
    assert answers == [(4 * BLOCK, True), (0, False)]
    assert not conn.pinned or not any(conn.pinned.values())
    assert_no_blocks_held(llm)
    llm.llm_engine.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_load_ends_the_request_under_the_fail_policy(text_ids, gib, monkeypatch,
                                                            async_scheduling):
    """vLLM's default policy: the request whose load failed ends with an error; a request beside
    it is untouched; the engine goes on."""
    prefix = list(text_ids[:64])
    p = prefix + list(text_ids[100:106])
    (other,) = prompts(text_ids, [40], offsets=(13,))
    kw = dict(async_scheduling=async_scheduling)
    plain_llm = make(**kw)
    plain_other = tokens(plain_llm, [other], 5)
    plain_p = tokens(plain_llm, [p], 5)
    llm = make(10, gib=gib, policy="fail", **kw)
    assert llm.llm_engine.scheduler.kv_load_failure_policy == "fail"
    stored_then_reset(llm, prefix)
    worker = llm.llm_engine.model_runner.kv_connector
    calls = []
    monkeypatch.setattr(worker.tier, "read", failing_read(calls))
    outs = llm.generate([{"prompt_token_ids": p}, {"prompt_token_ids": other}], greedy(5))
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].finished
    assert outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].token_ids == plain_other[0]
    assert outs[1].outputs[0].finish_reason == "length"
    assert llm.stats()["kv_load_failures"] == 1 and len(calls) == 1
    assert_no_blocks_held(llm)
    # Still usable; what failed to read is not offered again, so the prompt is computed.
    monkeypatch.undo()
    before = llm.stats()["external_prefix_cache_hits"]
    assert tokens(llm, [p], 5) == plain_p
    assert llm.stats()["external_prefix_cache_hits"] == before
    assert_no_blocks_held(llm)


def test_failed_store_is_counted_and_stores_nothing(text_ids, gib, monkeypatch):
    p = list(text_ids[:70])
    plain = tokens(make(async_scheduling=False), [p], 4)
    llm = make(10, gib=gib, async_scheduling=False)
    worker, conn = llm.llm_engine.model_runner.kv_connector, llm.llm_engine.kv_connector

    def write(slots, data):
        raise OSError("tier write failed")

    monkeypatch.setattr(worker.tier, "write", write)
    assert tokens(llm, [p], 4) == plain
    s = llm.stats()
    assert conn.num_store_failures == 1
    assert s["kv_offload_tier_blocks_used"] == 0 and s["kv_offload_store_bytes"] == 0
    monkeypatch.undo()
    assert llm.reset_prefix_cache()
    assert tokens(llm, [p], 4) == plain  # nothing in the tier to hit: computed again
    assert llm.stats()["external_prefix_cache_hits"] == 0
    assert llm.stats()["kv_offload_tier_blocks_used"] == 4  # stored this time
    assert_no_blocks_held(llm)


def test_failed_store_is_never_loaded_under_async_scheduling(text_ids, gib, monkeypatch):
    p = list(text_ids[:48])  # 3 blocks: the pool's hit stops at 2, the tier is asked for the 3rd
    plain = tokens(make(), [p], 6)
    llm = make(10, gib=gib, async_scheduling=True)
    engine = llm.llm_engine

    def write(slots, data):
        raise OSError("tier write failed")

    monkeypatch.setattr(engine.model_runner.kv_connector.tier, "write", write)
    engine.add_request("a", {"prompt_token_ids": p}, greedy(6))
    assert engine.step() == []  # scheduled and run; its report is not read yet
    engine.add_request("b", {"prompt_token_ids": p}, greedy(6))
    done = run_steps(engine)
    assert done["a"].outputs[0].token_ids == plain[0]
    assert llm.stats()["kv_offload_load_bytes"] == 0  # nothing was ever written to load
    assert done["b"].outputs[0].token_ids == plain[0]
    assert engine.kv_connector.num_store_failures >= 1
    assert_no_blocks_held(llm)


def failing_forward_with_a_load_and_a_store(llm, text_ids, monkeypatch):
    """One step that loads L's prefix from the tier and plans the store of S's 3 prompt blocks,
    whose forward raises (S's step fails; L was not scheduled in it, only loaded)."""
    from kvlab.engine import EngineStepError

    pl, q = list(text_ids[:40]), list(text_ids[13:61])
    stored_then_reset(llm, pl)
    engine = llm.llm_engine
    engine.add_request("L", {"prompt_token_ids": pl}, greedy(4))
    engine.add_request("S", {"prompt_token_ids": q}, greedy(4))

    def forward(sched):
        raise RuntimeError("forward failed")

    with monkeypatch.context() as m:
        m.setattr(engine.model_runner, "_execute", forward)
        with pytest.raises(EngineStepError):
            engine.step()
    return pl, q


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_load_of_a_step_whose_forward_failed_is_not_lost(text_ids, gib, monkeypatch,
                                                         async_scheduling):
    llm = make(10, gib=gib, async_scheduling=async_scheduling)
    pl, _ = failing_forward_with_a_load_and_a_store(llm, text_ids, monkeypatch)
    done = run_steps(llm.llm_engine, max_steps=30)
    assert done["L"].outputs[0].token_ids == tokens(make(async_scheduling=False), [pl], 4)[0]
    assert not any(llm.llm_engine.kv_connector.pinned.values())
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_stores_of_a_step_whose_forward_failed_are_not_kept(text_ids, gib, monkeypatch,
                                                            async_scheduling):
    llm = make(10, gib=gib, async_scheduling=async_scheduling)
    _, q = failing_forward_with_a_load_and_a_store(llm, text_ids, monkeypatch)
    engine = llm.llm_engine
    for rid in list(engine.parents):
        engine.abort_request(rid)
    assert llm.reset_prefix_cache()
    before = llm.stats()["external_prefix_cache_hits"]
    assert tokens(llm, [q], 4) == tokens(make(async_scheduling=False), [q], 4)
    assert llm.stats()["external_prefix_cache_hits"] == before
    assert_no_blocks_held(llm)


def test_abort_during_a_load_leaves_no_transfer_state(text_ids, gib):
    pl = list(text_ids[:40])
    llm = make(10, gib=gib, async_scheduling=True)
    stored_then_reset(llm, pl)
    engine = llm.llm_engine
    engine.add_request("L", {"prompt_token_ids": pl}, greedy(4))
    assert engine.step() == []  # the load is scheduled and run; its report is not read yet
    assert [r.status for r in engine.scheduler.waiting] == [RequestStatus.WAITING_FOR_REMOTE_KVS]
    engine.abort_request("L")
    run_steps(engine)
    assert not engine.scheduler.finished_recving_kv_req_ids
    assert not any(engine.kv_connector.pinned.values())
    assert_no_blocks_held(llm)


def test_tier_too_small_for_the_offer_counts_an_allocation_failure(text_ids, gib):
    """A 3-block tier holds a's 2 blocks; b shares them and offers 2 more: only 1 slot is free
    and the rest belong to b's own offer (protected), so nothing can be evicted: the store is
    dropped and counted; a's blocks stay."""
    prefix = list(text_ids[:32])
    a, b = prefix + list(text_ids[100:105]), prefix + list(text_ids[100:140])
    plain = run_phases(make(async_scheduling=False), [[a], [b]])
    llm = make(3, gib=gib, async_scheduling=False)
    got = [tokens(llm, [a], 4)]
    assert llm.stats()["kv_offload_tier_blocks_used"] == 2
    store_bytes = llm.stats()["kv_offload_store_bytes"]
    got.append(tokens(llm, [b], 4))
    assert got == plain
    s = llm.stats()
    assert s["kv_offload_allocation_failure"] == 1
    assert s["kv_offload_tier_blocks_used"] == 2 and s["kv_offload_store_bytes"] == store_bytes
    assert_no_blocks_held(llm)
    # a's blocks survived: after a reset, a's prompt is found in the tier.
    assert llm.reset_prefix_cache()
    before = s["external_prefix_cache_hits"]
    assert tokens(llm, [a], 4) == plain[0]
    assert llm.stats()["external_prefix_cache_hits"] - before == 2 * BLOCK


def test_prompt_larger_than_the_tier_is_dropped_and_counted(text_ids, gib):
    p = list(text_ids[:70])  # 4 full blocks offered at once (no chunking) to a 2-block tier
    plain = tokens(make(async_scheduling=False), [p], 3)
    llm = make(2, gib=gib, async_scheduling=False)
    assert tokens(llm, [p], 3) == plain
    s = llm.stats()
    assert s["kv_offload_allocation_failure"] == 1 and s["kv_offload_tier_blocks_used"] == 0
    assert s["kv_offload_store_bytes"] == 0


# =================================================================================================
# The tier's LRU, salts
# =================================================================================================
def run_each_cold(llm, ps, n=1):
    """Each prompt alone, the pool's prefix cache reset before it (only the tier remembers)."""
    out = []
    for p in ps:
        assert llm.reset_prefix_cache()
        out.append(tokens(llm, [p], n)[0])
    return out


def test_tier_smaller_than_a_cyclic_working_set_never_hits(text_ids, gib):
    p1, p2, p3 = prompts(text_ids, [40, 40, 40])  # 2 full blocks each; the tier holds 4
    llm = make(4, gib=gib, async_scheduling=False)
    run_each_cold(llm, [p1, p2, p3, p1, p2, p3])
    s = llm.stats()
    assert s["external_prefix_cache_hits"] == 0 and s["kv_offload_load_bytes"] == 0
    assert s["kv_offload_tier_blocks_used"] == 4


def test_tier_with_reuse_hits_and_never_writes_a_block_twice(text_ids, gib):
    p1, p2 = prompts(text_ids, [40, 40])
    llm = make(4, gib=gib, async_scheduling=False)
    bb = llm.llm_engine.kv_connector.block_bytes
    plain = run_each_cold(make(async_scheduling=False), [p1, p2], 3)
    assert run_each_cold(llm, [p1, p2], 3) == plain
    s = llm.stats()
    assert s["kv_offload_store_bytes"] == 4 * bb and s["external_prefix_cache_hits"] == 0
    assert run_each_cold(llm, [p1, p2, p1], 3) == plain + plain[:1]
    s = llm.stats()
    assert s["external_prefix_cache_hits"] == 3 * 2 * BLOCK
    assert s["kv_offload_load_bytes"] == 3 * 2 * bb
    assert s["kv_offload_store_bytes"] == 4 * bb  # already there: not written again


def test_lru_keeps_the_recently_used_prompt(text_ids, gib):
    """Tier of 4: p1, p2 fill it; p1 again (a hit, now most recent); p3 evicts p2, not p1."""
    p1, p2, p3 = prompts(text_ids, [40, 40, 40])
    llm = make(4, gib=gib, async_scheduling=False)
    run_each_cold(llm, [p1, p2, p1, p3])
    hits = llm.stats()["external_prefix_cache_hits"]
    assert hits == 2 * BLOCK
    run_each_cold(llm, [p1])
    assert llm.stats()["external_prefix_cache_hits"] == hits + 2 * BLOCK
    run_each_cold(llm, [p2])  # evicted
    assert llm.stats()["external_prefix_cache_hits"] == hits + 2 * BLOCK


def test_different_salts_never_share_tier_blocks(text_ids, gib):
    p = list(text_ids[:40])
    llm = make(10, gib=gib, async_scheduling=False)
    plain = tokens(make(async_scheduling=False), [p], 3)

    def run(salt):
        assert llm.reset_prefix_cache()
        prompt = {"prompt_token_ids": p} if salt is None else {"prompt_token_ids": p,
                                                                "cache_salt": salt}
        return llm.generate(prompt, greedy(3))[0].outputs[0].token_ids

    assert run("alice") == plain[0]
    assert run("bob") == plain[0]
    assert run(None) == plain[0]
    assert llm.stats()["external_prefix_cache_hits"] == 0
    assert llm.stats()["kv_offload_tier_blocks_used"] == 6
    assert run("bob") == plain[0]
    assert llm.stats()["external_prefix_cache_hits"] == 2 * BLOCK


# =================================================================================================
# Deadlock: two loads whose prompts cannot both finish
# =================================================================================================
def test_two_loads_that_cannot_both_finish_do_not_deadlock(text_ids, gib):
    """8-block pool. r1 (70 tokens) loads 4 blocks and needs a 5th; r2 (64 tokens) loads its
    4 blocks in the same step, taking the last free ones."""
    p1, p2 = prompts(text_ids, [70, 64], offsets=(0, 21))
    llm = make(10, gib=gib, async_scheduling=False)
    tokens(llm, [p1], 1)
    tokens(llm, [p2], 1)
    assert llm.reset_prefix_cache()
    engine = llm.llm_engine
    engine.add_request("r1", {"prompt_token_ids": p1}, greedy(2))
    engine.add_request("r2", {"prompt_token_ids": p2}, greedy(2))
    done = run_steps(engine, max_steps=40)
    assert set(done) == {"r1", "r2"}


# =================================================================================================
# Configuration refused before anything is allocated
# =================================================================================================
@pytest.fixture
def nothing_allocated(monkeypatch):
    """Fail loudly if the pool tensor or a tier file is made: a refusal must come first."""
    import kvlab.engine
    from kvlab.kv_transfer import tier

    def boom(*a, **k):
        raise AssertionError("allocated before the refusal")

    monkeypatch.setattr(kvlab.engine, "allocate_kv_cache", boom)
    monkeypatch.setattr(tier.SlotFile, "__init__", boom)
    monkeypatch.setattr(tier.BlockFolder, "__init__", boom)


OFFLOAD = {"kv_connector": "OffloadingConnector",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24}}


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_offloading_size=0), "kv_offloading_size"),
    (dict(kv_offloading_size=-1.0), "kv_offloading_size"),
    (dict(kv_offloading_size=True), "kv_offloading_size"),
    (dict(kv_offloading_size=float("inf")), "kv_offloading_size"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size"),
    (dict(kv_transfer_config={"kv_connector": "OffloadingConnector",
                              "kv_connector_extra_config": {"cpu_bytes_to_use": float("inf")}}),
     "cpu_bytes_to_use"),
    (dict(kv_offloading_size=0.01, kv_offloading_backend="lmcache"), "lmcache"),
    (dict(kv_offloading_size=0.01, kv_offloading_backend="disk"), "kv_offloading_backend"),
    (dict(kv_transfer_config={"kv_connector": "NixlConnector"}), "NixlConnector"),
    (dict(kv_transfer_config={**OFFLOAD, "kv_role": "kv_server"}), "kv_role"),
    (dict(kv_transfer_config={**OFFLOAD, "kv_load_failure_policy": "retry"}),
     "kv_load_failure_policy"),
    (dict(kv_transfer_config={**OFFLOAD, "kv_buffer_size": 1}), "unknown fields"),
    (dict(kv_transfer_config={"kv_connector": "OffloadingConnector"}), "cpu_bytes_to_use"),
    (dict(kv_transfer_config={"kv_connector": "ExampleConnector"}), "shared_storage_path"),
    (dict(kv_transfer_config={"kv_connector": "ExampleConnector",
                              "kv_connector_extra_config": {"shared_storage_path": ""}}),
     "shared_storage_path"),
    (dict(kv_offloading_size=0.01, kv_layout="contiguous"), "paged"),
    (dict(kv_offloading_size=0.01, kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(kv_offloading_size=0.01, hf_overrides={
        "layer_types": ["sliding_attention", "full_attention"] * 15, "sliding_window": 32}),
     "hybrid"),
    (dict(kv_offloading_size=0.01, parallel_sampling="fork"), "fork"),
])
def test_bad_connector_config_is_refused_first(nothing_allocated, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(block_size=BLOCK, kv_cache_tokens=256, max_model_len=128, **kwargs)


def test_tier_smaller_than_one_block_is_refused(block_bytes):
    with pytest.raises(ValueError, match="hold no block"):
        LLM(block_size=BLOCK, kv_cache_tokens=128, max_model_len=128,
            kv_offloading_size=(block_bytes // 2) / (1 << 30))


def test_transfer_config_naming_no_connector_runs_none(text_ids):
    """vLLM's KVTransferConfig.kv_connector defaults to None: no connector."""
    llm = LLM(block_size=BLOCK, kv_cache_tokens=128, max_model_len=128,
              kv_transfer_config={"kv_load_failure_policy": "recompute"})
    assert llm.llm_engine.kv_connector is None
    assert llm.llm_engine.model_runner.kv_connector is None
    assert llm.stats()["kv_offload_tier_blocks"] == 0


def test_bad_kv_transfer_config_type_is_refused():
    with pytest.raises(TypeError, match="kv_transfer_config"):
        LLM(kv_cache_tokens=256, max_model_len=128, kv_transfer_config="OffloadingConnector")


def test_offloading_size_with_a_policy_only_transfer_config(gib):
    """vLLM 0.33.0 (VllmConfig._post_init_kv_transfer_config) fills the connector and
    cpu_bytes_to_use from kv_offloading_size into the transfer config given beside it."""
    llm = LLM(block_size=BLOCK, kv_cache_tokens=128, max_model_len=128,
              kv_offloading_size=gib(4), kv_transfer_config={"kv_load_failure_policy": "recompute"})
    assert llm.llm_engine.scheduler.kv_load_failure_policy == "recompute"
    assert llm.stats()["kv_offload_tier_blocks"] == 4


def test_offloading_size_fills_in_vllm_connector_config(gib, block_bytes):
    from kvlab.config import EngineConfig

    cfg = EngineConfig(kv_offloading_size=0.5).resolved_kv_transfer_config
    assert (cfg.kv_connector, cfg.kv_role) == ("OffloadingConnector", "kv_both")
    assert cfg.kv_connector_extra_config["cpu_bytes_to_use"] == 1 << 29
    assert cfg.kv_load_failure_policy == "fail"  # vLLM's default
    assert EngineConfig().resolved_kv_transfer_config is None
    llm = LLM(block_size=BLOCK, kv_cache_tokens=128, max_model_len=128, kv_offloading_size=gib(7))
    s = llm.stats()
    assert s["kv_offload_tier_blocks"] == 7 and s["kv_offload_tier_blocks_used"] == 0
    plain = LLM(block_size=BLOCK, kv_cache_tokens=128, max_model_len=128).stats()
    assert plain["kv_offload_tier_blocks"] == 0 and plain["external_prefix_cache_queries"] == 0


# =================================================================================================
# ExampleConnector: disaggregated prefill between two engines of one process
# =================================================================================================
def test_example_connector_producer_then_consumer(text_ids, tmp_path):
    ps = prompts(text_ids, [40, 48, 70])  # 2, 3 (the whole prompt) and 4 full blocks
    folder = str(tmp_path / "kv")

    def cfg(role):
        return {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": folder}}

    kw = dict(block_size=BLOCK, kv_cache_tokens=256, max_model_len=128, debug_checks=True)
    plain = tokens(LLM(**kw), ps, 6)
    producer = LLM(**kw, kv_transfer_config=cfg("kv_producer"))
    tokens(producer, ps, 1)
    files = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert len(files) == 2 + 3 + 4 and all(f.endswith(".kv") for f in files)
    assert producer.stats()["external_prefix_cache_hits"] == 0  # a producer never loads
    assert producer.stats()["kv_offload_load_bytes"] == 0

    consumer = LLM(**kw, kv_transfer_config=cfg("kv_consumer"))
    assert tokens(consumer, ps, 6) == plain
    s = consumer.stats()
    assert s["external_prefix_cache_hits"] == sum(len(p) // BLOCK * BLOCK for p in ps)
    assert s["kv_offload_store_bytes"] == 0
    assert consumer.llm_engine.kv_connector.num_stored_blocks == 0
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == files  # nothing written
    block_bytes = consumer.llm_engine.model_runner.kv_connector.folder.block_bytes
    assert s["kv_offload_load_bytes"] == 9 * block_bytes
    assert_no_blocks_held(consumer)
    assert_no_blocks_held(producer)


def test_example_connector_consumer_without_files_computes_everything(text_ids, tmp_path):
    ps = prompts(text_ids, [40])
    kw = dict(block_size=BLOCK, kv_cache_tokens=256, max_model_len=128, debug_checks=True)
    consumer = LLM(**kw, kv_transfer_config={
        "kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    assert tokens(consumer, ps, 4) == tokens(LLM(**kw), ps, 4)
    assert consumer.stats()["external_prefix_cache_hits"] == 0
    assert not list(tmp_path.iterdir())

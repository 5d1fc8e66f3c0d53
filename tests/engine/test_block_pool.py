"""The block pool and the KV-cache manager, without a model.

A pool of N blocks reserves block 0 as vLLM's null block (never handed out, never freed, never
counted), so it hands out ids 1..N-1; `BlockPool(N, null_block=False)` is a plain pool of N.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.block_pool import BlockPool
from kvlab.kv_cache import NULL_BLOCK_OWNER, ContiguousKVCacheManager, KVCacheManager


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)  # the null block + 7
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    assert pool.get_num_free_blocks() == 4
    pool.free_blocks(list(reversed(a)))
    assert pool.get_num_free_blocks() == 7
    # vLLM 0.33.0: freed blocks without a prefix-cache key go to the head, in the order given
    # (last block first), so the next request reuses them first.
    assert list(pool.free_queue) == [3, 2, 1, 4, 5, 6, 7]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    pool.check_invariants()


# ---- the null block (vllm/v1/core/block_pool.py: BlockPool.null_block) --------------------------
def test_null_block_is_block_0_and_never_handed_out():
    """Block 0 is the null block from the start; every other block can be handed out, block 0
    never, however often the pool is drained and refilled."""
    pool = BlockPool(4)
    null = pool.null_block
    assert null is pool.blocks[0] and null.block_id == 0 and null.is_null
    assert not any(blk.is_null for blk in pool.blocks[1:])
    for _ in range(3):
        taken = pool.get_new_blocks(3)
        assert sorted(b.block_id for b in taken) == [1, 2, 3]
        with pytest.raises(ValueError, match="only 0 are free"):
            pool.get_new_blocks(1)
        pool.free_blocks(taken)
    assert null.ref_cnt == 0 and null.block_hash is None
    pool.check_invariants()


def test_null_block_is_never_freed():
    """Freeing the null block raises, and the call changes nothing, not even for the blocks
    listed before it."""
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="null block"):
        pool.free_blocks([pool.null_block])
    with pytest.raises(RuntimeError, match="null block"):
        pool.free_blocks([blk, pool.null_block])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_queue
    assert 0 not in pool.free_queue and pool.get_num_free_blocks() == 2
    pool.check_invariants()


def test_null_block_is_not_in_the_free_queue():
    """The null block is out of the free queue at construction and stays out through frees
    and a prefix-cache reset; check_invariants catches it if it gets in."""
    pool = BlockPool(5)
    assert list(pool.free_queue) == [1, 2, 3, 4]
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[0], b"k")
    pool.free_blocks(list(reversed(blocks)))
    assert list(pool.free_queue) == [4, 3, 2, 1]
    assert pool.reset_prefix_cache()
    assert 0 not in pool.free_queue
    pool.check_invariants()
    pool.free_queue[0] = pool.null_block
    with pytest.raises(AssertionError, match="null block is free"):
        pool.check_invariants()


def test_counts_leave_the_null_block_out():
    """Free, used and usable counts, and the usage share, are over blocks 1..N-1 (vLLM:
    get_num_free_blocks and get_usage, `num_gpu_blocks - 1`); the prefix cache resets when
    only the null block is out (vLLM: `num_used_blocks != 1`)."""
    pool = BlockPool(5)
    assert pool.num_blocks == 5 and pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4 and pool.get_num_used_blocks() == 0
    assert pool.get_usage() == 0.0 and pool.reset_prefix_cache()
    taken = pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 1 and pool.get_num_used_blocks() == 3
    assert pool.get_usage() == 0.75 and not pool.reset_prefix_cache()
    taken += pool.get_new_blocks(1)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    pool.free_blocks(taken)
    assert pool.get_num_free_blocks() == 4 and pool.get_num_used_blocks() == 0
    assert pool.reset_prefix_cache()


def test_pool_size_needs_room_for_the_null_block():
    with pytest.raises(ValueError, match="at least 2 blocks .*null block"):
        BlockPool(1)
    with pytest.raises(ValueError, match="at least 1 blocks"):
        BlockPool(0, null_block=False)
    (only,) = BlockPool(2).get_new_blocks(1)
    assert only.block_id == 1


def test_plain_pool_has_no_null_block():
    """null_block=False: a plain pool of N that hands out all N blocks, block 0 first, frees
    block 0 like any other, and counts all N."""
    pool = BlockPool(3, null_block=False)
    assert pool.null_block is None and not any(blk.is_null for blk in pool.blocks)
    assert pool.num_usable_blocks == 3 and pool.get_num_free_blocks() == 3
    assert list(pool.free_queue) == [0, 1, 2]
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert pool.get_num_used_blocks() == 3 and pool.get_usage() == 1.0
    pool.free_blocks(blocks[:1])
    assert list(pool.free_queue) == [0] and blocks[0].ref_cnt == 0
    pool.free_blocks(blocks[1:])
    assert list(pool.free_queue) == [1, 2, 0] and pool.get_num_free_blocks() == 3
    assert pool.reset_prefix_cache()
    pool.check_invariants()


def test_managers_build_pools_with_the_null_block():
    """Both layouts' managers own a pool whose block 0 is the null block: block tables never
    hold it, and the memory map names its owner."""
    for m in (KVCacheManager(num_blocks=4, block_size=4, max_model_len=12),
              ContiguousKVCacheManager(num_blocks=4, block_size=4, max_model_len=12)):
        assert m.block_pool.null_block is m.block_pool.blocks[0]
        assert m.allocate_slots("a", 12)
        assert m.get_block_ids("a") == [1, 2, 3]
        assert m.memory_map({"a": 12})[0] == (NULL_BLOCK_OWNER, 0, 0)
        m.free("a")
        assert m.block_pool.get_num_free_blocks() == 3
        m.check_invariants()


def test_keyed_blocks_go_to_the_tail_unkeyed_to_the_head():
    """vLLM 0.33.0's BlockPool.free_blocks: prepend_n for blocks that cannot be hit, append_n
    for cached ones, so cached prefixes survive longest (failed before: every block went to
    the tail)."""
    pool = BlockPool(7)  # the null block + 6
    blocks = pool.get_new_blocks(4)  # 1 2 3 4; the first two are full and keyed
    pool.cache_block(blocks[0], b"k0")
    pool.cache_block(blocks[1], b"k1")
    pool.free_blocks(list(reversed(blocks)))  # 4 3 2 1, eviction order
    assert list(pool.free_queue) == [4, 3, 5, 6, 2, 1]
    # Reuse takes the unkeyed blocks first; a keyed block is evicted only when nothing else is.
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [4, 3, 5, 6, 2]
    assert pool.get_cached_block(b"k1") is None and pool.get_cached_block(b"k0") is blocks[0]
    pool.check_invariants()


def test_kv_cache_events_stored_removed_cleared():
    from kvlab.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    pool = BlockPool(4, enable_kv_cache_events=True)  # the null block + 3
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h0", b"h1"], None, list(range(8)), 4)
    pool.cache_full_blocks([a], [b"h0"], None, list(range(4)), 4)  # already keyed: no event
    assert pool.take_events() == [BlockStored([b"h0", b"h1"], None, list(range(8)), 4, [1, 2])]
    assert pool.take_events() == []  # drained
    pool.free_blocks([b, a])
    pool.get_new_blocks(2)  # the unkeyed block 3, then block 2 (h1) is evicted
    assert pool.take_events() == [BlockRemoved([b"h1"], [2])]
    assert not pool.reset_prefix_cache()  # refused while blocks are held
    assert pool.get_cached_block(b"h0") is a and pool.take_events() == []
    pool.free_blocks([pool.blocks[2], pool.blocks[3]])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h0") is None and a.block_hash is None
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_invariants()


def test_events_are_not_recorded_unless_asked():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], None, [1, 2], 2)
    assert pool.take_events() == []


def test_all_or_nothing_and_double_free():
    pool = BlockPool(5)  # the null block + 4
    blocks = pool.get_new_blocks(4)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free_blocks(blocks[:1])


def test_touch_shares_a_block_until_the_last_reference_goes():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_queue
    pool.free_blocks([blk])
    assert blk.block_id in pool.free_queue
    pool.check_invariants()


def test_contiguous_first_fit_and_external_fragmentation():
    # The first-fit search is the contiguous manager's, beside the vLLM pool.
    m = ContiguousKVCacheManager(num_blocks=11, block_size=4, max_model_len=16)  # null + 10
    pool = m.block_pool
    a = m.get_contiguous_blocks(4)  # blocks 1-4 (block 0 is the null block, never in a region)
    b = m.get_contiguous_blocks(4)  # blocks 5-8
    assert [x.block_id for x in a] == [1, 2, 3, 4] and b[0].block_id == 5
    pool.free_blocks(a)
    # 6 blocks are free (1-4 and 9-10) but no gap of 5: external fragmentation.
    assert pool.get_num_free_blocks() == 6
    assert m.get_contiguous_blocks(5) is None
    c = m.get_contiguous_blocks(2)
    assert c[0].block_id == 1  # first fit: the lowest gap that is large enough
    assert not hasattr(pool, "get_contiguous_blocks")
    pool.check_invariants()


def test_manager_paged_grows_one_block_at_a_time():
    m = KVCacheManager(num_blocks=11, block_size=4, max_model_len=40)  # the null block + 10
    assert m.allocate_slots("a", 5)
    assert len(m.get_block_ids("a")) == 2
    assert m.allocate_slots("a", 8)  # still two blocks
    assert len(m.get_block_ids("a")) == 2
    assert m.allocate_slots("a", 9)
    assert len(m.get_block_ids("a")) == 3
    assert not m.allocate_slots("b", 100)  # all or nothing
    assert m.block_pool.get_num_free_blocks() == 7
    m.free("a")
    assert m.block_pool.get_num_free_blocks() == 10
    m.check_invariants()


def _request(rid, n, status=None):
    from kvlab.metrics import RequestMetrics
    from kvlab.request import Request, RequestStatus
    from kvlab.sampling import SamplingParams

    r = Request(rid, None, list(range(1, n + 1)), SamplingParams(max_tokens=4), frozenset(),
                RequestMetrics(arrival_time=0.0))
    r.status = status or RequestStatus.WAITING
    return r


def test_full_sequence_must_fit_refuses_a_prompt_whose_first_chunk_fits():
    """vLLM 0.33.0's full_sequence_must_fit (kv_cache_manager.py): admission checks the whole
    prompt, not only the chunk scheduled now (failed before: kvlab had no such check)."""
    m = KVCacheManager(num_blocks=5, block_size=4, max_model_len=64)  # the null block + 4
    r = _request("r", 20)  # 5 blocks of prompt, 4 usable blocks
    assert not m.allocate_slots("r", 8, 0, request=r, full_sequence_must_fit=True)
    assert m.block_pool.get_num_free_blocks() == 4 and "r" not in m.req_to_blocks
    assert m.allocate_slots("r", 8, 0, request=r)  # the first chunk alone fits
    m.free("r")
    small = _request("s", 16)
    assert m.allocate_slots("s", 8, 0, request=small, full_sequence_must_fit=True)
    assert m.get_block_ids("s") == [2, 1]  # only this chunk's blocks are taken


def test_watermark_applies_to_waiting_requests_while_others_run():
    from kvlab.request import RequestStatus

    # The null block + 10; the watermark counts the null block, as vLLM's: int(0.2 * 11) = 2.
    m = KVCacheManager(num_blocks=11, block_size=4, max_model_len=64, watermark=0.2)
    assert m.watermark_blocks == 2
    w = _request("w", 32)  # 8 blocks: leaves 2 free, the watermark
    assert not m.allocate_slots("w", 33, 0, request=w)  # would leave 1
    assert m.allocate_slots("w", 32, 0, request=w)
    m.free("w")
    p = _request("p", 36, RequestStatus.PREEMPTED)  # 9 blocks
    assert not m.allocate_slots("p", 36, 0, request=p)
    assert m.allocate_slots("p", 36, 0, request=p, has_scheduled_reqs=False)  # alone: no mark
    m.free("p")
    run = _request("x", 36, RequestStatus.RUNNING)
    assert m.allocate_slots("x", 36, 0, request=run)  # a running request may use the reserve
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(num_blocks=4, block_size=4, watermark=1.0)


def test_manager_reset_prefix_cache():
    m = KVCacheManager(num_blocks=4, block_size=2, max_model_len=8, enable_prefix_caching=True)
    r = _request("r", 5)
    assert m.allocate_slots("r", 5, 0, request=r)  # keys its two full blocks, 1 and 2
    assert not m.reset_prefix_cache()  # r holds blocks
    m.free("r")
    again = _request("again", 5)
    assert m.get_computed_blocks(again)[1] == 4
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(_request("cold", 5))[1] == 0


def test_check_invariants_catches_a_ref_count_no_table_explains():
    m = KVCacheManager(num_blocks=4, block_size=2)
    assert m.allocate_slots("a", 3)
    m.block_pool.touch([m.req_to_blocks["a"][0]])  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_cnt 2 but 1 block tables"):
        m.check_invariants()


def test_manager_contiguous_reserves_max_model_len():
    m = ContiguousKVCacheManager(num_blocks=11, block_size=4, max_model_len=16)  # null + 10
    assert m.allocate_slots("a", 1)
    assert m.get_block_ids("a") == [1, 2, 3, 4]  # 16 tokens reserved for a 1-token request
    assert m.allocate_slots("b", 1)
    assert not m.allocate_slots("c", 1)  # 2 blocks left, a region needs 4
    assert m.usable_free_slots() == 0  # 8 free slots, but in a gap too small for a region
    mm = m.memory_map({"a": 5, "b": 1})
    assert mm[0] == (NULL_BLOCK_OWNER, 0, 0)
    assert mm[1:5] == [("a", 4, 0), ("a", 1, 3), ("a", 0, 4), ("a", 0, 4)]
    assert mm[9:] == [(None, 0, 0), (None, 0, 0)]


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(2, 25),
    null_block=st.booleans(),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "touch", "free"]), st.integers(0, 30)),
                 max_size=80),
)
def test_pool_invariants_under_random_operations(num_blocks, null_block, ops):
    pool = BlockPool(num_blocks, null_block=null_block)
    usable = num_blocks - null_block
    held = []  # one entry per reference we hold
    for op, k in ops:
        if op == "alloc":
            n = k % (usable + 2)
            if n <= pool.get_num_free_blocks():
                held += pool.get_new_blocks(n)
            else:
                with pytest.raises(ValueError):
                    pool.get_new_blocks(n)
        elif op == "touch" and held:
            blk = held[k % len(held)]
            pool.touch([blk])
            held.append(blk)
        elif op == "free" and held:
            pool.free_blocks([held.pop(k % len(held))])
        pool.check_invariants()
        assert pool.get_num_free_blocks() + pool.get_num_used_blocks() == usable
        for blk in pool.blocks:
            assert blk.ref_cnt == sum(1 for h in held if h is blk)
        assert not (null_block and any(h.is_null for h in held))
    pool.free_blocks(held)
    assert pool.get_num_free_blocks() == usable

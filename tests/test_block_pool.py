"""The block pool and the KV-cache manager, without a model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.block_pool import BlockPool
from kvlab import viz
from kvlab.kv_cache import ContiguousKVCacheManager, KVCacheManager


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.get_num_free_blocks() == 5
    pool.free_blocks(list(reversed(a)))
    assert pool.get_num_free_blocks() == 8
    # Freed blocks join the tail, last block first: the queue order is the eviction order.
    assert list(pool.free_queue)[-3:] == [2, 1, 0]
    pool.check_invariants()


def test_all_or_nothing_and_double_free():
    pool = BlockPool(4)
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
    pool = BlockPool(10)
    a = pool.get_contiguous_blocks(4)  # blocks 0-3
    b = pool.get_contiguous_blocks(4)  # blocks 4-7
    assert [x.block_id for x in a] == [0, 1, 2, 3] and b[0].block_id == 4
    pool.free_blocks(a)
    # 6 blocks are free (0-3 and 8-9) but no gap of 5: external fragmentation.
    assert pool.get_num_free_blocks() == 6
    assert pool.get_contiguous_blocks(5) is None
    c = pool.get_contiguous_blocks(2)
    assert c[0].block_id == 0  # first fit: the lowest gap that is large enough
    pool.check_invariants()


def test_manager_paged_grows_one_block_at_a_time():
    m = KVCacheManager(num_blocks=10, block_size=4, max_model_len=40)
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


def test_manager_contiguous_reserves_max_model_len():
    m = ContiguousKVCacheManager(num_blocks=10, block_size=4, max_model_len=16)
    assert m.allocate_slots("a", 1)
    assert m.get_block_ids("a") == [0, 1, 2, 3]  # 16 tokens reserved for a 1-token request
    assert m.allocate_slots("b", 1)
    assert not m.allocate_slots("c", 1)  # 2 blocks left, a region needs 4
    assert viz.usable_free_slots(m) == 0  # 8 free slots, but in a gap too small for a region
    mm = viz.memory_map(m, {"a": 5, "b": 1})
    assert mm[:4] == [("a", 4), ("a", 1), ("a", 0), ("a", 0)]
    assert mm[8:] == [(None, 0), (None, 0)]


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 24),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "touch", "free"]), st.integers(0, 30)),
                 max_size=80),
)
def test_pool_invariants_under_random_operations(num_blocks, ops):
    pool = BlockPool(num_blocks)
    held = []  # one entry per reference we hold
    for op, k in ops:
        if op == "alloc":
            n = k % (num_blocks + 2)
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
        for blk in pool.blocks:
            assert blk.ref_cnt == sum(1 for h in held if h is blk)
    pool.free_blocks(held)
    assert pool.get_num_free_blocks() == num_blocks

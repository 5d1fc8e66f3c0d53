"""vLLM 0.33.0's own unit tests, re-expressed against kvlab's classes (one full-attention group).

Each test is named after the vLLM test it re-expresses and cites its file under
vllm-project/vllm `tests/v1/core/`. The scenarios keep vLLM's block size, pool size, token ids,
order of calls and expected outcomes. Block ids, pool sizes, free counts and free-queue order
are vLLM's literal numbers, read directly: kvlab's BlockPool(N), like vLLM's, reserves block 0
as the null block and hands out ids 1..N-1. Where vLLM's test exercises its
FreeKVCacheBlockQueue or BlockHashToBlockMap alone (blocks outside any pool, no null block),
the port uses a plain pool, `BlockPool(n, null_block=False)`, and says so. The deliberate
differences between the two code bases (allocate_slots' totals, the scheduler's output shape,
...) are bridged by ONE adapter, `tests/engine/vllm_adapter.py`, which says what each one is. No
model is loaded: like vLLM's, these tests build the manager and the scheduler from small
fixtures.

The vLLM test copy read for this port may be newer than 0.33.0; each expectation was checked
against the 0.33.0 source (vllm/v1/core/block_pool.py, kv_cache_manager.py, kv_cache_utils.py,
single_type_kv_cache_manager.py, sched/scheduler.py); where they differ, 0.33.0 is followed and a
comment says so. Tests whose name starts with `test_src_` are not vLLM tests: they pin a
behaviour of the 0.33.0 source (function cited) that no single-group vLLM test covers.

vLLM tests that cannot be expressed against kvlab are listed, with the reason, in NOT_PORTED at
the bottom of this file.
"""

from __future__ import annotations

import hashlib

import pytest

from tests.engine.vllm_adapter import (
    EOS_TOKEN_ID,
    check_not_ported,
    SchedulerAdapter,
    allocate_slots,
    append_output_token_ids,
    block_ids,
    create_requests,
    create_requests_with_priority,
    create_scheduler,
    create_scheduler_with_priority,
    make_manager,
    make_request,
    runner_output,
)

from kvlab.block_pool import BlockPool, KVCacheBlock  # noqa: E402
from kvlab.prefix_cache import (  # noqa: E402
    HASH_ALGOS,
    block_extra_keys,
    encode_block,
    extend_block_hashes,
    hash_block_tokens,
)
from kvlab.request import RequestStatus  # noqa: E402

PC = "tests/v1/core/test_prefix_caching.py"
KU = "tests/v1/core/test_kv_cache_utils.py"
SC = "tests/v1/core/test_scheduler.py"


def kv_events():
    """kvlab.kv_events (imported lazily: the module lands with the KV-event feature)."""
    import kvlab.kv_events as ev

    return ev


def chain(token_ids, block_size, salt=None, algo="sha256"):
    """The keys of the full blocks of `token_ids` (kvlab's chain: parent, tokens, extra keys)."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, lambda s, e: list(token_ids[s:e]), len(token_ids), block_size,
                        salt, algo)
    return hashes


# =================================================================================================
# tests/v1/core/test_prefix_caching.py
# =================================================================================================
@pytest.mark.parametrize("hash_algo", HASH_ALGOS)  # vLLM: hash_fn in [sha256, sha256_cbor]
def test_prefill(hash_algo):
    """test_prefix_caching.py::test_prefill (a pool of 11 blocks of 16 tokens)."""
    block_size = 16
    manager = make_manager(11, block_size, hash_algo=hash_algo)
    pool = manager.block_pool
    common_token_ids = [i for i in range(3) for _ in range(16)]  # 3 full blocks

    # Fully cache miss; an incomplete 4th block of 7 tokens.
    all_token_ids = common_token_ids + [3] * 7
    req0 = make_request("0", all_token_ids)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req0)
    assert len(req0.block_hashes) == 3
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req0, 55, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and block_ids(blocks) == [1, 2, 3, 4]

    # Full blocks carry the chained key; ref_cnt 1.
    parent = None
    for block_id in (1, 2, 3):
        tokens = all_token_ids[(block_id - 1) * 16 : block_id * 16]
        key = hash_block_tokens(parent, tokens, (), hash_algo)
        assert pool.blocks[block_id].block_hash == key
        assert pool.blocks[block_id].ref_cnt == 1
        parent = key
    # The partial block has no key.
    assert pool.blocks[4].block_hash is None and pool.blocks[4].ref_cnt == 1

    # Cache hit in the common prefix while the original blocks are in use (5-token tail).
    req1 = make_request("1", common_token_ids + [3] * 5)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert len(req1.block_hashes) == 3
    assert block_ids(computed_blocks) == [1, 2, 3] and num_computed_tokens == 3 * 16
    blocks = allocate_slots(manager, req1, 53 - 3 * 16, len(computed_blocks) * 16,
                            computed_blocks)
    assert blocks is not None and block_ids(blocks) == [5]
    assert all(b.ref_cnt == 2 for b in computed_blocks)
    assert pool.get_num_free_blocks() == 5

    manager.free(req0.request_id)
    manager.free(req1.request_id)
    assert pool.get_num_free_blocks() == 10
    # [partial blocks without a key, 5 then 4: prepended, reused first]
    # [never used: 6..10] [the common prefix, freed last block first: 3, 2, 1]
    assert list(pool.free_queue) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # Cache hit in the common prefix when the original blocks are already free.
    req2 = make_request("2", common_token_ids + [3] * 6)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert len(req2.block_hashes) == 3
    assert block_ids(computed_blocks) == [1, 2, 3] and num_computed_tokens == 3 * 16
    blocks = allocate_slots(manager, req2, 53 - 3 * 16, len(computed_blocks) * 16,
                            computed_blocks)
    assert blocks is not None and block_ids(blocks) == [5]  # reuses the partial block 5
    assert pool.get_num_free_blocks() == 6
    assert all(b.ref_cnt == 0 for b in pool.free_queue.values())
    assert len(pool.free_queue) == 6
    manager.free(req2.request_id)

    # Cache miss and eviction: the block ids also pin the eviction order.
    req3 = make_request("3", [99] * (16 * 10))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req3)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req3, 16 * 10, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and block_ids(blocks) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert pool.get_num_free_blocks() == 0 and not pool.free_queue
    pool.check_invariants()


def test_decode():
    """test_prefix_caching.py::test_decode."""
    block_size = 16
    manager = make_manager(11, block_size)
    common_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common_token_ids + [3] * 7)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req0)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req0, 55, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and block_ids(blocks) == [1, 2, 3, 4]

    # Append slots without allocating a new block.
    req0.num_computed_tokens = 55
    for _ in range(4):
        append_output_token_ids(req0, 8)
    new_blocks = allocate_slots(manager, req0, 4, len(computed_blocks) * 16, computed_blocks)
    assert new_blocks is not None and len(new_blocks) == 0
    assert manager.req_to_blocks[req0.request_id][-1].block_hash is None

    # Append slots, allocating a new block: 9 tokens fill the 4th block, 10 go to a 5th.
    req0.num_computed_tokens = 59
    for _ in range(9 + 10):
        append_output_token_ids(req0, 7)
    new_blocks = allocate_slots(manager, req0, 19, len(computed_blocks) * 16, computed_blocks)
    assert new_blocks is not None and len(new_blocks) == 1
    assert manager.req_to_blocks[req0.request_id][-2].block_hash is not None
    assert manager.req_to_blocks[req0.request_id][-1].block_hash is None


def test_evict():
    """test_prefix_caching.py::test_evict."""
    block_size = 16
    manager = make_manager(11, block_size)
    pool = manager.block_pool

    last_token_id = 5 * 16 + 7
    req0 = make_request("0", list(range(last_token_id)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req0)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req0, 5 * 16 + 7, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 6  # 5 full + 1 partial
    assert block_ids(blocks) == [1, 2, 3, 4, 5, 6]

    req1 = make_request("1", list(range(last_token_id, last_token_id + 3 * 16)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req1, 3 * 16, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 3  # 3 full blocks
    assert block_ids(blocks) == [7, 8, 9]
    assert pool.get_num_free_blocks() == 1  # 10 - (6 + 3)

    manager.free(req0.request_id)
    # The partial block (no key) at the head, the keyed ones at the tail (LRU).
    assert list(pool.free_queue) == [6, 10, 5, 4, 3, 2, 1]
    manager.free(req1.request_id)
    assert pool.get_num_free_blocks() == 10
    assert list(pool.free_queue) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    # Touch the first 2 blocks.
    req2 = make_request("2", list(range(2 * 16 + 3)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert block_ids(computed_blocks) == [1, 2] and num_computed_tokens == 2 * 16
    blocks = allocate_slots(manager, req2, 3, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and block_ids(blocks) == [6]
    assert pool.get_num_free_blocks() == 7


def test_hash_block_correct_reuse():
    """test_prefix_caching.py::test_hash_block_correct_reuse: a cached block reused as a new
    block loses its key."""
    block_size = 16
    manager = make_manager(2, 16)  # one usable block

    num_tokens = block_size * 1
    req = make_request("0", list(range(num_tokens)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req, num_tokens, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 1
    manager.free(req.request_id)

    # A new, not full block: its key must be cleared.
    req = make_request("1", list(range(num_tokens - 1)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req, num_tokens - 1, len(computed_blocks) * 16,
                            computed_blocks)
    assert blocks is not None and len(blocks) == 1
    assert manager.block_pool.blocks[blocks[0].block_id].block_hash is None


def test_computed_blocks_not_evicted():
    """test_prefix_caching.py::test_computed_blocks_not_evicted: new blocks for a request never
    evict its own prefix hits while other free blocks exist."""
    block_size = 16
    manager = make_manager(3, block_size)

    num_tokens = block_size * 1
    req0 = make_request("0", list(range(num_tokens)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req0)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req0, num_tokens, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 1 and block_ids(blocks) == [1]

    req1 = make_request("1", list(range(num_tokens, num_tokens * 2)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req1, num_tokens, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 1 and block_ids(blocks) == [2]

    manager.free(req0.request_id)
    manager.free(req1.request_id)

    # A hit on the first block: the second cached block is evicted, not the first.
    req2 = make_request("2", list(range(num_tokens * 2)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert block_ids(computed_blocks) == [1] and num_computed_tokens == block_size
    blocks = allocate_slots(manager, req2, num_tokens * 2 - num_tokens,
                            len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 1 and block_ids(blocks) == [2]


def test_basic_prefix_caching_disabled():
    """test_prefix_caching.py::test_basic_prefix_caching_disabled (block size 4, a pool of 5).

    Block ids beyond vLLM's counts are pinned from 0.33.0's BlockPool.free_blocks: with caching
    off no block has a key, so freed blocks are prepended (LIFO reuse)."""
    block_size = 4
    manager = make_manager(5, block_size, enable_caching=False)
    pool = manager.block_pool

    req1 = make_request("1", list(range(10)))  # 2 blocks and some more
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req1, 10, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 3 and block_ids(blocks) == [1, 2, 3]
    manager.free(req1.request_id)
    assert list(pool.free_queue) == [3, 2, 1, 4]

    # No caching: a shared prefix finds nothing.
    req2 = make_request("2", list(range(16)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req2, 16, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and len(blocks) == 4 and block_ids(blocks) == [3, 2, 1, 4]
    assert all(b.block_hash is None for b in pool.blocks)

    # The pool is full: a new request gets no blocks.
    req3 = make_request("3", list(range(4)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req3)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = allocate_slots(manager, req3, 4, len(computed_blocks) * 16, computed_blocks)
    assert not blocks
    assert req3.request_id not in manager.req_to_blocks or not manager.req_to_blocks["3"]


@pytest.mark.parametrize("hash_algo", HASH_ALGOS)
def test_cache_blocks(hash_algo):
    """test_prefix_caching.py::test_cache_blocks: keying full blocks from the start, then ones
    that do not start at the beginning. (vLLM: BlockPool.cache_full_blocks(num_cached_blocks,
    num_full_blocks); kvlab: KVCacheManager.cache_blocks(request, num_tokens), which remembers
    how many of the request's blocks are keyed.)"""
    block_size = 4
    # vLLM keys through BlockPool(num_gpu_blocks=5); kvlab through a manager over one.
    manager = make_manager(5, block_size, hash_algo=hash_algo)
    pool = manager.block_pool
    # Blocks: [0, 1, 2, 3] [4, 5, 6, 7] [8, 9, 10, 11] [12, 13]
    req = make_request("0", list(range(14)))

    blocks = [KVCacheBlock(block_id=i) for i in range(2)]
    manager.req_to_blocks[req.request_id] = blocks
    manager.cache_blocks(req, 2 * block_size)  # 2 full blocks from the start
    assert len(pool.cached_block_hash_to_block) == 2
    assert all(b.block_hash is not None for b in blocks)

    blocks.append(KVCacheBlock(block_id=2))
    manager.cache_blocks(req, 3 * block_size)  # one more, not from the start
    assert len(pool.cached_block_hash_to_block) == 3
    assert blocks[0].block_hash is not None
    assert [b.block_hash for b in blocks] == chain(list(range(14)), block_size, algo=hash_algo)


def test_cache_key_salting():
    """test_prefix_caching.py::test_cache_key_salting: the salt goes into the first block's key
    and, through the chain, into every later key; a different salt misses."""
    block_size = 16
    manager = make_manager(11, block_size)

    common_token_ids = [i for i in range(3) for _ in range(block_size)]
    token_ids = common_token_ids + [3] * 11
    req0 = make_request("0", token_ids, cache_salt="salt1")
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req0)
    assert not computed_blocks and num_computed_tokens == 0
    block_hashes = req0.block_hashes
    assert len(block_hashes) == 3
    # kvlab's extra key for the salt is ("cache_salt", salt), in the first block only.
    assert block_hashes[0] == hash_block_tokens(None, token_ids[:block_size],
                                                (("cache_salt", "salt1"),))
    assert block_hashes[1] == hash_block_tokens(block_hashes[0],
                                                token_ids[block_size : block_size * 2], ())
    assert block_hashes[2] == hash_block_tokens(block_hashes[1],
                                                token_ids[block_size * 2 : block_size * 3], ())

    blocks = allocate_slots(manager, req0, 59, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and block_ids(blocks) == [1, 2, 3, 4]
    req0.num_computed_tokens = 59

    # Append slots without allocating a new block; the 4th block becomes full and keyed.
    for _ in range(5):
        append_output_token_ids(req0, 8)
    new_blocks = allocate_slots(manager, req0, 5, len(computed_blocks) * 16, computed_blocks)
    assert new_blocks is not None and len(new_blocks) == 0
    assert len(block_hashes) == 4
    assert block_hashes[3] == hash_block_tokens(block_hashes[2],
                                                token_ids[3 * block_size :] + [8] * 5, ())

    # Same salt: a hit on the 3-block prefix.
    token_ids = common_token_ids + [4] * 11
    req1 = make_request("1", token_ids, cache_salt="salt1")
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert len(computed_blocks) == 3 and num_computed_tokens == 3 * block_size

    # Same content, different salt: a miss.
    req2 = make_request("2", token_ids, cache_salt="salt2")
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert len(computed_blocks) == 0 and num_computed_tokens == 0
    block_hashes = req2.block_hashes
    assert len(block_hashes) == 3
    assert block_hashes[0] == hash_block_tokens(None, token_ids[:block_size],
                                                (("cache_salt", "salt2"),))
    assert block_hashes[1] == hash_block_tokens(block_hashes[0],
                                                token_ids[block_size : block_size * 2], ())
    assert block_hashes[2] == hash_block_tokens(block_hashes[1],
                                                token_ids[block_size * 2 : block_size * 3], ())


def test_prefill_not_enough_free_blocks_with_computed_blocks():
    """test_prefix_caching.py::test_prefill_not_enough_free_blocks_with_computed_blocks: when
    allocation fails, the request's prefix hits are not touched (ref counts unchanged)."""
    block_size = 16
    manager = make_manager(11, block_size)
    pool = manager.block_pool
    # | Common-0 | Common-1 | Common-2 |
    common_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common_token_ids)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req0)
    assert not computed_blocks and num_computed_tokens == 0
    allocate_slots(manager, req0, 48, len(computed_blocks) * 16, computed_blocks)
    block_part0 = manager.req_to_blocks[req0.request_id]

    # | Common-0 | Common-1 | Common-2 | Req1-3 | Req1-4 | Req1-5 |
    req1 = make_request("1", common_token_ids * 2)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert [b.block_id for b in computed_blocks] == [b.block_id for b in block_part0]
    assert num_computed_tokens == 3 * 16
    allocate_slots(manager, req1, 48, len(computed_blocks) * 16, computed_blocks)
    block_part1 = manager.req_to_blocks[req1.request_id]
    manager.free(req1.request_id)
    assert {b.ref_cnt for b in block_part1[:3]} == {1}
    assert {b.ref_cnt for b in block_part1[3:]} == {0}

    # | ... | Req1-5(F) | Req2-0 | Req2-1 |
    req2 = make_request("2", [7] * block_size * 2)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert not computed_blocks and num_computed_tokens == 0
    allocate_slots(manager, req2, block_size * 2, len(computed_blocks) * block_size,
                   computed_blocks)

    # Req3 = common * 3: its first 6 blocks are cached, but its 3 new blocks do not fit the 2
    # free blocks left once its 3 free hits (Req1-3..5) are taken back.
    assert pool.get_num_free_blocks() == 5
    req3 = make_request("3", common_token_ids * 3)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req3)
    assert [b.block_id for b in computed_blocks] == [b.block_id for b in block_part1]
    assert num_computed_tokens == 6 * 16
    assert allocate_slots(manager, req3, 48, len(computed_blocks) * 16, computed_blocks) is None
    assert {b.ref_cnt for b in block_part1[:3]} == {1}  # used by req0
    assert {b.ref_cnt for b in block_part1[3:]} == {0}  # still free
    assert pool.get_num_free_blocks() == 5
    pool.check_invariants()


def test_reset_prefix_cache():
    """test_prefix_caching.py::test_reset_prefix_cache."""
    block_size = 16
    manager = make_manager(11, block_size)
    pool = manager.block_pool

    full_block_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", full_block_token_ids + [3] * 7)
    blocks = allocate_slots(manager, req0, 55)
    assert blocks is not None and block_ids(blocks) == [1, 2, 3, 4]

    req1 = make_request("1", full_block_token_ids + [4] * 7)
    computed_blocks, _ = manager.get_computed_blocks(req1)
    assert len(req1.block_hashes) == 3 and len(computed_blocks) == 3
    blocks = allocate_slots(manager, req1, 7, len(computed_blocks) * 16, computed_blocks)
    assert blocks is not None and block_ids(blocks) == [5]

    # Blocks are still held: the reset fails and changes nothing.
    keys_before = {k: dict(v) for k, v in pool.cached_block_hash_to_block.items()}
    assert not manager.reset_prefix_cache()
    assert pool.cached_block_hash_to_block
    assert {k: dict(v) for k, v in pool.cached_block_hash_to_block.items()} == keys_before

    manager.free(req0.request_id)
    manager.free(req1.request_id)
    assert manager.reset_prefix_cache()
    assert not pool.cached_block_hash_to_block
    assert all(blk.block_hash is None for blk in pool.blocks)
    pool.check_invariants()


def test_maybe_evict_cached_block():
    """test_prefix_caching.py::test_maybe_evict_cached_block: two blocks under one key; evicting
    one keeps the key for the other. (vLLM: BlockPool._maybe_evict_cached_block; kvlab:
    BlockPool.uncache_block, which forgets a block's key the same way.) As in vLLM's test, all
    four blocks of BlockPool(4) are keyed by hand, block 0 (the null block) included."""
    pool = BlockPool(4)
    block_hash0, block_hash1, block_hash2 = b"10", b"20", b"30"
    # block 3 has exactly the same key as block 0
    for block, block_hash in zip(pool.blocks, [block_hash0, block_hash1, block_hash2,
                                               block_hash0]):
        pool.cache_block(block, block_hash)
    block0, block1, block2, block3 = pool.blocks

    def table():
        return {k: dict(v) for k, v in pool.cached_block_hash_to_block.items()}

    # kvlab keeps every key's copies in a dict by block id, even a single one.
    assert table() == {block_hash0: {0: block0, 3: block3}, block_hash1: {1: block1},
                       block_hash2: {2: block2}}
    pool.uncache_block(block1)
    assert table() == {block_hash0: {0: block0, 3: block3}, block_hash2: {2: block2}}
    # Evicting block 0 keeps block_hash0: block 3 holds it too.
    pool.uncache_block(block0)
    assert table() == {block_hash0: {3: block3}, block_hash2: {2: block2}}
    pool.uncache_block(block2)
    assert table() == {block_hash0: {3: block3}}
    pool.uncache_block(block3)
    assert table() == {}


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_kv_cache_events(blocks_to_cache):
    """test_prefix_caching.py::test_kv_cache_events. (vLLM's BlockStored also carries
    kv_cache_spec_kind, lora_id, medium...: not kvlab's; kvlab adds block_ids.)"""
    ev = kv_events()
    block_size = 16
    manager = make_manager(blocks_to_cache + 1, block_size, enable_kv_cache_events=True)
    pool = manager.block_pool

    # One BlockStored event with blocks_to_cache hashes; take_events empties the queue.
    num_tokens = block_size * blocks_to_cache
    req0 = make_request("0", list(range(num_tokens)))
    allocate_slots(manager, req0, num_tokens)
    events = manager.take_events()
    block = events[-1]
    assert isinstance(block, ev.BlockStored)
    assert len(block.block_hashes) == blocks_to_cache == len(pool.cached_block_hash_to_block)
    assert len(block.token_ids) == block.block_size * len(block.block_hashes)
    assert block.block_hashes == req0.block_hashes and block.parent_block_hash is None
    assert block.token_ids == list(range(num_tokens)) and block.block_size == block_size
    assert block.block_ids == manager.get_block_ids("0")  # kvlab's addition
    assert manager.take_events() == []
    stored_block_hash = block.block_hashes

    # Free and send the same tokens without a lookup: every cached block is evicted (one
    # BlockRemoved each), then one BlockStored for the new copies.
    manager.free(req0.request_id)
    req1 = make_request("1", list(range(num_tokens)))
    allocate_slots(manager, req1, num_tokens)
    events = manager.take_events()
    for removed in events[:-1]:
        assert isinstance(removed, ev.BlockRemoved)
        assert removed.block_hashes[0] in stored_block_hash
    assert len(events) == blocks_to_cache + 1
    assert isinstance(events[-2], ev.BlockRemoved)
    assert isinstance(events[-1], ev.BlockStored)
    assert len(events[-1].block_hashes) == blocks_to_cache == len(pool.cached_block_hash_to_block)

    # All blocks cleared.
    manager.free(req1.request_id)
    manager.reset_prefix_cache()
    events = manager.take_events()
    assert isinstance(events[-1], ev.AllBlocksCleared)
    assert len(pool.cached_block_hash_to_block) == 0


def test_src_kv_events_disabled_record_nothing():
    """vllm/v1/core/block_pool.py: every event is appended only `if self.enable_kv_cache_events`
    (the single-group essence of test_prefix_caching.py::test_emit_cached_block_events_disabled):
    with events off (the default) nothing is recorded."""
    manager = make_manager(5, 4)
    req = make_request("0", list(range(16)))
    allocate_slots(manager, req, 16)
    manager.free("0")
    allocate_slots(manager, make_request("1", list(range(100, 116))), 16)
    manager.free("1")
    assert manager.reset_prefix_cache()
    assert manager.take_events() == []
    assert manager.block_pool.take_events() == []


def test_null_parent_block_hash():
    """test_prefix_caching.py::test_null_parent_block_hash: a BlockStored event's
    parent_block_hash comes from the request's (logical) hash chain even when the physical
    parent block is the null block, and the null block stays unkeyed. (vLLM calls
    BlockPool(8).cache_full_blocks(num_cached_blocks=2, num_full_blocks=4) on a hand-built
    table; kvlab keys through KVCacheManager.cache_blocks, which resumes after the blocks it has
    already keyed for the request (num_registered_blocks), so the same table is set there.)"""
    ev = kv_events()
    block_size = 1
    num_cached_blocks = 2
    num_full_blocks = 4
    manager = make_manager(8, block_size, enable_kv_cache_events=True)
    pool = manager.block_pool
    req = make_request("req_null_parent", [10, 11, 12, 13])
    manager.get_computed_blocks(req)  # kvlab fills request.block_hashes lazily
    assert len(req.block_hashes) == num_full_blocks

    # Physical parent is the null block (no key), while the logical parent hash still exists
    # in req.block_hashes[num_cached_blocks - 1].
    assert pool.null_block.block_hash is None
    new_blocks = pool.get_new_blocks(num_full_blocks - 1)
    assert block_ids(new_blocks) == [1, 2, 3]
    # (vLLM's table holds the slice new_blocks[:1] itself as its first entry, a block it never
    # reads; here the block.)
    blocks = [*new_blocks[: num_cached_blocks - 1], pool.null_block,
              *new_blocks[num_cached_blocks - 1 :]]
    manager.req_to_blocks[req.request_id] = blocks
    manager.num_registered_blocks[req.request_id] = num_cached_blocks
    manager.cache_blocks(req, num_full_blocks * block_size)

    events = manager.take_events()
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, ev.BlockStored)
    assert event.parent_block_hash == req.block_hashes[num_cached_blocks - 1]
    assert event.parent_block_hash is not None
    assert event.block_hashes == req.block_hashes[num_cached_blocks:num_full_blocks]
    assert event.token_ids == [12, 13]
    assert event.block_ids == [2, 3]  # kvlab's addition

    # The null block got no key; the newly cached physical blocks did.
    assert pool.null_block.block_hash is None
    assert blocks[num_cached_blocks].block_hash is not None
    assert blocks[num_full_blocks - 1].block_hash is not None


def test_block_removed_event_group_idx():
    """test_prefix_caching.py::test_block_removed_event_group_idx, for group 0 (kvlab has one
    group and no group_idx): the null block and 4 usable blocks; re-allocating all 4 evicts the
    two keyed ones, one BlockRemoved each."""
    ev = kv_events()
    block_size = 4
    pool = BlockPool(5, enable_kv_cache_events=True)
    keys = chain(list(range(block_size * 2)), block_size)
    all_blocks = pool.get_new_blocks(4)
    for blk, key in zip(all_blocks[:2], keys):
        pool.cache_block(blk, key)
    pool.take_events()  # drain whatever keying recorded
    pool.free_blocks(all_blocks)
    pool.get_new_blocks(4)
    removed = [e for e in pool.take_events() if isinstance(e, ev.BlockRemoved)]
    assert len(removed) == 2
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(keys)
    assert sorted(i for e in removed for i in e.block_ids) == [1, 2]


def test_block_lookup_cache_single_block_per_key():
    """test_prefix_caching.py::test_block_lookup_cache_single_block_per_key. (vLLM tests its
    BlockHashToBlockMap; kvlab's is the pool's cached_block_hash_to_block, used through
    cache_block / get_cached_block / uncache_block. vLLM's `pop(key, block_id)` with a block id
    not under that key is uncache_block of such a block: a no-op.) vLLM's map holds
    KVCacheBlock(0) and KVCacheBlock(1), outside any pool: here the two blocks of a plain pool
    (null_block=False), block 0 being an ordinary block as in vLLM's test."""
    pool = BlockPool(2, null_block=False)
    key0, key1, key2 = b"hash0", b"hash1", b"hash2"
    block0, block1 = pool.blocks

    def get(key):
        return pool.get_cached_block(key)

    assert get(key0) is None and get(key1) is None and get(key2) is None
    pool.cache_block(block0, key0)
    assert get(key0) is block0 and get(key1) is None and get(key2) is None
    pool.cache_block(block1, key1)
    assert get(key0) is block0 and get(key1) is block1 and get(key2) is None
    # Nothing removed: block 100 is not under key0.
    pool.uncache_block(KVCacheBlock(100, block_hash=key0))
    assert get(key0) is block0 and get(key1) is block1 and get(key2) is None
    pool.uncache_block(block0)
    assert get(key0) is None and get(key1) is block1 and get(key2) is None
    # Nothing removed: block 1 is not under key0.
    pool.uncache_block(KVCacheBlock(1, block_hash=key0))
    assert get(key0) is None and get(key1) is block1 and get(key2) is None
    pool.uncache_block(block1)
    assert get(key0) is None and get(key1) is None and get(key2) is None


def test_block_lookup_cache_multi_blocks_per_key():
    """test_prefix_caching.py::test_block_lookup_cache_multi_blocks_per_key: several blocks
    under one key; the lookup returns the first registered until it is removed. vLLM's map
    holds KVCacheBlock(0), (1), (10) and (11), outside any pool: here blocks of a plain pool
    (null_block=False), block 0 being an ordinary block as in vLLM's test."""
    pool = BlockPool(12, null_block=False)
    key0, key1 = b"hash0", b"hash1"
    block00, block01, block10, block11 = (pool.blocks[i] for i in (0, 1, 10, 11))
    assert pool.get_cached_block(key0) is None and pool.get_cached_block(key1) is None
    pool.cache_block(block00, key0)
    pool.cache_block(block01, key0)
    pool.cache_block(block10, key1)
    pool.cache_block(block11, key1)

    assert pool.get_cached_block(key0) is block00
    pool.uncache_block(block00)
    assert pool.get_cached_block(key0) is block01
    pool.uncache_block(block01)
    assert pool.get_cached_block(key0) is None
    pool.uncache_block(KVCacheBlock(2, block_hash=key0))  # not there: no-op
    assert pool.get_cached_block(key0) is None

    assert pool.get_cached_block(key1) is block10
    pool.uncache_block(block10)
    assert pool.get_cached_block(key1) is block11
    pool.uncache_block(block11)
    assert pool.get_cached_block(key1) is None
    pool.uncache_block(KVCacheBlock(12, block_hash=key1))
    assert pool.get_cached_block(key1) is None


def test_can_fit_full_sequence_full_attention_still_gates_oversized():
    """test_prefix_caching.py::test_can_fit_full_sequence_full_attention_still_gates_oversized,
    for its full-attention group alone (vLLM's pairs it with a sliding-window group): a prompt of
    16 blocks never fits a 5-block pool, so a first chunk of one block is refused when the full
    sequence must fit, and nothing is taken."""
    block_size = 16
    manager = make_manager(5, block_size, max_model_len=64 * block_size)
    req = make_request("oversized", list(range(16 * block_size)))
    free_before = manager.block_pool.get_num_free_blocks()
    assert allocate_slots(manager, req, block_size, full_sequence_must_fit=True) is None
    assert manager.block_pool.get_num_free_blocks() == free_before
    assert not manager.req_to_blocks.get("oversized")
    # Without the gate the first chunk alone fits.
    assert allocate_slots(manager, req, block_size) is not None


# =================================================================================================
# tests/v1/core/test_kv_cache_utils.py: blocks, the free queue, the hash chain
# =================================================================================================
def test_kv_cache_block():
    """test_kv_cache_utils.py::test_kv_cache_block (kvlab's block hash is a plain attribute:
    vLLM's set_block_hash / reset_hash are assignments)."""
    block = KVCacheBlock(block_id=0)
    assert block.block_id == 0 and block.ref_cnt == 0 and block.block_hash is None
    block.ref_cnt += 1
    assert block.ref_cnt == 1
    block.ref_cnt -= 1
    assert block.ref_cnt == 0
    block.block_hash = b"abc"
    assert block.block_hash == b"abc"
    block.block_hash = None
    assert block.block_hash is None


def test_free_kv_cache_block_queue_initialization():
    """test_kv_cache_utils.py::test_free_kv_cache_block_queue_initialization: a queue of one
    block has it as both head and tail. vLLM's FreeKVCacheBlockQueue([KVCacheBlock(0)]) has no
    null block: here a plain pool of one block (null_block=False)."""
    pool = BlockPool(1, null_block=False)
    assert pool.get_num_free_blocks() == 1
    assert list(pool.free_queue.values()) == [pool.blocks[0]]
    assert next(iter(pool.free_queue.values())) is pool.blocks[0]
    assert next(reversed(pool.free_queue.values())) is pool.blocks[0]


def _taken_keyed(pool):
    """Take every block of a fresh pool and key each, so that freeing one appends it to the tail
    (vLLM's FreeKVCacheBlockQueue.append; kvlab's free_blocks appends keyed blocks)."""
    blocks = pool.get_new_blocks(pool.get_num_free_blocks())
    for blk in blocks:
        pool.cache_block(blk, f"key{blk.block_id}".encode())
    return blocks


def test_free_kv_cache_block_queue_operations():
    """test_kv_cache_utils.py::test_free_kv_cache_block_queue_operations, through the pool:
    popleft = get_new_blocks(1); remove from the middle = touch (a prefix hit taken back);
    append = free_blocks of a keyed block. vLLM's queue holds KVCacheBlock(0..4) alone, no null
    block: here a plain pool of 5 (null_block=False)."""
    pool = BlockPool(5, null_block=False)
    blocks = pool.blocks
    assert pool.get_num_free_blocks() == 5
    assert list(pool.free_queue) == [0, 1, 2, 3, 4]

    (block1,) = pool.get_new_blocks(1)
    assert block1 is blocks[0]
    assert pool.get_num_free_blocks() == 4 and list(pool.free_queue) == [1, 2, 3, 4]

    # Remove a block from the middle.
    pool.cache_block(blocks[2], b"k2")
    pool.touch([blocks[2]])
    assert pool.get_num_free_blocks() == 3 and list(pool.free_queue) == [1, 3, 4]

    # Append it back.
    pool.free_blocks([blocks[2]])
    assert pool.get_num_free_blocks() == 4 and list(pool.free_queue) == [1, 3, 4, 2]

    # Pop until empty.
    for _ in range(4):
        pool.get_new_blocks(1)
    assert pool.get_num_free_blocks() == 0 and not pool.free_queue
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_free_kv_cache_block_queue_append_n():
    """test_kv_cache_utils.py::test_free_kv_cache_block_queue_append_n: keyed blocks freed
    together join the tail in the order given. (vLLM's last step corrupts the linked list to
    check an assertion; kvlab's queue is an OrderedDict with no such state.) vLLM's queue takes
    KVCacheBlock(0..5), no null block: here a plain pool of 6 (null_block=False)."""
    pool = BlockPool(6, null_block=False)
    blocks = _taken_keyed(pool)
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks([])
    assert list(pool.free_queue) == []
    pool.free_blocks(blocks[0:1])
    assert list(pool.free_queue) == [0]
    pool.free_blocks(blocks[4:6])
    assert list(pool.free_queue) == [0, 4, 5]
    pool.free_blocks(blocks[1:4])
    assert list(pool.free_queue) == [0, 4, 5, 1, 2, 3]
    assert pool.get_num_free_blocks() == 6


def test_free_kv_cache_block_queue_prepend_n():
    """test_kv_cache_utils.py::test_free_kv_cache_block_queue_prepend_n: blocks without a key
    freed together go in front of the head, in the order given (0.33.0 BlockPool.free_blocks
    -> FreeKVCacheBlockQueue.prepend_n). vLLM's queue takes KVCacheBlock(0..5), no null block:
    here a plain pool of 6 (null_block=False)."""
    pool = BlockPool(6, null_block=False)
    blocks = pool.get_new_blocks(6)
    pool.cache_block(blocks[0], b"k0")
    pool.free_blocks(blocks[0:1])  # fake_head -> b0 -> fake_tail
    pool.free_blocks([])
    assert list(pool.free_queue) == [0]
    pool.free_blocks(blocks[4:6])  # no key: in front, in order
    assert list(pool.free_queue) == [4, 5, 0]
    pool.free_blocks(blocks[1:3])  # ahead of everything prepended before
    assert list(pool.free_queue) == [1, 2, 4, 5, 0]
    assert [b.block_id for b in pool.get_new_blocks(5)] == [1, 2, 4, 5, 0]
    assert pool.get_num_free_blocks() == 0


def test_free_kv_cache_block_queue_popleft_n():
    """test_kv_cache_utils.py::test_free_kv_cache_block_queue_popleft_n: a queue in the order
    1, 3, 5, 4, 0, 2 pops from the head, n at a time. vLLM's queue holds KVCacheBlock(0..5), no
    null block: here a plain pool of 6 (null_block=False)."""
    pool = BlockPool(6, null_block=False)
    blocks = _taken_keyed(pool)
    pool.free_blocks([blocks[1], blocks[3], blocks[5], blocks[4], blocks[0], blocks[2]])
    assert list(pool.free_queue) == [1, 3, 5, 4, 0, 2]
    assert pool.get_new_blocks(0) == [] and pool.get_num_free_blocks() == 6
    result = pool.get_new_blocks(1)
    assert [b.block_id for b in result] == [1] and pool.get_num_free_blocks() == 5
    result = pool.get_new_blocks(2)
    assert [b.block_id for b in result] == [3, 5] and pool.get_num_free_blocks() == 3
    result = pool.get_new_blocks(3)
    assert [b.block_id for b in result] == [4, 0, 2] and pool.get_num_free_blocks() == 0
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)


def test_free_kv_cache_block_queue_get_all_free_blocks():
    """test_kv_cache_utils.py::test_free_kv_cache_block_queue_get_all_free_blocks. vLLM's queue
    holds KVCacheBlock(0..4) alone, no null block: here a plain pool of 5 (null_block=False)."""
    pool = BlockPool(5, null_block=False)
    blocks = pool.blocks
    assert list(pool.free_queue.values()) == blocks
    pool.get_new_blocks(1)
    assert list(pool.free_queue.values()) == blocks[1:]
    block_to_remove = blocks[2]
    pool.cache_block(block_to_remove, b"k")
    pool.touch([block_to_remove])
    assert list(pool.free_queue.values()) == blocks[1:2] + blocks[3:]
    pool.free_blocks([block_to_remove])
    assert list(pool.free_queue.values()) == blocks[1:2] + blocks[3:] + [block_to_remove]


def test_generate_block_hash_extra_keys_no_mm_inputs():
    """test_kv_cache_utils.py::test_generate_block_hash_extra_keys_no_mm_inputs: no salt, no
    extra keys (vLLM: None; kvlab: an empty tuple)."""
    assert block_extra_keys(0, None) == ()
    assert block_extra_keys(1, None) == ()


def test_generate_block_hash_extra_keys_cache_salt():
    """test_kv_cache_utils.py::test_generate_block_hash_extra_keys_cache_salt: the salt is an
    extra key of the first block only. (vLLM asks by token range: a range starting at token 0
    gets the salt, others not; kvlab asks by block index. For the block-aligned ranges that
    hashing uses the two agree; vLLM's mm half is not applicable.)"""
    assert block_extra_keys(0, "salt") == (("cache_salt", "salt"),)
    assert block_extra_keys(2, "salt") == ()
    assert block_extra_keys(1, "salt") == ()
    # Through the chain: the salt changes block 0's key and so every later key.
    tokens = list(range(6))
    salted, plain = chain(tokens, 3, salt="salt"), chain(tokens, 3)
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert salted[1] == hash_block_tokens(salted[0], tokens[3:6], ())


@pytest.mark.parametrize("hash_algo", HASH_ALGOS)  # vLLM: hash_fn in [sha256, sha256_cbor]
def test_hash_block_tokens(hash_algo):
    """test_kv_cache_utils.py::test_hash_block_tokens: a block's key is the hash function over
    (parent key, this block's tokens, extra keys) (kvlab: over their canonical encoding)."""
    parent_block_hash = b"123"
    curr_block_token_ids = (1, 2, 3)
    extra_keys = (("key1", "key2"),)
    block_hash = hash_block_tokens(parent_block_hash, curr_block_token_ids, extra_keys, hash_algo)
    expected = hashlib.new(hash_algo,
                           encode_block(parent_block_hash, curr_block_token_ids, extra_keys))
    assert block_hash == expected.digest()
    # The chain's properties that vLLM's hash tests rely on.
    assert block_hash != hash_block_tokens(None, curr_block_token_ids, extra_keys, hash_algo)
    assert block_hash != hash_block_tokens(parent_block_hash, (1, 2, 4), extra_keys, hash_algo)
    assert block_hash != hash_block_tokens(parent_block_hash, curr_block_token_ids, (),
                                           hash_algo)


@pytest.mark.parametrize("hash_algo", HASH_ALGOS)
def test_hash_request_tokens_no_mm_inputs(hash_algo):
    """test_kv_cache_utils.py::test_hash_request_tokens_no_mm_inputs (block size 3, 6 tokens).
    vLLM's first parent is NONE_HASH; kvlab's is None."""
    manager = make_manager(11, 3, hash_algo=hash_algo)  # vLLM's test has no pool: any will do
    request = make_request("0", list(range(6)))
    manager.get_computed_blocks(request)  # kvlab fills request.block_hashes lazily
    block_hashes = request.block_hashes
    assert len(block_hashes) == 2
    assert block_hashes[0] == hash_block_tokens(None, (0, 1, 2), (), hash_algo)
    assert block_hashes[1] == hash_block_tokens(block_hashes[0], (3, 4, 5), (), hash_algo)


# =================================================================================================
# tests/v1/core/test_scheduler.py (single full-attention group)
# =================================================================================================
def test_add_requests():
    """test_scheduler.py::test_add_requests (kvlab's scheduler keeps no requests dict)."""
    scheduler = create_scheduler()
    for i, request in enumerate(create_requests(num_requests=10)):
        scheduler.add_request(request)
        assert scheduler.waiting[-1] is request
        assert len(scheduler.waiting) == i + 1


def test_finish_request():
    """test_scheduler.py::test_finish_request (vLLM: finish_requests(id, FINISHED_ABORTED);
    kvlab: finish_request(request, "abort"))."""
    scheduler = create_scheduler()
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)
    for i, request in enumerate(requests):
        scheduler.finish_request(request, "abort")
        assert request not in scheduler.waiting and request.is_finished
        assert request.finish_reason == "abort"
        assert len(scheduler.waiting) == 9 - i


def test_get_num_unfinished_requests():
    """test_scheduler.py::test_get_num_unfinished_requests (kvlab: len(waiting) + len(running),
    and has_unfinished_requests())."""
    scheduler = create_scheduler()
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)
    for i, request in enumerate(requests):
        scheduler.finish_request(request, "stop")
        assert len(scheduler.waiting) + len(scheduler.running) == len(requests) - i - 1
        assert scheduler.has_unfinished_requests() == (i < len(requests) - 1)


# vLLM's second case also asks for prompt logprobs, which kvlab does not have.
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_schedule(enable_prefix_caching):
    """test_scheduler.py::test_schedule."""
    scheduler = create_scheduler(enable_prefix_caching=enable_prefix_caching)
    adapter = SchedulerAdapter(scheduler)
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)

    output = adapter.schedule()
    assert output.scheduled_new_reqs == [r.request_id for r in requests]
    assert output.scheduled_cached_reqs == []
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        assert num_tokens == len(requests[int(req_id)].prompt_token_ids)
    # One block each (10 tokens of 16), in admission order.
    assert output.new_req_block_ids == {str(i): [i + 1] for i in range(10)}
    assert len(scheduler.waiting) == 0
    assert len(scheduler.running) == len(requests)
    for i, request in enumerate(requests):
        assert scheduler.running[i] is request
        assert request.status == RequestStatus.RUNNING


def test_stop_via_update_from_output():
    """test_scheduler.py::test_stop_via_update_from_output, one token per step: vLLM's cases
    verify 1-3 speculative tokens per step, which kvlab does not have. Requests are placed in
    `running` by hand and a SchedulerOutput is built by hand, as vLLM's test does."""
    from kvlab.outputs import ModelRunnerOutput
    from kvlab.scheduler import SchedulerOutput

    def running_scheduler(requests):
        scheduler = create_scheduler()
        for req in requests:
            # As schedule() leaves a request it scheduled (kvlab's and vLLM's both advance
            # num_computed_tokens there): its whole sequence computed.
            req.num_computed_tokens = req.num_tokens
            req.status = RequestStatus.RUNNING
            scheduler.running.append(req)
        return scheduler

    def step(scheduler, sampled):
        out = SchedulerOutput(scheduled=[(r, 1) for r in scheduler.running
                                         if r.request_id in sampled])
        out.num_computed_tokens = {r.request_id: r.num_tokens - 1 for r, _ in out.scheduled}
        for r, _ in out.scheduled:
            r.num_computed_tokens = r.num_tokens
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))

    # Case 1: stop on EOS.
    requests = create_requests(num_requests=2, max_tokens=10)
    scheduler = running_scheduler(requests)
    step(scheduler, {"0": EOS_TOKEN_ID, "1": 10})
    assert scheduler.running == [requests[1]]
    assert requests[0].is_finished and requests[0].finish_reason == "stop"
    assert requests[0].output_token_ids == [EOS_TOKEN_ID]
    assert requests[1].output_token_ids == [10]

    # Case 2: stop on a custom stop token.
    requests = create_requests(num_requests=2, max_tokens=10, stop_token_ids=[42, 43])
    scheduler = running_scheduler(requests)
    step(scheduler, {"0": 10, "1": 13})
    step(scheduler, {"0": 42, "1": 14})
    assert scheduler.running == [requests[1]]
    assert requests[0].is_finished and requests[0].finish_reason == "stop"
    assert requests[0].stop_reason == 42
    assert requests[0].output_token_ids == [10, 42]
    assert requests[1].output_token_ids == [13, 14]

    # Case 3: stop on max tokens.
    requests = create_requests(num_requests=2, max_tokens=2)
    scheduler = running_scheduler(requests)
    step(scheduler, {"0": 10, "1": 13})
    step(scheduler, {"0": 11})
    assert scheduler.running == [requests[1]]
    assert requests[0].is_finished and requests[0].finish_reason == "length"
    assert requests[0].output_token_ids == [10, 11]
    assert requests[1].output_token_ids == [13]

    # Case 4: ignore_eos.
    requests = create_requests(num_requests=1, max_tokens=10, ignore_eos=True)
    scheduler = running_scheduler(requests)
    for token in (EOS_TOKEN_ID, 10, 11):
        step(scheduler, {"0": token})
    assert len(scheduler.running) == 1 and not requests[0].is_finished
    assert requests[0].output_token_ids == [EOS_TOKEN_ID, 10, 11]


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_schedule_order(enable_chunked_prefill):
    """test_scheduler.py::test_schedule_order: without chunked prefill a long request that does
    not fit the remaining budget is not skipped by the short ones behind it."""
    scheduler = create_scheduler(max_num_batched_tokens=1024, max_num_seqs=3,
                                 enable_chunked_prefill=enable_chunked_prefill)
    adapter = SchedulerAdapter(scheduler)
    requests = create_requests(num_requests=2, num_tokens=800, req_ids=["1", "2"])
    requests += create_requests(num_requests=2, num_tokens=10, req_ids=["3", "4"])
    for request in requests:
        scheduler.add_request(request)
    output = adapter.schedule()
    if enable_chunked_prefill:
        assert output.scheduled_new_reqs == ["1", "2"]
        assert output.num_scheduled_tokens == {"1": 800, "2": 224}
    else:
        assert output.scheduled_new_reqs == ["1"]
        assert output.num_scheduled_tokens == {"1": 800}


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_schedule_concurrent_partial_requests(enable_prefix_caching):
    """test_scheduler.py::test_schedule_concurrent_partial_requests: with
    long_prefill_token_threshold=400 three 800-token prompts are prefilled side by side, 400,
    400 and the 224 left of the 1024-token budget, for two steps; then the first two decode and
    the third takes the rest of its prompt (vllm/v1/core/sched/scheduler.py caps running and
    waiting requests alike)."""
    scheduler = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400,
                                 enable_prefix_caching=enable_prefix_caching)
    adapter = SchedulerAdapter(scheduler)
    requests = create_requests(num_requests=3, num_tokens=800)
    for request in requests:
        scheduler.add_request(request)

    output = adapter.schedule()
    assert output.scheduled_new_reqs == ["0", "1", "2"]
    assert output.scheduled_cached_reqs == []
    assert output.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    adapter.update(output)  # mid-prefill: no request is sampled

    output1 = adapter.schedule()
    assert len(scheduler.running) == 3
    assert output1.scheduled_new_reqs == [] and output1.scheduled_cached_reqs == ["0", "1", "2"]
    assert output1.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    adapter.update(output1)  # the first two complete their prompts and are sampled

    output2 = adapter.schedule()
    assert len(scheduler.running) == 3
    assert output2.scheduled_new_reqs == [] and output2.scheduled_cached_reqs == ["0", "1", "2"]
    assert output2.num_scheduled_tokens == {"0": 1, "1": 1, "2": 800 - 224 - 224}


def test_prefix_cache_stats_not_recorded_when_caching_disabled():
    """test_scheduler.py::test_prefix_cache_stats_not_recorded_when_caching_disabled (kvlab
    counts queries and hits in tokens; it has no request count)."""
    scheduler = create_scheduler(enable_prefix_caching=False)
    for request in create_requests(num_requests=2):
        scheduler.add_request(request)
    scheduler.schedule()
    m = scheduler.kv_cache_manager
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)
    assert (m.prefix_cache_preempted_queries, m.prefix_cache_preempted_hits) == (0, 0)


def test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request(monkeypatch):
    """test_scheduler.py::test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request:
    a real hit refused once by allocate_slots and admitted next step counts exactly once. (vLLM
    swaps in a fresh stats accumulator after the seeding step; kvlab's counters add up, so the
    deltas are compared.)"""
    block_size = 16
    scheduler = create_scheduler(enable_prefix_caching=True, enable_chunked_prefill=False,
                                 block_size=block_size)
    adapter = SchedulerAdapter(scheduler)
    m = scheduler.kv_cache_manager

    (seed,) = create_requests(num_requests=1, num_tokens=block_size * 2, max_tokens=2,
                              same_prompt=True, req_ids=["seed"])
    scheduler.add_request(seed)
    while scheduler.has_unfinished_requests():
        adapter.update(adapter.schedule())
    assert seed.is_finished
    base = (m.prefix_cache_queries, m.prefix_cache_hits)

    (retried,) = create_requests(num_requests=1, num_tokens=block_size * 3, max_tokens=1,
                                 same_prompt=True, req_ids=["retried"])
    scheduler.add_request(retried)
    orig_allocate_slots = m.allocate_slots
    results = []

    def spy_allocate_slots(*args, **kwargs):
        result = orig_allocate_slots(*args, **kwargs) if results else False
        results.append(result)
        return result

    monkeypatch.setattr(m, "allocate_slots", spy_allocate_slots)
    assert not adapter.schedule().scheduled_new_reqs
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == base
    assert "retried" in adapter.schedule().num_scheduled_tokens
    assert results[0] is False and results[1] is True
    assert (m.prefix_cache_queries - base[0], m.prefix_cache_hits - base[1]) == (
        retried.num_tokens, block_size * 2)


def test_scheduler_reset_prefix_cache():
    """test_scheduler.py::test_scheduler_reset_prefix_cache."""
    scheduler = create_scheduler(enable_prefix_caching=True)
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    assert len(scheduler.waiting) == 0
    assert scheduler.running == requests

    # Running requests hold KV blocks: the reset fails.
    assert not scheduler.reset_prefix_cache()
    assert scheduler.running == requests

    # reset_running_requests=True preempts them all (newest first, each to the front of the
    # queue), so they wait in their original order, and the reset succeeds.
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert len(scheduler.running) == 0
    assert list(scheduler.waiting) == requests
    assert all(r.status == RequestStatus.PREEMPTED for r in requests)
    # Every block is free again: create_scheduler's 10000 blocks, less the null block.
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_blocks == 10000 and pool.get_num_free_blocks() == 9999
    assert not pool.cached_block_hash_to_block


def test_memory_leak():
    """test_scheduler.py::test_memory_leak (+ its assert_scheduler_empty)."""
    scheduler = create_scheduler(enable_prefix_caching=True)
    adapter = SchedulerAdapter(scheduler)
    requests = create_requests(num_requests=5, num_tokens=10, max_tokens=10)
    for request in requests:
        scheduler.add_request(request)
        adapter.update(adapter.schedule())
    while True:
        output = adapter.schedule()
        if len(scheduler.running) == 0:
            break
        adapter.update(output)

    assert all(r.is_finished and len(r.output_token_ids) == 10 for r in requests)
    # assert_scheduler_empty
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 0
    m = scheduler.kv_cache_manager
    assert len(m.req_to_blocks) == 0 and len(m.num_registered_blocks) == 0
    assert m.block_pool.get_num_free_blocks() == m.block_pool.num_blocks - 1  # vLLM's words
    # Ref counts are 0 (the null block's is never kept); keys stay (freed blocks stay findable
    # until reused).
    assert all(blk.ref_cnt == 0 for blk in m.block_pool.blocks)
    m.block_pool.check_invariants()


# =================================================================================================
# tests/v1/core/test_scheduler.py: priority scheduling (policy="priority",
# vllm/v1/core/sched/request_queue.py and the victim choice in sched/scheduler.py)
# =================================================================================================
def _admitted_in_one_step(priorities, arrival_times, **knobs) -> tuple[list[str], list[str]]:
    """(request ids admitted by the first step, in order; ids left waiting, in queue order)."""
    scheduler = create_scheduler_with_priority(**knobs)
    for request in create_requests_with_priority(len(priorities), priorities, arrival_times):
        scheduler.add_request(request)
    out = scheduler.schedule()
    return [n.req_id for n in out.scheduled_new_reqs], [r.request_id for r in scheduler.waiting]


def test_priority_scheduling_basic_ordering():
    """test_scheduler.py::test_priority_scheduling_basic_ordering: lower value first."""
    assert _admitted_in_one_step([2, 0, 1], [1.0, 2.0, 3.0]) == (["1", "2", "0"], [])


def test_priority_scheduling_arrival_time_tiebreaker():
    """test_scheduler.py::test_priority_scheduling_arrival_time_tiebreaker."""
    assert _admitted_in_one_step([1, 1, 1], [3.0, 1.0, 2.0]) == (["1", "2", "0"], [])


def test_priority_scheduling_mixed_priority_and_arrival():
    """test_scheduler.py::test_priority_scheduling_mixed_priority_and_arrival."""
    assert _admitted_in_one_step([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0]) == (
        ["3", "2", "1", "0"], [])


def test_priority_scheduling_fcfs_fallback():
    """test_scheduler.py::test_priority_scheduling_fcfs_fallback: equal priorities go by
    arrival time."""
    assert _admitted_in_one_step([1, 1, 1, 1], [4.0, 1.0, 3.0, 2.0]) == (
        ["1", "3", "2", "0"], [])


def test_priority_scheduling_preemption_victim_selection():
    """test_scheduler.py::test_priority_scheduling_preemption_victim_selection: one seat; the
    others wait in priority order."""
    assert _admitted_in_one_step([3, 2, 0], [1.0, 2.0, 3.0], max_num_seqs=1) == (
        ["2"], ["1", "0"])


def test_priority_scheduling_equal_priority_preemption():
    """test_scheduler.py::test_priority_scheduling_equal_priority_preemption."""
    assert _admitted_in_one_step([2, 2, 2], [3.0, 1.0, 2.0], max_num_seqs=1) == (
        ["1"], ["2", "0"])


def test_priority_scheduling_waiting_queue_order():
    """test_scheduler.py::test_priority_scheduling_waiting_queue_order."""
    assert _admitted_in_one_step([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], max_num_seqs=1) == (
        ["3"], ["1", "2", "0"])


def test_priority_scheduling_with_limited_slots():
    """test_scheduler.py::test_priority_scheduling_with_limited_slots."""
    assert _admitted_in_one_step([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], max_num_seqs=2,
                                 max_num_batched_tokens=1000) == (["3", "1"], ["2", "0"])


def test_priority_scheduling_heap_property():
    """test_scheduler.py::test_priority_scheduling_heap_property: one seat, each request
    finished after its first step; they run in ascending priority."""
    scheduler = create_scheduler_with_priority(max_num_seqs=1)
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    requests = create_requests_with_priority(len(priorities), priorities)
    for request in requests:
        scheduler.add_request(request)
    ran = []
    while scheduler.waiting:
        out = scheduler.schedule()
        (new,) = out.scheduled_new_reqs
        ran.append(requests[int(new.req_id)].priority)
        scheduler.update_from_output(out, runner_output(out, 100))
        scheduler.finish_request(requests[int(new.req_id)], "stop")
    assert ran == sorted(priorities)


def test_priority_scheduling_no_preemption_when_space_available():
    """test_scheduler.py::test_priority_scheduling_no_preemption_when_space_available."""
    scheduler = create_scheduler_with_priority(max_num_seqs=3, max_num_batched_tokens=200)
    low = create_requests_with_priority(2, [5, 5], [1.0, 2.0], num_tokens=30,
                                        req_ids=["lo1", "lo2"])
    for request in low:
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, 100))
    (high,) = create_requests_with_priority(1, [0], [3.0], num_tokens=30, req_ids=["hi1"])
    scheduler.add_request(high)
    out = scheduler.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["hi1"] and not out.preempted
    assert len(scheduler.running) == 3 and len(scheduler.waiting) == 0


def test_priority_scheduling_preemption_and_resumption_when_out_of_kv():
    """test_scheduler.py::test_priority_scheduling_preemption_and_resumption_when_out_of_kv,
    without its KV and EC connectors (which, it says, must not change the outcome). 5 blocks
    of 16 (the null block + 4 usable). In the 3rd step the low-priority request is scheduled
    first and fits, then the high-priority one needs a 3rd block: the low one is preempted
    although it was scheduled this step (sched/scheduler.py gives its tokens back to the
    budget); it resumes with all 32 of its tokens once the high one finishes."""
    scheduler = create_scheduler_with_priority(max_num_seqs=2, max_num_batched_tokens=200,
                                               num_blocks=5, block_size=16, max_model_len=64,
                                               enable_prefix_caching=False)
    adapter = SchedulerAdapter(scheduler)
    (low,) = create_requests_with_priority(1, [1], [0.0], num_tokens=30)
    scheduler.add_request(low)
    step = adapter.schedule()
    assert step.scheduled_new_reqs == ["0"]
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 1
    adapter.update(step, 100)
    (high,) = create_requests_with_priority(1, [0], [1.0], num_tokens=32, starting_idx=1)
    scheduler.add_request(high)
    step = adapter.schedule()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    assert step.scheduled_new_reqs == ["1"] and step.scheduled_cached_reqs == ["0"]
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 2
    adapter.update(step, 100)
    step = adapter.schedule()
    assert step.scheduled_new_reqs == [] and step.scheduled_cached_reqs == ["1"]
    assert step.preempted_req_ids == ["0"] and step.total_num_scheduled_tokens == 1
    assert low.status == RequestStatus.PREEMPTED
    assert len(scheduler.waiting) == 1 and len(scheduler.running) == 1
    adapter.update(step, 100)  # only the high-priority request ran
    scheduler.finish_request(high, "stop")
    step = adapter.schedule()
    assert step.scheduled_new_reqs == [] and step.scheduled_cached_reqs == ["0"]
    assert step.resumed_req_ids == {"0"} and step.num_scheduled_tokens == {"0": 32}
    assert low.token_ids(0, 32)[31] == 100 and low.output_token_ids == [100, 100]
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 1


# =================================================================================================
# tests/v1/core/test_kv_cache_coordinator.py (its single-group cases). That file tests a
# pool-aware coordinator newer than 0.33.0 (no CompactBlockPool / *_by_pool there); the
# observable outcomes ported here hold in 0.33.0 as well.
# =================================================================================================
def test_single_group_config_maps_manager_to_legacy_pool_alias():
    """test_kv_cache_coordinator.py::test_single_group_config_maps_manager_to_legacy_pool_alias:
    10 blocks, the null block among them, leave 9 free; 32 tokens of 16-token blocks need 2 of
    them."""
    manager = make_manager(10, 16, max_model_len=128)
    assert manager.block_pool.get_num_free_blocks() == 9
    blocks = allocate_slots(manager, make_request("request", [0] * 32), 32)
    assert blocks is not None and len(blocks) == 2
    assert manager.block_pool.get_num_free_blocks() == 7


def test_has_enough_free_blocks_by_pool_uses_pool_tuple():
    """test_kv_cache_coordinator.py::test_has_enough_free_blocks_by_pool_uses_pool_tuple:
    num_blocks=3 includes the null block, leaving two allocatable blocks (vLLM asks the private
    _has_enough_free_blocks_by_pool((2,)) / ((3,)); here: 2 blocks are granted, 3 are not)."""
    manager = make_manager(3, 4, max_model_len=16, enable_caching=False)
    assert manager.block_pool.get_num_free_blocks() == 2
    assert allocate_slots(manager, make_request("three", [0] * 12), 12) is None
    blocks = allocate_slots(manager, make_request("two", [0] * 8), 8)
    assert blocks is not None and block_ids(blocks) == [1, 2]


def test_allocate_slots_uses_pool_aware_accounting_path():
    """test_kv_cache_coordinator.py::test_allocate_slots_uses_pool_aware_accounting_path, its
    observable part (the mocked accounting path is vLLM-internal): 4 tokens of a 4-token block
    in a 3-block pool get block 1."""
    manager = make_manager(3, 4, max_model_len=16, enable_caching=False)
    blocks = allocate_slots(manager, make_request("request", [0] * 4), 4)
    assert blocks is not None and block_ids(blocks) == [1]


# =================================================================================================
# vLLM 0.33.0 source behaviour with no single-group vLLM test (not vLLM tests: `test_src_`)
# =================================================================================================
def test_src_null_block_is_block_0_and_never_counted():
    """vllm/v1/core/block_pool.py BlockPool.__init__ takes block 0 off the free queue for good as
    the null block (`self.null_block = self.free_block_queue.popleft()`, is_null = True), so
    get_num_free_blocks leaves it out; get_usage divides by `num_gpu_blocks - 1`; get_new_blocks
    raises ValueError past the free blocks; reset_prefix_cache succeeds only when the null block
    is the one used block (`num_used_blocks != 1`). A pool of 4: 3 free blocks, ids 1-3; usage
    0.0, then 1 - 1/3 with two taken, then 1.0."""
    pool = BlockPool(4)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3 and list(pool.free_queue) == [1, 2, 3]
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache()
    taken = pool.get_new_blocks(2)
    assert block_ids(taken) == [1, 2]
    assert pool.get_usage() == pytest.approx(1 - 1 / 3)
    last = pool.get_new_blocks(1)
    assert block_ids(last) == [3] and pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(taken + last)
    assert pool.get_num_free_blocks() == 3 and list(pool.free_queue) == [1, 2, 3]
    assert pool.reset_prefix_cache()
    pool.check_invariants()


def test_src_allocate_slots_full_sequence_must_fit_counts_free_queue_hits():
    """vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots(full_sequence_must_fit=True)
    with single_type_kv_cache_manager.py get_num_blocks_to_allocate: the WHOLE sequence
    (min(num_tokens, max_model_len)) must fit the free blocks; prefix hits count as blocks the
    request already has, except hits sitting in the free queue, which it must take."""
    block_size = 16
    manager = make_manager(11, block_size, max_model_len=160)  # 10 usable blocks
    pool = manager.block_pool

    # 7 blocks of prompt, cached, then freed: 7 keyed free blocks, 3 unused.
    prompt = list(range(7 * block_size))
    allocate_slots(manager, make_request("a", prompt), 7 * block_size)
    manager.free("a")

    # Another request takes 3 blocks: 7 free remain, all of them the cached prompt.
    allocate_slots(manager, make_request("b", list(range(1000, 1000 + 3 * block_size))),
                   3 * block_size)
    assert pool.get_num_free_blocks() == 7

    # "c" = the prompt + 1 more block: 8 blocks in all, 7 of them hits ((128 - 1) // 16 = 7),
    # 1 new. The 7 hits sit in the free queue, so taking them uses free blocks too:
    # 7 + 1 = 8 > 7 free, refused as a whole sequence, taking nothing.
    c = make_request("c", prompt + list(range(5000, 5000 + block_size)))
    hits, num_hit = manager.get_computed_blocks(c)
    assert len(hits) == 7 and num_hit == 7 * block_size
    assert allocate_slots(manager, c, block_size, num_hit, hits,
                          full_sequence_must_fit=True) is None
    assert pool.get_num_free_blocks() == 7 and all(b.ref_cnt == 0 for b in hits)

    # Once "b" is gone there are 10 free blocks: it fits, and takes 7 hits + 1 new block.
    manager.free("b")
    blocks = allocate_slots(manager, c, block_size, num_hit, hits, full_sequence_must_fit=True)
    assert blocks is not None and len(blocks) == 1
    assert pool.get_num_free_blocks() == 2
    pool.check_invariants()


def test_src_allocate_slots_full_sequence_must_fit_whole_prompt_not_first_chunk():
    """kv_cache_manager.py allocate_slots(full_sequence_must_fit=True): a 6-block prompt whose
    first chunk (1 block) fits a pool with 5 free blocks is refused; without the gate the chunk
    alone is granted."""
    block_size = 16
    manager = make_manager(11, block_size, max_model_len=160)
    allocate_slots(manager, make_request("hold", list(range(5 * block_size))), 5 * block_size)
    assert manager.block_pool.get_num_free_blocks() == 5
    req = make_request("long", list(range(100, 100 + 6 * block_size)))
    assert allocate_slots(manager, req, block_size, full_sequence_must_fit=True) is None
    assert not manager.req_to_blocks.get("long")
    blocks = allocate_slots(manager, req, block_size)
    assert blocks is not None and len(blocks) == 1


def test_src_allocate_slots_watermark_only_for_waiting_or_preempted():
    """kv_cache_manager.py allocate_slots: watermark_blocks = int(watermark * num_blocks) stay
    free for a request whose status is WAITING or PREEMPTED, and only when has_scheduled_reqs;
    a RUNNING request may use them. num_blocks counts the null block: int(0.2 * 11) = 2."""
    block_size = 16
    manager = make_manager(11, block_size, max_model_len=160, watermark=0.2)  # 10 usable, keep 2
    waiting = make_request("w", list(range(9 * block_size)))
    assert waiting.status == RequestStatus.WAITING
    # 9 + 2 > 10: refused while others run, ...
    assert allocate_slots(manager, waiting, 9 * block_size, has_scheduled_reqs=True) is None
    # ... granted into an idle engine (no watermark when nothing else is scheduled).
    assert allocate_slots(manager, waiting, 9 * block_size, has_scheduled_reqs=False) is not None
    manager.free("w")

    preempted = make_request("p", list(range(9 * block_size)))
    preempted.status = RequestStatus.PREEMPTED
    assert allocate_slots(manager, preempted, 9 * block_size) is None
    fits = make_request("f", list(range(8 * block_size)))  # 8 + 2 <= 10
    assert allocate_slots(manager, fits, 8 * block_size) is not None
    manager.free("f")

    running = make_request("r", list(range(9 * block_size)))
    running.status = RequestStatus.RUNNING
    assert allocate_slots(manager, running, 9 * block_size) is not None


def test_src_fcfs_preempts_newest_running_request():
    """sched/scheduler.py Scheduler.schedule (FCFS: the victim is self.running[-1]) and
    _preempt_request (status PREEMPTED, waiting.prepend_request, num_computed_tokens = 0); no
    admission in a step that preempted; the victim resumes as RUNNING and recomputes all its
    tokens. The block arithmetic is test_scheduler.py::test_priority_scheduling_preemption's
    (block size 16, 6 blocks = the null block + 5 usable), run under FCFS."""
    block_size = 16
    scheduler = create_scheduler(max_num_seqs=3, max_num_batched_tokens=200, num_blocks=6,
                                 block_size=block_size, enable_prefix_caching=False,
                                 max_model_len=80)
    adapter = SchedulerAdapter(scheduler)
    (first,) = create_requests(1, num_tokens=2 * block_size, req_ids=["first"], max_tokens=4)
    (second,) = create_requests(1, num_tokens=2 * block_size, req_ids=["second"], max_tokens=4,
                                starting_idx=1)
    pool = scheduler.kv_cache_manager.block_pool

    scheduler.add_request(first)
    step = adapter.schedule()
    assert step.scheduled_new_reqs == ["first"] and step.new_req_block_ids == {"first": [1, 2]}
    adapter.update(step, 100)  # first: 33 tokens

    scheduler.add_request(second)
    step = adapter.schedule()  # first takes a 3rd block, second is admitted with 2
    assert step.num_scheduled_tokens == {"first": 1, "second": 32}
    assert step.cached_new_block_ids == {"first": [3]}
    assert step.new_req_block_ids == {"second": [4, 5]}
    assert pool.get_num_free_blocks() == 0
    adapter.update(step, 100)  # first: 34 tokens, second: 33

    third = create_requests(1, num_tokens=4, req_ids=["third"], starting_idx=2)[0]
    scheduler.add_request(third)
    step = adapter.schedule()  # second needs a 3rd block, none is free: second (newest) goes
    assert step.preempted_req_ids == ["second"]
    assert step.num_scheduled_tokens == {"first": 1}  # nothing admitted in this step
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert list(scheduler.waiting) == [second, third]  # preempted go to the front
    assert scheduler.running == [first]
    assert pool.get_num_free_blocks() == 2
    adapter.update(step, 100)  # first: 35 tokens

    adapter.update(adapter.schedule(), 100)  # first: 36 tokens = 4 output tokens: done
    assert first.is_finished
    step = adapter.schedule()
    assert step.scheduled_cached_reqs == ["second"] and step.resumed_req_ids == {"second"}
    assert step.num_scheduled_tokens["second"] == 33  # prompt + its output token, recomputed
    assert second.status == RequestStatus.RUNNING and second.num_preemptions == 1
    assert scheduler.num_preemptions == 1


def test_src_scheduler_reserve_full_isl_gates_admission():
    """sched/scheduler.py schedule(): allocate_slots(full_sequence_must_fit=
    self.scheduler_reserve_full_isl, has_scheduled_reqs=bool(self.running)). With the default
    (True) a prompt whose first chunk fits, but whose whole prompt does not, waits; with False
    the chunk is admitted. vllm/config/scheduler.py: scheduler_reserve_full_isl = True."""
    from kvlab.config import EngineConfig

    assert EngineConfig().scheduler_reserve_full_isl is True
    assert EngineConfig().watermark == 0.0
    block_size = 16
    for reserve, admitted in ((True, False), (False, True)):
        kwargs = {} if reserve else {"scheduler_reserve_full_isl": False}
        scheduler = create_scheduler(max_num_batched_tokens=2 * block_size, num_blocks=11,
                                     block_size=block_size, max_model_len=160, **kwargs)
        adapter = SchedulerAdapter(scheduler)
        (hold,) = create_requests(1, num_tokens=5 * block_size, req_ids=["hold"], max_tokens=16)
        scheduler.add_request(hold)
        while hold.num_computed_tokens < hold.num_prompt_tokens:
            adapter.update(adapter.schedule())
        (long,) = create_requests(1, num_tokens=6 * block_size, req_ids=["long"],
                                  starting_idx=1)
        scheduler.add_request(long)
        step = adapter.schedule()  # hold decodes (5 or 6 blocks held); long needs 6 in all
        assert ("long" in step.num_scheduled_tokens) is admitted
        if admitted:
            assert step.num_scheduled_tokens["long"] == 2 * block_size - 1


def test_src_scheduler_watermark_spares_an_idle_engine():
    """sched/scheduler.py schedule(): allocate_slots(..., has_scheduled_reqs=bool(self.running))
    and kv_cache_manager.py allocate_slots (watermark for WAITING/PREEMPTED only). With 11
    blocks (10 usable) and watermark 0.2 (int(0.2 * 11) = 2 blocks, the null block counted), a
    9-block prompt enters the idle engine; a 1-block prompt behind it in the same step does not
    (1 + 2 > 1 free, `running` is no longer empty); the running request still takes the last
    block for its decode; the waiting one enters once the engine is idle again."""
    block_size = 16
    scheduler = create_scheduler(num_blocks=11, block_size=block_size, max_model_len=160,
                                 watermark=0.2)
    adapter = SchedulerAdapter(scheduler)
    (big,) = create_requests(1, num_tokens=9 * block_size, req_ids=["big"], max_tokens=2)
    (small,) = create_requests(1, num_tokens=block_size, req_ids=["small"], starting_idx=1)
    scheduler.add_request(big)
    scheduler.add_request(small)
    pool = scheduler.kv_cache_manager.block_pool

    step = adapter.schedule()
    assert step.scheduled_new_reqs == ["big"]
    assert step.new_req_block_ids == {"big": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    assert list(scheduler.waiting) == [small]
    adapter.update(step)  # big: 145 tokens

    step = adapter.schedule()  # big (RUNNING) takes the 10th block; small still waits
    assert step.num_scheduled_tokens == {"big": 1}
    assert step.cached_new_block_ids == {"big": [10]}
    assert pool.get_num_free_blocks() == 0
    adapter.update(step)  # big: 2 output tokens, done
    assert big.is_finished

    step = adapter.schedule()
    assert step.scheduled_new_reqs == ["small"] and step.num_scheduled_tokens == {"small": 16}


def test_src_watermark_blocks_count_the_null_block():
    """kv_cache_manager.py KVCacheManager.__init__: `watermark_blocks = int(watermark *
    kv_cache_config.num_blocks)`, and kv_cache_config.num_blocks counts the null block (the
    BlockPool is built with num_gpu_blocks = kv_cache_config.num_blocks, block 0 being null).
    A pool of 20 blocks (19 usable) with watermark 0.05 keeps int(1.0) = 1 block free, so a
    waiting request needing all 19 is refused while others run (counting only the 19 usable
    blocks would give int(0.95) = 0, and admit it)."""
    block_size = 16
    manager = make_manager(20, block_size, max_model_len=19 * block_size, watermark=0.05)
    req = make_request("w", list(range(19 * block_size)))
    assert allocate_slots(manager, req, 19 * block_size, has_scheduled_reqs=True) is None


def test_src_watermark_range_is_validated():
    """vllm/config/scheduler.py: watermark = Field(default=0.0, ge=0.0, lt=1.0)."""
    from kvlab.config import EngineConfig

    EngineConfig(watermark=0.0)
    EngineConfig(watermark=0.99)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError):
            EngineConfig(watermark=bad)


def test_src_prefix_hit_leaves_the_last_prompt_token():
    """kv_cache_manager.py get_computed_blocks: the hit is capped at num_tokens - 1 tokens, so
    the last prompt token is always computed (its logits are sampled). Through the scheduler:
    an identical 33-token prompt (2 full blocks cached) schedules 1 token; an identical 32-token
    prompt only hits its first block and schedules 16 (vLLM's test_spec_decode_padding_*
    tests build on the first case)."""
    for num_tokens, expect_scheduled, expect_hit in ((33, 1, 32), (32, 16, 16)):
        scheduler = create_scheduler(enable_prefix_caching=True, block_size=16)
        adapter = SchedulerAdapter(scheduler)
        r1, r2 = create_requests(2, num_tokens=num_tokens, same_prompt=True, max_tokens=16)
        scheduler.add_request(r1)
        step = adapter.schedule()
        assert step.num_scheduled_tokens == {r1.request_id: num_tokens}
        adapter.update(step, 100)
        scheduler.add_request(r2)
        step = adapter.schedule()
        assert step.num_scheduled_tokens == {r1.request_id: 1, r2.request_id: expect_scheduled}
        (admitted,) = step.raw.scheduled_new_reqs
        assert admitted.req_id == r2.request_id and admitted.num_computed_tokens == expect_hit
        assert r2.num_cached_tokens == expect_hit
        # The shared full blocks are the same physical blocks.
        shared = expect_hit // 16
        assert step.new_req_block_ids[r2.request_id][:shared] == \
            block_ids(scheduler.kv_cache_manager.req_to_blocks[r1.request_id][:shared])


# =================================================================================================
# Not ported
# =================================================================================================
_MM = "multimodal input (kvlab is text only)"
_SD = "speculative decoding (kvlab has none)"
_KVC = "KV connector / P-D disaggregation (kvlab has none)"
_EC = "encoder cache / EC connector (kvlab has no encoder)"
_HY = ("hybrid KV cache groups: tests/engine/test_vllm_hybrid_conformance.py ports them or "
       "says why not")
_EA = "EAGLE prefix-cache hashing (kvlab has no EAGLE)"
_CFG = "KV cache sizing from memory / layer specs (kvlab sizes its pool from kv_cache_tokens)"

NOT_PORTED = (
    # ---- test_prefix_caching.py
    ("test_prefill_hybrid_model", PC, _HY),
    ("test_prefill_hybrid_model_eagle", PC, _HY + "; " + _EA),
    ("test_prefill_hybrid_model_combinations", PC, _HY),
    ("test_prefill_hybrid_model_combinations_eagle", PC, _HY + "; " + _EA),
    ("test_prefill_hybrid_model_mamba_align", PC, _HY),
    ("test_hybrid_cache_mamba_align_shared_prefix_detection", PC, _HY),
    ("test_hybrid_model_mamba_align_with_dynamic_draft_tokens", PC, _HY + "; " + _SD),
    ("test_prefill_plp", PC, "prompt logprobs (kvlab has none; its non-plp half is test_prefill)"),
    ("test_cache_blocks_multi_group", PC, _HY),
    ("test_mm_prefix_caching", PC, _MM),
    ("test_prefix_cache_stats_disabled", PC, "log_stats=False / prefix_cache_stats object: "
     "kvlab always keeps its plain counters"),
    ("test_kv_cache_events_with_lora", PC, "LoRA (kvlab has none)"),
    ("test_block_stored_event_group_idx", PC, _HY + " (group_idx / spec kind in events)"),
    ("test_block_stored_event_group_idx_multiple_groups", PC, _HY),
    ("test_block_stored_event_group_idx_out_of_bounds", PC, _HY),
    ("test_emit_cached_block_events", PC, "emit_cached_block_events (events for reused prefix "
     "blocks) is not part of kvlab's event API"),
    ("test_emit_cached_block_events_disabled", PC, "as test_emit_cached_block_events; the "
     "'disabled records nothing' half is test_src_kv_events_disabled_record_nothing"),
    ("test_emit_cached_block_events_zero_cached", PC, "as test_emit_cached_block_events"),
    ("test_eagle_identical_prompt_hits_last_safe_block", PC, _EA),
    ("test_eagle_with_partial_blocks", PC, _EA),
    ("test_eagle_successor_token_controls_last_block_hit", PC, _EA),
    ("test_eagle_blocks_are_published_only_after_draft_materialization", PC, _EA),
    ("test_eagle_kv_events_publish_successor_hashes", PC, _EA),
    ("test_eagle_kv_event_reconstructs_hash_with_coarser_cache_block", PC, _EA),
    ("test_masked_block_does_not_emit_empty_stored_event", PC, "block masks exist only for "
     "sparse retention of non-full-attention groups"),
    ("test_eagle_hash_is_published_when_successor_arrives", PC, _EA),
    ("test_eagle_hashing_supports_resumable_requests", PC, _EA),
    ("test_eagle_hybrid_mamba_hits_partial_prompt_boundary", PC, _EA + "; " + _HY),
    ("test_eagle_with_sliding_window", PC, _EA + "; " + _HY),
    ("test_eagle_swa_alignment_caches_extra_block", PC, _EA + "; " + _HY),
    ("test_eagle_swa_boundary_caches_post_boundary_block", PC, _EA + "; " + _HY),
    ("test_eagle_grouped_swa_siblings_use_same_cache_mask", PC, _EA + "; " + _HY),
    ("test_different_block_size", PC, _HY),
    ("test_hybrid_cache_blocks_swa_tail_window_only", PC, _HY),
    ("test_hybrid_cache_blocks_clamped_to_lcm", PC, _HY),
    ("test_hybrid_local_kv_retention_interval_aligns_in_manager", PC, _HY),
    ("test_hybrid_local_kv_retention_interval_rejects_invalid", PC, _HY),
    ("test_hybrid_local_kv_retention_interval_survives_recycling", PC, _HY),
    ("test_hybrid_local_kv_retention_latest_only_reuses_replay_boundary", PC, _HY),
    ("test_hybrid_local_kv_retention_mtp_reuses_latest_boundary", PC, _HY),
    ("test_can_fit_full_sequence_swa_cap_admits_long_prompt", PC, _HY),
    ("test_cache_hit_local_and_external", PC, _KVC + "; " + _HY),
    ("test_cache_hit_local_and_external_three_groups", PC, _KVC + "; " + _HY),
    ("test_cache_hit_local_and_external_three_groups_preempt_and_reallocate", PC,
     _KVC + "; " + _HY),
    ("test_cache_hit_local_and_external_two_groups_preempt_and_reallocate", PC,
     _KVC + "; " + _HY),
    ("test_swa_free_split_keeps_cached_tail_ahead_of_scratch", PC, _HY),
    ("test_pure_swa_retention_interval_caches_sparse_tails", PC, _HY),
    ("test_pure_swa_retention_latest_only", PC, _HY),
    ("test_pure_swa_retention_dense_default_caches_all", PC, _HY),
    ("test_mamba_reachable_block_mask_sparsifies_retention", PC, _HY),
    ("test_mamba_reachable_block_mask_pins_shared_prefix", PC, _HY),
    ("test_mamba_shared_prefix_survives_zero_retention", PC, _HY),
    ("test_mamba_shared_prefix_reuse_under_zero_retention", PC, _HY),
    ("test_swa_reachable_block_mask_pins_shared_prefix", PC, _HY),
    ("test_swa_shared_prefix_reuse_under_zero_retention", PC, _HY),
    # ---- test_kv_cache_utils.py
    ("test_kv_cache_block_uses_slots", KU, "__slots__ is a memory optimisation; kvlab's "
     "KVCacheBlock is a plain dataclass"),
    ("test_none_hash", KU, "kvlab has no NONE_HASH seed: the first block's parent is None and "
     "keys are plain digests, identical across processes by construction"),
    ("test_none_hash_seed_random_for_non_crypto", KU, "kvlab offers only cryptographic hashes "
     "(HASH_ALGOS), no xxhash"),
    ("test_none_hash_seed_deterministic_for_crypto", KU, "as test_none_hash"),
    ("test_get_none_hash_seed_reports_effective_seed", KU, "as test_none_hash (and P2P)"),
    ("test_generate_block_hash_extra_keys", KU, _MM),
    ("test_generate_block_hash_extra_keys_prompt_embeds", KU, "prompt embeds (kvlab has none)"),
    ("test_generate_block_hash_extra_keys_prompt_embeds_cached", KU, "prompt embeds"),
    ("test_generate_block_hash_extra_keys_different_prompt_embeds", KU, "prompt embeds"),
    ("test_generate_block_hash_extra_keys_lora", KU, "LoRA (kvlab has none)"),
    ("test_request_block_hasher", KU, _MM),
    ("test_hash_tokens_different_mm_input", KU, _MM),
    ("test_metrics", KU, "CachingMetrics (a sliding-window hit-rate aggregator) has no kvlab "
     "counterpart: kvlab keeps cumulative query/hit counters"),
    ("test_metrics_empty_stats", KU, "as test_metrics"),
    ("test_effective_attention_block_size_matches_events", KU, "context parallelism (dcp)"),
    ("test_kv_cache_config_selects_only_transferable_groups", KU, _KVC),
    ("test_kv_cache_config_selects_prefix_cacheable_groups", KU, _HY),
    ("test_kv_cache_blocks_selects_requested_groups", KU, _HY),
    ("test_hisparse_hma_uses_resolved_gpu_block_size", KU, _CFG + "; HiSparse"),
    ("test_hisparse_rejects_deepseek_v4", KU, _CFG + "; HiSparse"),
    ("test_get_kv_cache_configs_multiple_workers", KU, _CFG + " (and the remaining "
     "get_kv_cache_config* / estimate_max_model_len* / check_enough_kv_cache_memory* tests of "
     "this file)"),
    # ---- test_scheduler.py
    ("test_make_scheduled_encoder_input_stats_output_embeddings", SC, _EC),
    ("test_scheduled_encoder_input_stats_disabled_without_iteration_logging", SC, _EC),
    ("test_scheduled_encoder_input_stats_disabled_without_log_stats", SC, _EC),
    ("test_scheduler_stats_route_to_existing_output_client", SC, "engine-core output clients "
     "and scheduler stats objects (kvlab has one in-process engine)"),
    ("test_scheduler_publishes_eagle_blocks_after_worker_acknowledgement", SC, _EA),
    ("test_scheduler_does_not_publish_eagle_blocks_without_worker_acknowledgement", SC, _EA),
    ("test_connector_finish_includes_partial_eagle_block", SC, _EA + "; " + _KVC),
    ("test_schedule_multimodal_requests", SC, _MM),
    ("test_async_scheduling_pp_allows_rescheduling_with_output_placeholders", SC,
     "async scheduling + pipeline parallelism"),
    ("test_cached_request_data_resumed_all_token_ids_mrv1_only", SC, "model runner V1/V2 "
     "payload format (kvlab sends whole block tables and Request objects)"),
    ("test_schedule_partial_requests", SC, _MM),
    ("test_schedule_prefills_gating", SC, "DP prefill throttling (throttle_prefills)"),
    ("test_throttle_prefills_excludes_fully_transferred_remote_kv", SC, _KVC),
    ("test_throttle_prefills_defers_remote_kv_resume_with_local_prefill", SC, _KVC),
    ("test_throttle_defers_inflight_prefill_chunk", SC, "DP prefill throttling"),
    ("test_throttle_capacity_bound_guard_admits", SC, "DP prefill throttling"),
    ("test_no_mm_input_chunking", SC, _MM),
    ("test_check_stop_min_tokens", SC, "SamplingParams.min_tokens (kvlab has none)"),
    ("test_prefix_cache_query_not_inflated_by_connector_defer", SC, _KVC),
    ("test_reset_connector_cache_no_connector_is_no_op_success", SC, _KVC),
    ("test_schedule_spec_decoding_stats", SC, _SD),
    ("test_spec_decoding_stats_empty_output", SC, _SD),
    ("test_no_spec_tokens_scheduled_for_prefill_chunks", SC, _SD),
    ("test_spec_decode_padding_first_decode_step", SC, _SD),
    ("test_spec_decode_padding_skipped_for_diffusion", SC, _SD),
    ("test_spec_decode_padding_skipped_with_prefill_in_batch", SC, _SD),
    ("test_scheduler_stats_waiting_queues", SC, "skipped_waiting queue (remote KV / grammar)"),
    ("test_kv_connector_basic", SC, _KVC),
    ("test_external_prefix_cache_metrics", SC, _KVC),
    ("test_kv_connector_unable_to_allocate", SC, _KVC),
    ("test_kv_connector_handles_preemption", SC, _KVC),
    ("test_priority_scheduling_preemption", SC, "it expects a high-priority arrival that does "
     "not fit to be admitted or to preempt someone, but the waiting loop never preempts "
     "(sched/scheduler.py) and vLLM's own copy is skipped, 'needs investigation'; its block "
     "arithmetic is reused, under FCFS, by test_src_fcfs_preempts_newest_running_request"),
    ("test_schedule_skip_tokenizer_init", SC, "skip_tokenizer_init: kvlab's scheduler never "
     "touches a tokenizer"),
    ("test_schedule_skip_tokenizer_init_structured_output_request", SC, "structured output"),
    ("test_grammar_compile_error_finishes_only_request", SC, "structured output"),
    ("test_abort_request_when_structured_output_fsm_cannot_advance", SC, "structured output"),
    ("test_chunked_prefill_disabled_for_encoder_decoder", SC, "encoder-decoder models"),
    ("test_scheduler_no_ec_connector_by_default", SC, _EC),
    ("test_ec_connector_text_only_request", SC, _EC),
    ("test_ec_connector_cache_hit_external_load", SC, _EC),
    ("test_ec_connector_allocate_encoder_tokens_with_external_load", SC, _EC),
    ("test_ec_connector_ensure_cache_available_defers_request", SC, _EC),
    ("test_ec_connector_pending_prefetch_only_checks_future_mm_features", SC, _EC),
    ("test_prepend_skipped_requests_order", SC, _KVC + " (skipped_waiting)"),
    ("test_remote_kv_promotion_keeps_fcfs_with_grammar_prefix", SC, _KVC),
    ("test_fcfs_mixed_skipped_waiting_types_keep_order", SC, _KVC + "; structured output; "
     "streaming input"),
    ("test_abort_request_waiting_for_remote_kvs", SC, _KVC),
    ("test_abort_request_finished_recving", SC, _KVC),
    ("test_delayed_kv_connector_free_keeps_scheduler_active", SC, _KVC),
    ("test_scheduler_kv_connector_stats", SC, _KVC),
    ("test_variable_length_cross_attn_block_allocation", SC, "encoder-decoder cross-attention"),
    ("test_cross_attn_blocks_not_over_allocated", SC, "encoder-decoder cross-attention"),
    ("test_cross_attn_blocks_not_under_allocated", SC, "encoder-decoder cross-attention"),
    ("test_cross_attn_zero_blocks_without_encoder_inputs", SC, "encoder-decoder"),
    ("test_eagle3_mm_encoder_cache_with_shift", SC, _EA + "; " + _MM),
    ("test_free_encoder_inputs_respects_unconfirmed_placeholders", SC, _EC + "; " + _SD),
    ("test_free_encoder_inputs_defers_for_eagle_lookahead", SC, _EC),
    ("test_free_encoder_inputs_unchanged_without_spec_decode", SC, _EC),
    ("test_encoder_cache_retained_across_preemption_and_resume", SC, _EC),
    ("test_encoder_cache_recomputed_when_evicted_during_preemption", SC, _EC),
    ("test_async_load_reservation_prevents_wedge_e2e", SC, _KVC),
    ("test_hybrid_per_group_hit_divergence_with_connector", SC, _HY + "; " + _KVC),
    ("test_hybrid_per_group_hit_divergence_fa_deeper_no_external", SC, _HY),
    # ---- other files under tests/v1/core
    ("test_external_computed_blocks_do_not_corrupt_free_pool",
     "tests/v1/core/test_single_type_kv_cache_manager.py", _KVC + " (external computed blocks;"
     " the rest of this file tests sliding-window, chunked-local, Mamba and circular-buffer "
     "managers: " + _HY + ")"),
    ("TestBlockPoolLazyNullBlock (all six tests)", "tests/v1/core/test_block_pool.py",
     "a lazily allocated null block is newer than 0.33.0, whose BlockPool takes block 0 "
     "eagerly in __init__ (reset_prefix_cache expects exactly 1 used block), as kvlab's does; "
     "the eager null block is pinned by test_src_null_block_is_block_0_and_never_counted"),
    ("test_attention_free_config_keeps_legacy_shared_pool_alias",
     "tests/v1/core/test_kv_cache_coordinator.py", "attention-free models (no KV groups)"),
    ("test_multi_group_single_pool_config_maps_all_managers_to_legacy_pool_alias",
     "tests/v1/core/test_kv_cache_coordinator.py", _HY),
    ("test_multi_pool_config_without_prefix_cache_builds_configured_pools",
     "tests/v1/core/test_kv_cache_coordinator.py", _HY + " (multiple pools)"),
    ("test_allocate_slots_checks_each_pool_independently",
     "tests/v1/core/test_kv_cache_coordinator.py", _HY + " (multiple pools)"),
    ("test_multi_pool_config_with_prefix_cache_is_rejected_until_pool_aware",
     "tests/v1/core/test_kv_cache_coordinator.py", _HY + " (multiple pools)"),
    ("tests/v1/core/test_request_queue.py (all)", "tests/v1/core/test_request_queue.py",
     "the queue classes themselves: kvlab's are tested, from vllm/v1/core/sched/"
     "request_queue.py, in tests/engine/test_scheduling_policy.py"),
    ("tests/v1/core/test_output.py (all)", "tests/v1/core/test_output.py",
     "NewRequestData's repr of prompt embeds (kvlab has no prompt embeds)"),
    ("tests/v1/core/test_encoder_cache_manager.py (all)",
     "tests/v1/core/test_encoder_cache_manager.py", _EC),
    ("tests/v1/core/test_kv_sharing.py (all)", "tests/v1/core/test_kv_sharing.py",
     "KV cache sharing between layers (kvlab's layers each own their K/V)"),
    ("tests/v1/core/test_kv_cache_metrics.py (all)", "tests/v1/core/test_kv_cache_metrics.py",
     "KVCacheMetricsCollector (sampled block residency metrics) has no kvlab counterpart"),
    ("tests/v1/core/test_scheduler_e2e.py and test_reset_prefix_cache_e2e.py",
     "tests/v1/core/", "end-to-end through LLM(...): they load a model (this suite must not); "
     "their scheduler-level content is test_scheduler_reset_prefix_cache and test_memory_leak"),
)


def test_not_ported_names_are_not_defined_as_tests():
    """A vLLM test is either ported (a test of that name here) or listed in NOT_PORTED."""
    check_not_ported(NOT_PORTED, globals())

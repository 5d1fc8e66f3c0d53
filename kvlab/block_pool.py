"""The block pool: which KV blocks exist, who references them, and which are free.

Defined in notebook 01 (allocate / free); ref counts carry copy-on-write in 02 and the free
queue's order carries prefix-cache eviction in 05. The pool knows nothing about tensors: it hands
out block ids, and `kv_cache.py` turns ids into memory. It follows vLLM 0.33.0's
`vllm/v1/core/block_pool.py`; the contiguous baseline's allocator lives beside it, in
`kv_cache.ContiguousKVCacheManager`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvlab.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass
class KVCacheBlock:
    """One block of `block_size` token slots in the physical KV pool."""

    block_id: int
    # How many block tables hold this block. 0 means free. Forked sequences (chapter 02) share
    # blocks, so this can exceed 1; a block returns to the free queue only when it drops to 0.
    ref_cnt: int = 0
    # Prefix caching (chapter 05): the key of the full block this holds, kept after it is freed
    # so a later request can find it again, dropped when the block is reused.
    block_hash: bytes | None = None
    # vLLM's null block (block 0): a placeholder that is never handed out, never freed and never
    # counted (vllm/v1/core/block_pool.py, BlockPool.null_block). Its ref_cnt is not kept.
    is_null: bool = False


class BlockPool:
    """Blocks, their reference counts, and a free queue.

    The free queue is an `OrderedDict` (block_id -> block): popping the head and appending to
    the tail are O(1), and so is removing a block from the middle, which prefix caching needs when
    a freed block is found again and taken back (chapter 05). Blocks are taken from its head.

    Its order is vLLM 0.33.0's: a freed block that holds no prefix-cache key (a request's
    partly filled last block; every block when caching is off) goes to the head, to be reused
    first (no one can ever hit it, and reusing a block just written keeps memory warm); a keyed
    block goes to the tail, so cached prefixes survive longest and the head of the keyed part is
    the least recently freed one (LRU eviction).

    Block 0 is vLLM's null block: taken out of the free queue when the pool is made and never
    handed out, so a pool of N blocks hands out ids 1..N-1 and holds (N - 1) x block_size
    tokens, as vLLM's does (`--num-gpu-blocks-override N`). vLLM puts it where a block table
    needs a placeholder (a sliding window's dropped blocks); the full-attention layout here
    never needs one, but the ids and counts are vLLM's.
    """

    def __init__(self, num_blocks: int, enable_kv_cache_events: bool = False, *,
                 null_block: bool = True) -> None:
        # null_block=False: a plain pool of N blocks that hands out all N, for chapter 01-02's
        # exercises on the data structure alone (no engine, no vLLM ids to match).
        if num_blocks < 1 + null_block:
            raise ValueError(f"a block pool needs at least {1 + null_block} blocks"
                             + (" (block 0 is the null block)" if null_block else "")
                             + f", got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (blk.block_id, blk) for blk in self.blocks
        )
        self.null_block: KVCacheBlock | None = None
        if null_block:  # block 0, for good
            _, self.null_block = self.free_queue.popitem(last=False)
            self.null_block.is_null = True
        # Prefix caching: key -> every block holding that prefix (running or free, not yet
        # reused), by block id. Usually one; two requests that computed the same block before
        # either was cached hold two copies, and both stay findable (vLLM's
        # BlockHashToBlockMap in vllm/v1/core/block_pool.py): evicting one copy must not hide
        # the other, which a running request still holds. Blocks are never merged, so block
        # tables stay append-only.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        # KV cache events (kvlab/kv_events.py), recorded only when someone will drain them.
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        # Block residency (kvlab/kv_cache_metrics.py), timed only when a collector is attached.
        self.metrics_collector = None

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """The blocks that can be handed out: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    def get_num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self.free_queue)

    def get_usage(self) -> float:
        """The share of the usable blocks in use (vLLM: BlockPool.get_usage, null block left
        out), what vllm:kv_cache_usage_perc reports."""
        return self.get_num_used_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue (all or nothing)."""
        if num_blocks > len(self.free_queue):
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {len(self.free_queue)} are free"
            )
        blocks = []
        collector = self.metrics_collector
        for _ in range(num_blocks):
            # The head: an unkeyed block if there is one, else the least recently freed
            # cached block (the LRU eviction victim).
            _, blk = self.free_queue.popitem(last=False)
            assert blk.ref_cnt == 0, f"block {blk.block_id} was free with ref_cnt {blk.ref_cnt}"
            self._evict(blk)
            blk.ref_cnt = 1
            if collector is not None:  # its old content is gone: one life ends, one begins
                collector.on_block_evicted(blk.block_id)
                collector.on_block_allocated(blk.block_id)
            blocks.append(blk)
        return blocks

    def _evict(self, blk: KVCacheBlock) -> None:
        """A block about to be overwritten stops standing for its prefix."""
        if blk.block_hash is not None:
            copies = self.cached_block_hash_to_block.get(blk.block_hash)
            if copies is not None:
                copies.pop(blk.block_id, None)
                if not copies:
                    del self.cached_block_hash_to_block[blk.block_hash]
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(BlockRemoved([blk.block_hash], [blk.block_id]))
            blk.block_hash = None

    def uncache_block(self, blk: KVCacheBlock) -> None:
        """Forget a block's key: its K/V was never written (a failed step), so no one may hit it."""
        self._evict(blk)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any block holding this prefix (the oldest registered copy), or None."""
        copies = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(copies.values())) if copies else None

    def cache_block(self, blk: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a full block under its key, beside any other copy of the same prefix.
        Returns False for a block that already has a key (a prefix hit being adopted)."""
        if blk.block_hash is not None:
            return False
        blk.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, {})[blk.block_id] = blk
        return True

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          parent_block_hash: bytes | None, token_ids: list[int],
                          block_size: int) -> None:
        """Key a run of consecutive full blocks of one request (vLLM: cache_full_blocks), and
        record one `BlockStored` for those that were not keyed yet."""
        # The null block holds no prefix (vLLM's cache_full_blocks skips it too).
        stored = [(blk, h) for blk, h in zip(blocks, block_hashes)
                  if not blk.is_null and self.cache_block(blk, h)]
        if stored and self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockStored(
                [h for _, h in stored], parent_block_hash, list(token_ids), block_size,
                [blk.block_id for blk, _ in stored]))

    def reset_prefix_cache(self) -> bool:
        """Forget every key, so nothing can hit (vLLM: BlockPool.reset_prefix_cache, used to
        measure a cold cache or after new weights). Refused, changing nothing, while any block is
        held: a running request's blocks would lose their keys under it."""
        if self.get_num_used_blocks() != 0:
            return False
        self.cached_block_hash_to_block.clear()
        for blk in self.blocks:
            blk.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (vLLM: take_events)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each block: a forked sequence now shares it, or a prefix-cache
        hit takes it back, out of the free queue in O(1), before it can be evicted."""
        for blk in blocks:
            if blk.is_null:  # never counted (vLLM's touch skips it too)
                continue
            if blk.ref_cnt == 0:
                del self.free_queue[blk.block_id]
            blk.ref_cnt += 1
        if self.metrics_collector is not None:
            for blk in blocks:
                self.metrics_collector.on_block_accessed(blk.block_id)

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block. Blocks that reach 0 rejoin the free queue:
        unkeyed ones at its head, keyed ones at its tail (see the class docstring).

        `ordered_blocks` come in eviction order, the first to be reused first: callers pass a
        request's blocks last block first, so its tail blocks (the least shareable) are evicted
        before its prefix.
        """
        for blk in ordered_blocks:  # check first: a bad call changes nothing
            if blk.is_null:
                raise RuntimeError("the null block (block 0) is never freed")
            if blk.ref_cnt <= 0:
                raise RuntimeError(f"block {blk.block_id} freed more times than it was taken")
        to_head, to_tail = [], []
        for blk in ordered_blocks:
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                (to_tail if blk.block_hash is not None else to_head).append(blk)
        for blk in to_tail:
            self.free_queue[blk.block_id] = blk
        for blk in reversed(to_head):  # the first given ends up at the very head
            self.free_queue[blk.block_id] = blk
            self.free_queue.move_to_end(blk.block_id, last=False)

    def check_invariants(self) -> None:
        """Free means ref_cnt 0 and in the queue; nothing is both; counts add up."""
        if self.null_block is not None:
            assert self.null_block.block_id not in self.free_queue, "the null block is free"
        for blk in self.blocks:
            if blk.is_null:
                continue
            in_queue = blk.block_id in self.free_queue
            assert blk.ref_cnt >= 0, f"block {blk.block_id} has ref_cnt {blk.ref_cnt}"
            assert in_queue == (blk.ref_cnt == 0), (
                f"block {blk.block_id}: ref_cnt {blk.ref_cnt}, in free queue {in_queue}"
            )
        assert self.get_num_free_blocks() + self.get_num_used_blocks() == self.num_usable_blocks
        for key, copies in self.cached_block_hash_to_block.items():
            assert copies, f"an empty entry for key {key.hex()[:8]}"
            for block_id, blk in copies.items():
                assert blk.block_id == block_id and blk.block_hash == key, (
                    f"block {blk.block_id} is indexed under another key")

"""The block pool: which KV blocks exist, who references them, and which are free.

Defined in notebook 01 (allocate / free); ref counts carry copy-on-write in 02 and the free
queue's order carries prefix-cache eviction in 05. The pool knows nothing about tensors: it hands
out block ids, and `kv_cache.py` turns ids into memory.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


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


class BlockPool:
    """Blocks, their reference counts, and a free queue.

    The free queue is an `OrderedDict` (block_id -> block): popping the head and appending to
    the tail are O(1), and so is removing a block from the middle, which prefix caching needs when
    a freed block is found again and taken back (chapter 05). Its order is the eviction order:
    least recently freed first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (blk.block_id, blk) for blk in self.blocks
        )
        # Prefix caching: key -> every block holding that prefix (running or free, not yet
        # reused), by block id. Usually one; two requests that computed the same block before
        # either was cached hold two copies, and both stay findable (vLLM's
        # BlockHashToBlockMap in vllm/v1/core/block_pool.py): evicting one copy must not hide
        # the other, which a running request still holds. Blocks are never merged, so block
        # tables stay append-only.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue (all or nothing)."""
        if num_blocks > len(self.free_queue):
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {len(self.free_queue)} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            # The head is the least recently freed block: the eviction victim (LRU).
            _, blk = self.free_queue.popitem(last=False)
            assert blk.ref_cnt == 0, f"block {blk.block_id} was free with ref_cnt {blk.ref_cnt}"
            self._evict(blk)
            blk.ref_cnt = 1
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
            blk.block_hash = None

    def uncache_block(self, blk: KVCacheBlock) -> None:
        """Forget a block's key: its K/V was never written (a failed step), so no one may hit it."""
        self._evict(blk)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any block holding this prefix (the oldest registered copy), or None."""
        copies = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(copies.values())) if copies else None

    def cache_block(self, blk: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its key, beside any other copy of the same prefix."""
        if blk.block_hash is None:
            blk.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[blk.block_id] = blk

    def find_contiguous_free_run(self, num_blocks: int) -> int | None:
        """First fit: the lowest block id that starts `num_blocks` consecutive free blocks.

        The pre-vLLM allocators worked this way: a request needs one unbroken region, so free
        space split into gaps smaller than a region is unusable (external fragmentation).
        """
        run_start, run_len = 0, 0
        for blk in self.blocks:
            if blk.ref_cnt == 0:
                if run_len == 0:
                    run_start = blk.block_id
                run_len += 1
                if run_len == num_blocks:
                    return run_start
            else:
                run_len = 0
        return None

    def get_contiguous_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Reserve one unbroken run of blocks, first fit; None if no gap is large enough."""
        start = self.find_contiguous_free_run(num_blocks)
        if start is None:
            return None
        blocks = self.blocks[start : start + num_blocks]
        for blk in blocks:
            del self.free_queue[blk.block_id]  # O(1) removal from the middle of the queue
            self._evict(blk)
            blk.ref_cnt = 1
        return blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each block: a forked sequence now shares it, or a prefix-cache
        hit takes it back, out of the free queue in O(1), before it can be evicted."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self.free_queue[blk.block_id]
            blk.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks that reach 0 join the free queue's tail.

        Callers pass a request's blocks in reverse order (last block first), so that when prefix
        caching keeps freed blocks findable, a request's tail blocks (the least shareable) sit
        nearer the head of the queue and are evicted first.
        """
        for blk in blocks:
            if blk.ref_cnt <= 0:
                raise RuntimeError(f"block {blk.block_id} freed more times than it was taken")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self.free_queue[blk.block_id] = blk

    def check_invariants(self) -> None:
        """Free means ref_cnt 0 and in the queue; nothing is both; counts add up."""
        for blk in self.blocks:
            in_queue = blk.block_id in self.free_queue
            assert blk.ref_cnt >= 0, f"block {blk.block_id} has ref_cnt {blk.ref_cnt}"
            assert in_queue == (blk.ref_cnt == 0), (
                f"block {blk.block_id}: ref_cnt {blk.ref_cnt}, in free queue {in_queue}"
            )
        assert self.get_num_free_blocks() + self.get_num_used_blocks() == self.num_blocks
        for key, copies in self.cached_block_hash_to_block.items():
            assert copies, f"an empty entry for key {key.hex()[:8]}"
            for block_id, blk in copies.items():
                assert blk.block_id == block_id and blk.block_hash == key, (
                    f"block {blk.block_id} is indexed under another key")

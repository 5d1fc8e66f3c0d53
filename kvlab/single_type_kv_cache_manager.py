"""One KV cache group's block tables: a manager per attention type (vLLM's
`vllm/v1/core/single_type_kv_cache_manager.py`, the two types kvlab runs).

Defined in notebook 09. Every group's manager draws from the same `BlockPool`; what differs is
which blocks a request still needs. A full-attention layer reads every earlier token, so its
blocks stay until the request ends. A sliding-window layer reads only the last
`sliding_window` positions: a block wholly before the window of the next token is given back
while the request runs, and the **null block** (block 0) takes its place in the table, so block
i still holds positions i x block_size onward (`remove_skipped_blocks`).

Prefix-cache keys carry the group (vLLM's `BlockHashWithGroupId`): the same tokens' block in
two groups holds different layers' K/V, so each group keys and finds its own.
"""

from __future__ import annotations

from kvlab.block_pool import BlockPool, KVCacheBlock
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv


def group_block_hash(block_hash: bytes, group_id: int) -> bytes:
    """A block's key in one group: its hash and the group id (vLLM's
    `make_block_hash_with_group_id`, in vllm/v1/core/kv_cache_utils.py, appends it the same
    way)."""
    return block_hash + group_id.to_bytes(4, "big", signed=False)


class SingleTypeKVCacheManager:
    """The block tables of one group. The coordinator calls these, group by group, in vLLM's
    order: `remove_skipped_blocks`, `get_num_blocks_to_allocate`, then (once every group has
    room) `add_computed_blocks` and `allocate_new_blocks`, `cache_blocks`, and `free`."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int):
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # blocks already keyed (or passed over)

    # ---- what the window skips (nothing, for full attention) ----------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token (position `num_computed_tokens`)."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the next token's window, the null block in their
        place; from the last such block backwards, stopping at one already given back."""
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped <= 0 or not blocks:
            return
        freed = []
        for i in range(min(num_skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self.null_block
        if freed:
            self.block_pool.free_blocks(freed)

    # ---- allocation ---------------------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock],
                                   num_computed_tokens: int, cap: int | None = None) -> int:
        """Free blocks this group needs to cover `num_tokens`: new ones, plus the hits still in
        the free queue (taking them removes them from it). `cap`: vLLM's admission cap for a
        window group (a request never holds more than the window's blocks)."""
        required = cdiv(num_tokens, self.block_size)
        if cap is not None:
            required = min(required, cap)
        held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.req_to_blocks:  # running: no new hits, only growth
            return max(required - held, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        new = max(required - max(num_skipped_blocks, len(new_computed_blocks)), 0)
        kept_hits = new_computed_blocks[num_skipped_blocks:]
        return new + sum(1 for blk in kept_hits if blk.ref_cnt == 0 and not blk.is_null)

    def add_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock],
                            num_computed_tokens: int) -> None:
        """Start a new request's table with its hits; those already outside the window are
        not taken (null blocks stand in for them)."""
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        kept = list(new_computed_blocks[num_skipped_blocks:])
        self.block_pool.touch(kept)
        table = [self.null_block] * num_skipped_blocks + kept
        self.req_to_blocks[request_id] = table
        self.num_cached_block[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        table = self.req_to_blocks.setdefault(request_id, [])
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.block_pool.get_new_blocks(missing))

    # ---- prefix caching -----------------------------------------------------------------------
    def cache_blocks(self, request, num_full: int, keep: list[bool] | None = None) -> None:
        """Key the table's blocks [already keyed, num_full) under the request's block hashes:
        the null block never, and a block `keep` marks False is passed over for good (vLLM's
        sparse retention in window groups)."""
        rid, bs = request.request_id, self.block_size
        table = self.req_to_blocks.get(rid, [])
        done = self.num_cached_block.get(rid, 0)
        hashes = request.block_hashes
        for i in range(done, min(num_full, len(table))):
            if table[i].is_null or (keep is not None and not keep[i]):
                continue
            self.block_pool.cache_full_blocks(
                [table[i]], [group_block_hash(hashes[i], self.group_id)],
                group_block_hash(hashes[i - 1], self.group_id) if i else None,
                request.token_ids(i * bs, (i + 1) * bs), bs)
        self.num_cached_block[rid] = max(done, num_full)

    def uncache_from(self, request_id: str, first_block: int) -> None:
        """Forget the keys of blocks from `first_block` on (their K/V was never written)."""
        table = self.req_to_blocks.get(request_id, [])
        for blk in table[first_block:]:
            if not blk.is_null:
                self.block_pool.uncache_block(blk)
        if request_id in self.num_cached_block:
            self.num_cached_block[request_id] = min(self.num_cached_block[request_id],
                                                    first_block)

    def free(self, request_id: str) -> None:
        """Back to the pool, last block first (its tail is the first to be evicted)."""
        self.num_cached_block.pop(request_id, None)
        table = self.req_to_blocks.pop(request_id, [])
        held = [blk for blk in table if not blk.is_null]
        if held:
            self.block_pool.free_blocks(list(reversed(held)))

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int
                               ) -> list[KVCacheBlock]:
        raise NotImplementedError

    def cached(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block(group_block_hash(block_hash, self.group_id))


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int
                               ) -> list[KVCacheBlock]:
        """Cached blocks from the first, stopping at the first miss (chapter 05's lookup)."""
        hits = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            blk = self.cached(block_hash)
            if blk is None:
                break
            hits.append(blk)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int):
        super().__init__(spec, block_pool, group_id)
        self.sliding_window = spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token, at position num_computed_tokens, reads positions
        # num_computed_tokens - sliding_window + 1 onward; everything before is skipped.
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @property
    def blocks_for_a_hit(self) -> int:
        """Contiguous cached blocks a hit must end with: those the window of the first token
        computed after the hit reads (vLLM's `_contiguous_blocks_for_hit`)."""
        return cdiv(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int
                               ) -> list[KVCacheBlock]:
        """The longest prefix, up to `max_length`, whose last `blocks_for_a_hit` blocks are all
        cached: searched from the right, as vLLM's `SlidingWindowManager.find_longest_cache_hit`
        does. Blocks before that run need not be cached (the null block stands in); a run that
        reaches block 0 is a hit even when shorter."""
        need = self.blocks_for_a_hit
        num_blocks = max_length // self.block_size
        hits: list[KVCacheBlock] = [self.null_block] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            blk = self.cached(block_hashes[i])
            if blk is None:
                run = 0
                continue
            hits[i] = blk
            run += 1
            if run >= need:
                return hits[: i + run]
        return hits[:run]


def manager_for(spec: KVCacheSpec, block_pool: BlockPool, group_id: int
                ) -> SingleTypeKVCacheManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, group_id)
    assert isinstance(spec, FullAttentionSpec), spec
    return FullAttentionManager(spec, block_pool, group_id)

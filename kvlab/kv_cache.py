"""The physical KV pool, and the two ways of handing it out: paged and contiguous.

Defined in notebook 01. One tensor per engine holds every K and V of every request:

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

A request owns a block table, the list of physical blocks that hold its tokens in order. Token at
position p lives in block `block_table[p // block_size]`, slot `p % block_size`.

- paged (vLLM): blocks are taken one at a time, when the request's tokens reach them, from
  anywhere in the pool. Waste is under one block per request.
- contiguous (the pre-vLLM baseline): at admission a request reserves one unbroken region big
  enough for max_model_len tokens, first fit. Reservation, internal and external fragmentation
  all show up, in the same pool, so their cost is measured, not simulated.
"""

from __future__ import annotations

import torch

from kvlab.block_pool import BlockPool, KVCacheBlock
from kvlab.prefix_cache import extend_block_hashes


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    # Zeros, not empty: padded reads in the batched decode path touch unused slots, and masked
    # garbage could be NaN, which survives a zero attention weight (0 * NaN = NaN).
    return torch.zeros(
        (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of the running requests, over one `BlockPool`.

    Method names follow nano-vllm / vLLM: `allocate_slots` before a step, `free` when a request
    ends. The scheduler asks; the manager says yes (and takes blocks) or no (and takes nothing).
    """

    def __init__(self, num_blocks: int, block_size: int, kv_layout: str, max_model_len: int,
                 enable_prefix_caching: bool = False, hash_algo: str = "sha256"):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.prefix_cache_queries = 0  # prompt tokens looked up (vLLM's counter names)
        self.prefix_cache_hits = 0  # of which found in the cache
        self.num_registered_blocks: dict[str, int] = {}  # request -> its blocks already keyed
        self.kv_layout = kv_layout
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.peak_blocks_used = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids, see fork / CoW
        self.num_cow_copies = 0
        # False turns fork into a full copy: the baseline chapter 02 measures sharing against.
        self.share_blocks = True

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        """Make the request's block table cover its first `num_tokens` tokens, ready for the
        tokens from `num_computed_tokens` on to be written.

        All or nothing: returns False, holding nothing new, if the pool cannot cover them.
        `new_computed_blocks` are prefix-cache hits (chapter 05) that start the block table.
        A block about to be written that other sequences still share (ref_cnt > 1) is first
        copied to a fresh block: copy-on-write (chapter 02).
        """
        blocks = self.req_to_blocks.get(request_id)
        if self.kv_layout == "contiguous":
            if blocks is None:
                # Reserve for the longest the request could ever get, as FasterTransformer-era
                # servers did: the output length is unknown when the request is admitted.
                region = self.block_pool.get_contiguous_blocks(self.num_blocks_for(self.max_model_len))
                if region is None:
                    return False
                self.req_to_blocks[request_id] = region
            self._note_peak()
            return True
        blocks = blocks if blocks is not None else []
        num_new = self.num_blocks_for(num_tokens) - len(blocks) - len(new_computed_blocks)
        # Shared blocks among those this step writes into (only ever the last one after a fork).
        first = num_computed_tokens // self.block_size
        shared = [i for i in range(first, len(blocks)) if blocks[i].ref_cnt > 1]
        # Hits still in the free queue count as free now, but will not be once taken.
        free = self.block_pool.get_num_free_blocks()
        free -= sum(1 for blk in new_computed_blocks if blk.ref_cnt == 0)
        if max(num_new, 0) + len(shared) > free:
            return False
        # Take the hits out of the free queue first, so popping fresh blocks below cannot evict
        # the very blocks this request is about to reuse.
        self.block_pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        for i in shared:
            (fresh,) = self.block_pool.get_new_blocks(1)
            self.pending_copies.append((blocks[i].block_id, fresh.block_id))
            self.block_pool.free_blocks([blocks[i]])  # drop our reference; the others keep it
            blocks[i] = fresh
            self.num_cow_copies += 1
        if num_new > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new))
        self.req_to_blocks[request_id] = blocks
        self._note_peak()
        return True

    def fork(self, parent_id: str, child_id: str) -> bool:
        """Give `child_id` the parent's tokens without copying them, where the layout allows.

        Paged: the child's block table is a copy of the parent's, and every block gains a
        reference, the partly filled last block included. Contiguous: regions cannot be shared,
        so the child reserves its own region and the parent's blocks are copied into it.
        """
        parent = self.req_to_blocks[parent_id]
        if self.kv_layout == "paged" and self.share_blocks:
            self.block_pool.touch(parent)
            self.req_to_blocks[child_id] = list(parent)
            self.num_registered_blocks[child_id] = self.num_registered_blocks.get(parent_id, 0)
        else:
            if self.kv_layout == "paged":  # the no-sharing baseline: fresh blocks, full copy
                if len(parent) > self.block_pool.get_num_free_blocks():
                    return False
                region = self.block_pool.get_new_blocks(len(parent))
            else:
                region = self.block_pool.get_contiguous_blocks(len(parent))
            if region is None:
                return False
            self.pending_copies += [(p.block_id, c.block_id) for p, c in zip(parent, region)]
            self.req_to_blocks[child_id] = region
        self._note_peak()
        return True

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block pairs whose K/V must be copied before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def get_computed_blocks(self, request) -> tuple[list[KVCacheBlock], int]:
        """Prefix-cache lookup: the longest run of cached full blocks from the request's start.

        Never the whole sequence: at least its last token is computed, so there are logits to
        sample from. Returns the hit blocks and the number of tokens they hold.
        """
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(request.block_hashes, request.token_ids, request.num_tokens,
                            self.block_size, request.cache_salt, self.hash_algo)
        hits = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            blk = self.block_pool.get_cached_block(block_hash)
            if blk is None:
                break  # the chain is broken: nothing after this can be the same prefix
            hits.append(blk)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request) -> None:
        """Key the request's blocks that its computed tokens have filled, so others find them."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self.num_registered_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        extend_block_hashes(request.block_hashes, request.token_ids, num_full * self.block_size,
                            self.block_size, request.cache_salt, self.hash_algo)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(done, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_registered_blocks[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Return a request's blocks to the pool, last block first (see BlockPool.free_blocks)."""
        self.num_registered_blocks.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [blk.block_id for blk in self.req_to_blocks.get(request_id, [])]

    def memory_map(self, num_tokens: dict[str, int]) -> list[tuple[str | None, int]]:
        """For each physical block in address order: (owner request id or None, slots filled).

        `num_tokens` gives each request's tokens in the cache; a block past them is held but
        empty (reservation), and the unfilled part of a request's last block is internal waste.
        """
        owner: list[tuple[str | None, int]] = [(None, 0)] * self.num_blocks
        for rid, blocks in self.req_to_blocks.items():
            n = num_tokens.get(rid, 0)
            for i, blk in enumerate(blocks):
                owner[blk.block_id] = (rid, max(0, min(self.block_size, n - i * self.block_size)))
        return owner

    def usable_free_slots(self) -> int:
        """Free slots someone could still be given. Paged: all of them. Contiguous: only those in
        gaps large enough for a whole max-length region; the rest is external fragmentation."""
        free = [blk.ref_cnt == 0 for blk in self.block_pool.blocks]
        if self.kv_layout == "paged":
            return sum(free) * self.block_size
        region = self.num_blocks_for(self.max_model_len)
        usable, run = 0, 0
        for is_free in free + [False]:  # the sentinel closes the last run
            if is_free:
                run += 1
            else:
                usable += (run // region) * region
                run = 0
        return usable * self.block_size

    def _note_peak(self) -> None:
        self.peak_blocks_used = max(self.peak_blocks_used, self.block_pool.get_num_used_blocks())

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

    def __init__(self, num_blocks: int, block_size: int, kv_layout: str, max_model_len: int):
        self.block_size = block_size
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

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0) -> bool:
        """Make the request's block table cover its first `num_tokens` tokens, ready for the
        tokens from `num_computed_tokens` on to be written.

        All or nothing: returns False, holding nothing new, if the pool cannot cover them.
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
        num_new = self.num_blocks_for(num_tokens) - len(blocks)
        # Shared blocks among those this step writes into (only ever the last one after a fork).
        first = num_computed_tokens // self.block_size
        shared = [i for i in range(first, len(blocks)) if blocks[i].ref_cnt > 1]
        if max(num_new, 0) + len(shared) > self.block_pool.get_num_free_blocks():
            return False
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

    def free(self, request_id: str) -> None:
        """Return a request's blocks to the pool, last block first (see BlockPool.free_blocks)."""
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

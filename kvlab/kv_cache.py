"""The physical KV pool, and the two ways of handing it out: paged and contiguous.

Defined in notebook 01. One tensor per engine holds every K and V of every request:

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

A request owns a block table, the list of physical blocks that hold its tokens in order. Token at
position p lives in block `block_table[p // block_size]`, slot `p % block_size`.

- paged (vLLM): `KVCacheManager`. Blocks are taken one at a time, when the request's tokens
  reach them, from anywhere in the pool. Waste is under one block per request.
- contiguous (the pre-vLLM baseline): `ContiguousKVCacheManager`, a class of its own beside the
  vLLM path. At admission a request reserves one unbroken region big enough for max_model_len
  tokens, first fit. Reservation, internal and external fragmentation all show up, in the same
  pool, so their cost is measured, not simulated.

The scheduler only ever calls the methods the two share: `allocate_slots`, `fork`,
`get_computed_blocks`, `record_prefix_cache_stats`, `free`, `take_pending_copies`,
`take_fork_copies`, `reset_prefix_cache`.
"""

from __future__ import annotations

import torch

from kvlab.block_pool import BlockPool, KVCacheBlock
from kvlab.config import resolve_class
from kvlab.kv_events import KVCacheEvent
from kvlab.kv_quant import KVCacheDType, QuantizedKVCache, get_kv_cache_dtype
from kvlab.prefix_cache import extend_block_hashes
from kvlab.request import RequestStatus


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: KVCacheDType | str = "auto",
) -> torch.Tensor | QuantizedKVCache:
    """The pool. At kv_cache_dtype "auto" (or one equal to `dtype`) a plain tensor; otherwise a
    `QuantizedKVCache` of the same logical shape, which quantizes on write and dequantizes on
    read (kvlab/kv_quant.py)."""
    spec = (get_kv_cache_dtype(kv_cache_dtype) if isinstance(kv_cache_dtype, str)
            else kv_cache_dtype)
    if not spec.is_identity(dtype):
        return QuantizedKVCache(spec, num_layers, num_blocks, block_size, num_kv_heads,
                                head_dim, dtype, device)
    # Zeros, not empty: padded reads in the batched decode path touch unused slots, and masked
    # garbage could be NaN, which survives a zero attention weight (0 * NaN = NaN).
    return torch.zeros(
        (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# memory_map's owner for block 0, vLLM's null block (never handed out).
NULL_BLOCK_OWNER = "null block"


class KVCacheManager:
    """Block tables of the running requests over one `BlockPool`: the paged layout (vLLM).

    Method names follow vLLM's `vllm/v1/core/kv_cache_manager.py`: `get_computed_blocks` and
    `allocate_slots` when the scheduler admits or continues a request, `free` when it ends. The
    scheduler asks; the manager says yes (and takes blocks) or no (and takes nothing).
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 enable_prefix_caching: bool = False, hash_algo: str = "sha256",
                 watermark: float = 0.0, enable_kv_cache_events: bool = False):
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        # Prefix-cache counters, in prompt tokens, as vLLM's PrefixCacheStats
        # (vllm/v1/metrics/stats.py): requests admitted for the first time count in
        # queries/hits; requests re-admitted after a preemption count apart, so that a request
        # finding its own blocks again does not inflate the hit rate.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_preempted_queries = 0
        self.prefix_cache_preempted_hits = 0
        self.num_registered_blocks: dict[str, int] = {}  # request -> its blocks already keyed
        self.block_pool = BlockPool(num_blocks, enable_kv_cache_events)
        # vLLM's watermark (vllm/config/scheduler.py, default 0): blocks an admission must leave
        # free, so that the requests already running can grow a while before anyone is preempted.
        # vLLM multiplies by its pool's size, null block (block 0, never handed out) included.
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.peak_blocks_used = 0
        # (src, dst) block ids whose K/V must be copied before the next forward: copy-on-write
        # copies made while scheduling this step, and fork copies made earlier, whose source
        # K/V the last forward has finished writing.
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_fork_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        # False turns fork into a full copy: the baseline chapter 02 measures sharing against.
        self.share_blocks = True
        # Chapter 10: blocks held back for requests waiting on a KV connector's load, set by the
        # scheduler around a waiting request's admission (0 otherwise).
        self.reserved_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] = (), request=None, *,
                       full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = True,
                       delay_cache_blocks: bool = False) -> bool:
        """Make the request's block table cover its first `num_tokens` tokens, ready for the
        tokens from `num_computed_tokens` on to be written.

        (vLLM's allocate_slots takes the request and its number of new tokens; here the totals
        are passed, which reads more directly in the notebooks.)
        All or nothing: returns False, holding nothing new, if the pool cannot cover them.
        `new_computed_blocks` are prefix-cache hits (chapter 05) that start the block table.
        `full_sequence_must_fit` (the scheduler passes vLLM's `scheduler_reserve_full_isl` when
        it admits a request): refuse unless the request's whole sequence would fit now, not
        only this step's chunk, so a long prompt is not admitted only to be preempted half-way.
        The watermark applies to waiting and preempted requests while others are scheduled.
        A block about to be written that other sequences still share (ref_cnt > 1) is first
        copied to a fresh block: copy-on-write (chapter 02). With prefix caching, the blocks
        that this step fills are keyed here, before the forward, as vLLM's allocate_slots does
        (`cache_blocks`): a request scheduled later in the same step already finds them, since
        every layer writes the step's K/V before any sequence attends. `delay_cache_blocks`
        (vLLM's name): key nothing now, because a KV connector is still loading these blocks
        (chapter 10); the scheduler keys them when the load is done.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        num_new = self.num_blocks_for(num_tokens) - len(blocks) - len(new_computed_blocks)
        # Shared blocks among those this step writes into (only ever the last one after a fork).
        first = num_computed_tokens // self.block_size
        shared = [i for i in range(first, len(blocks)) if blocks[i].ref_cnt > 1]
        if full_sequence_must_fit and not self.full_sequence_fits(
                request, new_computed_blocks, len(shared), has_scheduled_reqs):
            return False
        if not self.fits(request_id, num_tokens, new_computed_blocks, len(shared), request,
                         has_scheduled_reqs):
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
        if request is not None and not delay_cache_blocks:
            self.cache_blocks(request, num_tokens)
        self._note_peak()
        return True

    def fits(self, request_id: str, num_tokens: int, new_computed_blocks=(),
             num_copies: int = 0, request=None, has_scheduled_reqs: bool = True) -> bool:
        """Whether the free blocks can cover the request's first `num_tokens` tokens now:
        the missing blocks, `num_copies` copy-on-write copies, the hits still in the free queue
        (free now, taken once adopted), and the watermark, which holds back waiting and
        preempted requests while others are scheduled."""
        have = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        need = max(self.num_blocks_for(num_tokens) - have, 0) + num_copies
        need += sum(1 for blk in new_computed_blocks if blk.ref_cnt == 0)
        need += self._watermark_for(request, has_scheduled_reqs)
        need += self.reserved_blocks
        return need <= self.block_pool.get_num_free_blocks()

    def _watermark_for(self, request, has_scheduled_reqs: bool) -> int:
        """The blocks an admission must leave free: the watermark, for a waiting or preempted
        request while others are scheduled."""
        if (request is not None and has_scheduled_reqs
                and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)):
            return self.watermark_blocks
        return 0

    def full_sequence_fits(self, request, new_computed_blocks=(), num_copies: int = 0,
                           has_scheduled_reqs: bool = True) -> bool:
        """vLLM's `full_sequence_must_fit` gate: the request's whole sequence (capped at
        max_model_len) fits in the free blocks now. True when there is no request to judge."""
        if request is None:
            return True
        full = min(request.num_tokens, self.max_model_len or request.num_tokens)
        return self.fits(request.request_id, full, new_computed_blocks, num_copies, request,
                         has_scheduled_reqs)

    def fork(self, parent_id: str, child_id: str) -> bool:
        """Give `child_id` the parent's tokens without copying them (the PagedAttention paper's
        fork). The child's block table is a copy of the parent's, and every block gains a
        reference, the partly filled last block included; copy-on-write separates them later.

        With `share_blocks=False` (chapter 02's baseline) the child gets fresh blocks and the
        parent's K/V is copied into them before the next forward. Returns False, taking
        nothing, when there is no room for that copy.
        """
        parent = self.req_to_blocks[parent_id]
        if self.share_blocks:
            self.block_pool.touch(parent)
            self.req_to_blocks[child_id] = list(parent)
            self.num_registered_blocks[child_id] = self.num_registered_blocks.get(parent_id, 0)
            self._note_peak()
            return True
        if len(parent) > self.block_pool.get_num_free_blocks():
            return False
        return self._fork_by_copy(parent, child_id, self.block_pool.get_new_blocks(len(parent)))

    def _fork_by_copy(self, parent: list[KVCacheBlock], child_id: str, region) -> bool:
        self.pending_fork_copies += [(p.block_id, c.block_id) for p, c in zip(parent, region)]
        self.req_to_blocks[child_id] = list(region)
        self._note_peak()
        return True

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (source, destination) block pairs to copy before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_fork_copies(self) -> list[tuple[int, int]]:
        """Fork copies (no-sharing baseline and contiguous layout) made since the last call."""
        copies, self.pending_fork_copies = self.pending_fork_copies, []
        return copies

    def get_computed_blocks(self, request) -> tuple[list[KVCacheBlock], int]:
        """Prefix-cache lookup: the longest run of cached full blocks from the request's start.

        Never the whole sequence: at least its last token is computed, so there are logits to
        sample from. Returns the hit blocks and the number of tokens they hold (the scheduler
        counts the lookup with `record_prefix_cache_stats` once it admits the request).
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

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        """Count one admission's lookup (vLLM: KVCacheManager.record_prefix_cache_stats)."""
        if not self.enable_prefix_caching:
            return
        if request.num_preemptions > 0:
            self.prefix_cache_preempted_queries += request.num_tokens
            self.prefix_cache_preempted_hits += num_hits
        else:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hits

    def cache_blocks(self, request, num_tokens: int | None = None) -> None:
        """Key the request's blocks that its first `num_tokens` tokens fill (default: its
        computed tokens), so others find them."""
        if not self.enable_prefix_caching:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        done = self.num_registered_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        extend_block_hashes(request.block_hashes, request.token_ids, num_full * self.block_size,
                            self.block_size, request.cache_salt, self.hash_algo)
        blocks = self.req_to_blocks[request.request_id]
        bs = self.block_size
        self.block_pool.cache_full_blocks(
            blocks[done:num_full], request.block_hashes[done:num_full],
            request.block_hashes[done - 1] if done else None,
            request.token_ids(done * bs, num_full * bs), bs)
        self.num_registered_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (vLLM: KVCacheManager.reset_prefix_cache). False, and
        nothing changes, while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call (the block pool records them)."""
        return self.block_pool.take_events()

    def uncache_unwritten_blocks(self, request, num_computed_tokens: int | None = None) -> None:
        """Forget the keys of blocks keyed for a step that never ran (an exception or an
        interrupt before the forward finished): keys are given at allocation, before the K/V
        is written, so without this a later request could hit K/V that does not exist.
        `num_computed_tokens`: the tokens whose K/V did get written (default: the request's
        count; once schedule() has advanced it, the step's SchedulerOutput has the old one)."""
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        first = num_computed_tokens // self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])
        for blk in blocks[first:]:
            self.block_pool.uncache_block(blk)
        if request.request_id in self.num_registered_blocks:
            self.num_registered_blocks[request.request_id] = min(
                self.num_registered_blocks[request.request_id], first)

    def free(self, request_id: str) -> None:
        """Return a request's blocks to the pool, last block first (see BlockPool.free_blocks)."""
        self.num_registered_blocks.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            freed = {blk.block_id for blk in blocks}
            # A copy into blocks given back now must not land on their next owner: fork copies
            # wait for the next step; a copy-on-write copy is pending only while its step is
            # being scheduled (a request preempted after it was scheduled, policy="priority").
            self.pending_fork_copies = [c for c in self.pending_fork_copies
                                        if c[1] not in freed]
            kept = [c for c in self.pending_copies if c[1] not in freed]
            self.num_cow_copies -= len(self.pending_copies) - len(kept)  # never made
            self.pending_copies = kept
            self.block_pool.free_blocks(list(reversed(blocks)))

    def check_invariants(self) -> None:
        """The pool's own check, and: every block's ref_cnt is the number of block tables, in
        any KV cache group, that hold it; the null block, standing in a table for a block given
        back (chapter 09), is never counted (`debug_checks=True` runs this after every step)."""
        self.block_pool.check_invariants()
        held: dict[int, int] = {}
        for tables in self.block_tables_by_group():
            for blocks in tables.values():
                for blk in blocks:
                    if not blk.is_null:
                        held[blk.block_id] = held.get(blk.block_id, 0) + 1
        for blk in self.block_pool.blocks:
            assert blk.ref_cnt == held.get(blk.block_id, 0), (
                f"block {blk.block_id} has ref_cnt {blk.ref_cnt} but "
                f"{held.get(blk.block_id, 0)} block tables hold it")

    def get_block_ids(self, request_id: str) -> list[int]:
        return [blk.block_id for blk in self.req_to_blocks.get(request_id, [])]

    def block_tables_by_group(self) -> list[dict[str, list[KVCacheBlock]]]:
        """Every request's blocks, one mapping per KV cache group (one group here)."""
        return [self.req_to_blocks]

    def memory_map(self, num_tokens: dict[str, int],
                   final_tokens: dict[str, int] | None = None) -> list[tuple[str | None, int, int]]:
        """For each physical block, in address order: (owner request id or None, slots holding
        tokens, slots reserved for tokens still to come).

        `num_tokens` gives each request's tokens in the cache now; `final_tokens`, where known,
        its length at the end: a held slot below that is reserved, one past it is internal waste
        (it will never hold a token). Without `final_tokens` every held, empty slot counts as
        reserved. Block 0, the null block, is owned by NULL_BLOCK_OWNER. Chapter 01's pictures
        draw it (kvlab.workbook.viz.draw_memory_map).
        """
        bs = self.block_size
        owner: list[tuple[str | None, int, int]] = [(None, 0, 0)] * self.num_blocks
        if self.block_pool.null_block is not None:
            owner[self.block_pool.null_block.block_id] = (NULL_BLOCK_OWNER, 0, 0)
        for tables in self.block_tables_by_group():  # a window's given-back blocks are free
            for rid, blocks in tables.items():
                n = num_tokens.get(rid, 0)
                end = (final_tokens or {}).get(rid, len(blocks) * bs)
                for i, blk in enumerate(blocks):
                    if blk.is_null:
                        continue
                    filled = max(0, min(bs, n - i * bs))
                    reserved = max(0, min(bs, end - i * bs) - filled)
                    owner[blk.block_id] = (rid, filled, reserved)
        return owner

    def unusable_free_blocks(self) -> set[int]:
        """Free blocks nobody can be given (external fragmentation): with blocks on demand,
        none."""
        return set()

    def usable_free_slots(self) -> int:
        """Free slots someone could still be given."""
        free = self.block_pool.get_num_free_blocks()
        return (free - len(self.unusable_free_blocks())) * self.block_size

    def _note_peak(self) -> None:
        self.peak_blocks_used = max(self.peak_blocks_used, self.block_pool.get_num_used_blocks())


class ContiguousKVCacheManager(KVCacheManager):
    """The pre-vLLM baseline (chapter 01): one unbroken region of max_model_len tokens per
    request, reserved at admission, first fit. Regions cannot be shared, so there is no prefix
    caching and a fork copies the whole region."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_kv_cache_events: bool = False):
        super().__init__(num_blocks, block_size, max_model_len,
                         enable_kv_cache_events=enable_kv_cache_events)
        self.share_blocks = False

    def unusable_free_blocks(self) -> set[int]:
        """The free blocks in gaps too short for a whole max-length region: free, but too
        scattered for anyone (external fragmentation)."""
        region = self.num_blocks_for(self.max_model_len)
        return {b for run in self._free_runs() for b in run[len(run) // region * region:]}

    def _free_runs(self):
        """The runs of consecutive free block ids, in address order."""
        run: list[int] = []
        for blk in self.block_pool.blocks:
            if blk.ref_cnt == 0 and not blk.is_null:  # the null block is never free
                run.append(blk.block_id)
            elif run:
                yield run
                run = []
        if run:
            yield run

    def find_contiguous_free_run(self, num_blocks: int) -> int | None:
        """First fit: the lowest block id that starts `num_blocks` consecutive free blocks.

        The pre-vLLM allocators worked this way: a request needs one unbroken region, so free
        space split into gaps smaller than a region is unusable (external fragmentation).
        """
        return next((run[0] for run in self._free_runs() if len(run) >= num_blocks), None)

    def get_contiguous_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Reserve one unbroken run of blocks, first fit; None if no gap is large enough.
        (Regions are never keyed, so taking them out of the free queue evicts nothing.)"""
        start = self.find_contiguous_free_run(num_blocks)
        if start is None:
            return None
        region = self.block_pool.blocks[start : start + num_blocks]
        self.block_pool.touch(region)  # out of the free queue, ref_cnt 0 -> 1
        return region

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] = (), request=None, *,
                       full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = True) -> bool:
        if request_id not in self.req_to_blocks:
            # Reserve for the longest the request could ever get, as FasterTransformer-era
            # servers did: the output length is unknown when the request is admitted. (So the
            # whole sequence always fits once admitted: full_sequence_must_fit adds nothing.)
            region = self.get_contiguous_blocks(self.num_blocks_for(self.max_model_len))
            if region is None:
                return False
            self.req_to_blocks[request_id] = region
        self._note_peak()
        return True

    def fork(self, parent_id: str, child_id: str) -> bool:
        parent = self.req_to_blocks[parent_id]
        region = self.get_contiguous_blocks(len(parent))
        return region is not None and self._fork_by_copy(parent, child_id, region)


def get_kv_cache_manager_cls(config) -> type[KVCacheManager]:
    """The manager class for an EngineConfig: its `kv_cache_manager_cls` (imported when it is a
    dotted path), which must be a subclass of the kv_layout's manager; that manager when None."""
    base = ContiguousKVCacheManager if config.kv_layout == "contiguous" else KVCacheManager
    if config.kv_cache_manager_cls is None:
        return base
    cls = resolve_class("kv_cache_manager_cls", config.kv_cache_manager_cls, base)
    if base is KVCacheManager and issubclass(cls, ContiguousKVCacheManager):
        raise TypeError(f"kv_cache_manager_cls={cls.__qualname__} is a contiguous-layout "
                        "manager: pass kv_layout='contiguous' with it")
    return cls


def make_kv_cache_manager(config, enable_kv_cache_events: bool = False) -> KVCacheManager:
    """The manager for an EngineConfig: its kv_layout's, or its `kv_cache_manager_cls` (a
    subclass of that one, built with the same arguments)."""
    cls = get_kv_cache_manager_cls(config)
    if config.kv_layout == "contiguous":
        return cls(config.num_blocks, config.block_size, config.max_model_len,
                   enable_kv_cache_events)
    return cls(config.num_blocks, config.block_size, config.max_model_len,
               config.enable_prefix_caching, config.prefix_caching_hash_algo,
               config.watermark, enable_kv_cache_events)

"""The KV cache manager of a hybrid model: several KV cache groups over one block pool.

Defined in notebook 09. vLLM 0.33.0 splits this job between `KVCacheManager` and a coordinator
(`HybridKVCacheCoordinator` in `vllm/v1/core/kv_cache_coordinator.py`) that drives one manager
per group (`kvlab/single_type_kv_cache_manager.py`). kvlab's `HybridKVCacheManager` is both:
it answers the scheduler with the same calls as `KVCacheManager` (so the scheduler does not
know the model is hybrid) and drives the groups as the coordinator does:

- **allocation** counts every group's blocks and takes them only if all fit (all or nothing);
  before counting, each window group gives back the blocks its window has left
  (`remove_skipped_blocks`, on the tokens already processed: a step in flight may still read
  them);
- **a prefix hit** is the longest prefix every group can serve (`find_longest_cache_hit`): the
  full-attention groups first (every block from the start), then each window group, which needs
  only the blocks its window reads at the hit's end; the length shrinks until all agree;
- **sparse retention** (vLLM's default `prefix_cache_retention_interval=0`): a window group
  keys only the blocks a later request could resume from, the window before the prompt's last
  token and before a shared-prefix junction that a lookup found (`shared_prefix_boundary`), not
  every full block.

Block ids come back per group (`get_block_ids` returns one list per group, as vLLM's
`KVCacheBlocks.get_block_ids`); the model runner builds each group's attention metadata.
"""

from __future__ import annotations

from kvlab.block_pool import KVCacheBlock
from kvlab.kv_cache import KVCacheManager
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from kvlab.prefix_cache import extend_block_hashes
from kvlab.single_type_kv_cache_manager import SlidingWindowManager, manager_for


class HybridKVCacheManager(KVCacheManager):
    """Block tables per KV cache group, one pool. Method names as `KVCacheManager`'s."""

    def __init__(self, kv_cache_groups: list[KVCacheGroupSpec], num_blocks: int,
                 block_size: int, max_model_len: int | None = None,
                 enable_prefix_caching: bool = False, hash_algo: str = "sha256",
                 watermark: float = 0.0, enable_kv_cache_events: bool = False,
                 max_in_flight_tokens: int = 0,
                 prefix_cache_retention_interval: int | None = 0):
        super().__init__(num_blocks, block_size, max_model_len, enable_prefix_caching,
                         hash_algo, watermark, enable_kv_cache_events)
        if prefix_cache_retention_interval not in (0, None):
            raise ValueError(
                f"prefix_cache_retention_interval={prefix_cache_retention_interval}: kvlab "
                "runs vLLM's default 0 (keep only the windows a request can resume from) and "
                "None (key every full block)")
        self.kv_cache_groups = list(kv_cache_groups)
        self.managers = [manager_for(g.spec, self.block_pool, i)
                         for i, g in enumerate(self.kv_cache_groups)]
        self.max_in_flight_tokens = max_in_flight_tokens
        self.retention_interval = prefix_cache_retention_interval
        # Full attention first: its hit is every block from the start, and bounds the others'
        # (vLLM's coordinator orders its attention groups the same way).
        self.lookup_order = sorted(
            range(len(self.managers)),
            key=lambda g: not isinstance(self.kv_cache_groups[g].spec, FullAttentionSpec))

    # ---- admission and growth -----------------------------------------------------------------
    def _per_group(self, new_computed_blocks) -> tuple[list[KVCacheBlock], ...]:
        if not new_computed_blocks:
            return tuple([] for _ in self.managers)
        return tuple(new_computed_blocks)

    def _num_blocks_to_allocate(self, request_id, num_tokens, hits, num_computed_tokens,
                                admission: bool = False) -> int:
        total = 0
        for mgr, group_hits in zip(self.managers, hits):
            cap = (mgr.spec.max_blocks_per_request(self.max_model_len or num_tokens,
                                                   self.max_in_flight_tokens)
                   if admission and isinstance(mgr, SlidingWindowManager) else None)
            total += mgr.get_num_blocks_to_allocate(request_id, num_tokens, group_hits,
                                                    num_computed_tokens, cap)
        return total

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                       new_computed_blocks=(), request=None, *,
                       full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = True) -> bool:
        """Every group's table covers the first `num_tokens` tokens, or nothing is taken (the
        blocks a window left behind are given back either way, as vLLM does)."""
        hits = self._per_group(new_computed_blocks)
        watermark = self._watermark_for(request, has_scheduled_reqs)
        free = self.block_pool.get_num_free_blocks
        if full_sequence_must_fit and request is not None:
            full = min(request.num_tokens, self.max_model_len or request.num_tokens)
            if self._num_blocks_to_allocate(request_id, full, hits, num_computed_tokens,
                                            admission=True) + watermark > free():
                return False
        in_flight = request.num_in_flight_tokens if request is not None else 0
        processed = max(0, num_computed_tokens - in_flight)
        for mgr in self.managers:
            mgr.remove_skipped_blocks(request_id, processed)
        if self._num_blocks_to_allocate(request_id, num_tokens, hits,
                                        num_computed_tokens) + watermark > free():
            return False
        # Every group's hits first, then every group's new blocks: a hit still in the free
        # queue must be taken out before any group pops new blocks from its head (vLLM: the
        # coordinator's allocate_new_computed_blocks, then allocate_new_blocks).
        if request_id not in self.managers[0].req_to_blocks:
            for mgr, group_hits in zip(self.managers, hits):
                mgr.add_computed_blocks(request_id, group_hits, num_computed_tokens)
        for mgr in self.managers:
            mgr.allocate_new_blocks(request_id, num_tokens)
        if request is not None:
            self.cache_blocks(request, num_tokens)
        self._note_peak()
        return True

    def fits(self, request_id: str, num_tokens: int, new_computed_blocks=(),
             num_copies: int = 0, request=None, has_scheduled_reqs: bool = True) -> bool:
        need = self._num_blocks_to_allocate(request_id, num_tokens,
                                            self._per_group(new_computed_blocks),
                                            request.num_computed_tokens if request else 0)
        return (need + num_copies + self._watermark_for(request, has_scheduled_reqs)
                <= self.block_pool.get_num_free_blocks())

    def fork(self, parent_id: str, child_id: str) -> bool:
        raise NotImplementedError(
            "fork (parallel_sampling='fork', beam search) is not implemented for hybrid KV "
            "cache groups in kvlab; n > 1 runs as child requests")

    # ---- prefix caching -----------------------------------------------------------------------
    def get_computed_blocks(self, request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix every group can serve, capped below the last token (its logits
        are needed). Sets `request.shared_prefix_boundary` when a full-attention group found
        more than the window groups could: that junction's window is then kept keyed."""
        empty = tuple([] for _ in self.managers)
        if not self.enable_prefix_caching:
            return empty, 0
        bs = self.block_size
        extend_block_hashes(request.block_hashes, request.token_ids, request.num_tokens,
                            bs, request.cache_salt, self.hash_algo)
        hit_length = request.num_tokens - 1
        longest = 0
        found: dict[int, list[KVCacheBlock]] = {}
        while True:  # each group accepts the length or shortens it, until none shortens it
            length = hit_length
            for g in self.lookup_order:
                found[g] = self.managers[g].find_longest_cache_hit(request.block_hashes, length)
                length = len(found[g]) * bs
                longest = max(longest, length)
            if length >= hit_length:
                break
            hit_length = length
        hits = tuple(found[g][: hit_length // bs] for g in range(len(self.managers)))
        hit_length = len(hits[0]) * bs
        uncached = longest - hit_length
        request.shared_prefix_boundary = hit_length + uncached if uncached else 0
        return hits, hit_length

    def _keep_mask(self, mgr: SlidingWindowManager, request, num_full: int) -> list[bool] | None:
        """Which full blocks a window group keys under sparse retention: the window's blocks
        before each place a later request could resume, the prompt's last token (a resend is
        capped there) and the shared-prefix junction (vLLM's `reachable_block_mask` with
        `replay_boundaries`)."""
        if self.retention_interval is None:
            return None
        need = mgr.blocks_for_a_hit
        keep = [False] * num_full
        for boundary in (request.num_prompt_tokens - 1, request.shared_prefix_boundary):
            end = boundary // self.block_size
            for i in range(max(0, end - need), min(end, num_full)):
                keep[i] = True
        return keep

    def cache_blocks(self, request, num_tokens: int | None = None) -> None:
        if not self.enable_prefix_caching:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        extend_block_hashes(request.block_hashes, request.token_ids,
                            num_full * self.block_size, self.block_size, request.cache_salt,
                            self.hash_algo)
        for mgr in self.managers:
            keep = (self._keep_mask(mgr, request, num_full)
                    if isinstance(mgr, SlidingWindowManager) else None)
            mgr.cache_blocks(request, num_full, keep)

    def uncache_unwritten_blocks(self, request, num_computed_tokens: int | None = None) -> None:
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        for mgr in self.managers:
            mgr.uncache_from(request.request_id, num_computed_tokens // self.block_size)

    # ---- the end, and what the tables say -----------------------------------------------------
    def free(self, request_id: str) -> None:
        for mgr in self.managers:
            mgr.free(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """One list per group, the null block (0) where a window gave a block back."""
        return tuple([blk.block_id for blk in mgr.req_to_blocks.get(request_id, [])]
                     for mgr in self.managers)

    def block_tables_by_group(self) -> list[dict[str, list[KVCacheBlock]]]:
        return [mgr.req_to_blocks for mgr in self.managers]

    def num_blocks_held(self, request_id: str) -> list[int]:
        """Real blocks (not the null block) each group's table holds for the request."""
        return [sum(not blk.is_null for blk in mgr.req_to_blocks.get(request_id, []))
                for mgr in self.managers]


def is_hybrid(groups: list[KVCacheGroupSpec]) -> bool:
    return len(groups) > 1 or any(isinstance(g.spec, SlidingWindowSpec) for g in groups)

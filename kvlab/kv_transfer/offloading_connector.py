"""Native KV offloading: a second tier behind the pool (vLLM 0.33.0's `OffloadingConnector`,
`vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py` and `offloading/`,
its CPU tier's manager in `vllm/v1/kv_offload/cpu/manager.py`).

What it does, as vLLM's does by default:
- Stores: every full block of a request's prompt, as the steps compute it (prompt only:
  vLLM's `offload_prompt_only`), keyed by the block's prefix-cache key, so the salt and the
  whole prefix are in the key. A block the tier already holds is not written again, only
  marked recently used.
- The tier is bounded (`cpu_bytes_to_use`, i.e. `kv_offloading_size` GiB) and evicts the
  least recently used block to make room; blocks being loaded and the blocks of the same offer
  are never evicted. Within one request the tail counts as less recent than the head (vLLM's
  LRUCachePolicy ranks a request's blocks by position, `vllm/v1/kv_offload/cpu/policies/
  lru.py`): a prefix is worth more than its end, which is useless without it. When no block can be evicted the store is dropped and counted (vLLM's
  `vllm:kv_offload_allocation_failure`).
- Lookups: after the pool's own prefix-cache hit, the run of consecutive blocks the tier holds
  from there on (the external hit). Loads are asynchronous: the request waits in
  WAITING_FOR_REMOTE_KVS until the worker reports the load done, then runs.
- A preempted request is looked up again when it is re-admitted, so the tier restores the
  prompt blocks the pool has lost.

The tier here is a file (`tier.py`), one slot per block.
"""

from __future__ import annotations

import collections

from kvlab.kv_transfer.base import (BlockTransfer, KVConnectorBase, KVConnectorMetadata,
                                    KVConnectorOutput, KVConnectorRole)
from kvlab.kv_transfer.tier import SlotFile, block_nbytes


class OffloadingConnector(KVConnectorBase):
    def __init__(self, transfer_config, role: KVConnectorRole, block_size: int,
                 block_bytes: int) -> None:
        super().__init__(transfer_config, role, block_size)
        extra = transfer_config.kv_connector_extra_config
        self.block_bytes = block_bytes
        self.num_slots = int(extra["cpu_bytes_to_use"]) // block_bytes
        if self.num_slots < 1:
            raise ValueError(f"the tier's {int(extra['cpu_bytes_to_use']):,} bytes hold no block "
                             f"(a block is {block_bytes:,} bytes here): raise kv_offloading_size")
        if role is KVConnectorRole.SCHEDULER:
            # key -> slot, least recently used first (vLLM's LRU policy over its chunks).
            self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
            self.free_slots = list(range(self.num_slots - 1, -1, -1))
            self.pinned: collections.Counter[int] = collections.Counter()  # slots being read
            # Slots whose write is planned but not yet reported done: not loadable until it is
            # (vLLM's manager marks a block ready only on complete_store).
            self.pending_writes: set[int] = set()
            self._next_store: dict[str, int] = {}  # request -> first block not yet offered
            self._local_hit: dict[str, int] = {}  # request -> its pool hit at the last lookup
            self._pending_loads: list[BlockTransfer] = []
            self._loading: dict[str, list[int]] = {}  # request -> slots its load pins
            self.num_allocation_failures = 0
            self.num_stored_blocks = 0
            self.num_store_failures = 0
        else:
            self.tier = SlotFile(self.num_slots, block_bytes, extra.get("storage_path"))

    # ---- scheduler side ---------------------------------------------------------------------
    def _keys(self, request) -> list[bytes]:
        return request.block_hashes

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._local_hit[request.request_id] = num_computed_tokens
        keys = self._keys(request)
        first = num_computed_tokens // self.block_size
        last = min(len(keys), request.num_tokens // self.block_size)
        hits = 0
        for key in keys[first:last]:
            if key not in self.index or self.index[key] in self.pending_writes:
                break  # a prefix: nothing past the first miss can be used
            hits += 1
        return hits * self.block_size, hits > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        rid = request.request_id
        local = self._local_hit.pop(rid, 0)
        # A lookup starts the request's offers again from its first block (vLLM restarts at
        # token 0): blocks the tier holds are only marked used; the rest are written.
        self._next_store[rid] = 0
        if num_external_tokens == 0:
            return
        first = local // self.block_size
        n = num_external_tokens // self.block_size
        keys = self._keys(request)[first : first + n]
        slots = [self.index[k] for k in keys]
        self._touch(self._keys(request)[: first + n])
        self.pinned.update(slots)
        self._loading[rid] = slots
        self._pending_loads.append(BlockTransfer(rid, slots, list(block_ids[first : first + n])))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for request, start, end, block_ids in self._prompt_blocks_done(scheduler_output,
                                                                       self._next_store):
            store = self._prepare_store(request.request_id, self._keys(request)[start:end],
                                        block_ids)
            if store is not None and store.keys:
                meta.stores.append(store)
            self._touch(self._keys(request)[:end])
        return meta

    def _touch(self, keys: list[bytes]) -> None:
        """Mark a request's blocks used now, its head the most recent."""
        for k in reversed(keys):
            if k in self.index:
                self.index.move_to_end(k)

    def _prepare_store(self, rid: str, keys: list[bytes], block_ids: list[int]):
        """Slots for the keys the tier lacks (vLLM: CPUOffloadingManager.prepare_store); None,
        and nothing stored, when not enough blocks can be evicted."""
        new = [(k, b) for k, b in zip(keys, block_ids) if k not in self.index]
        if not new:
            return BlockTransfer(rid, [], [])
        short = len(new) - len(self.free_slots)
        if short > 0:
            protected = set(keys)
            victims = [k for k, slot in self.index.items()
                       if k not in protected and not self.pinned[slot]
                       and slot not in self.pending_writes][:short]
            if len(victims) < short:
                self.num_allocation_failures += 1
                return None
            for k in victims:
                self.free_slots.append(self.index.pop(k))
        slots = [self.free_slots.pop() for _ in new]
        for (k, _), slot in zip(new, slots):
            self.index[k] = slot
        self.pending_writes.update(slots)
        self.num_stored_blocks += len(new)
        return BlockTransfer(rid, slots, [b for _, b in new])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        for rid in output.finished_recving | output.failed_recving:
            slots = self._loading.pop(rid, [])
            self.pinned.subtract(slots)
            if rid in output.failed_recving:  # the scheduler counts it (kv_load_failures)
                self._forget_slots(slots)  # what failed to read is not trusted again
        for slots in output.finished_stores:
            self.pending_writes.difference_update(slots)
        for slots in output.failed_stores:
            self.num_store_failures += 1
            self.pending_writes.difference_update(slots)
            self._forget_slots(slots)

    def _forget_slots(self, slots: list[int]) -> None:
        gone = set(slots)
        for k in [k for k, s in self.index.items() if s in gone]:
            self.free_slots.append(self.index.pop(k))

    def request_finished(self, request, block_ids):
        self._next_store.pop(request.request_id, None)
        self._local_hit.pop(request.request_id, None)
        return False, None

    @property
    def num_tier_blocks_used(self) -> int:
        return len(self.index)

    # ---- worker side ------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Reads every load of the step before the forward. vLLM's loads run on a CUDA stream
        while the GPU computes other requests; this CPU has nothing to overlap them with, so a
        load costs the step its time (measured, `load_time`)."""
        self._run_loads(self.tier.read)

    def wait_for_save(self) -> None:
        """Writes the step's stores once the forward has written their K/V."""
        self._run_stores(self.tier.write)

    def get_finished(self, finished_req_ids=frozenset()) -> KVConnectorOutput:
        out, self._output = self._output, KVConnectorOutput()
        return out


def tier_block_bytes(kv_cache) -> int:
    return block_nbytes(kv_cache)

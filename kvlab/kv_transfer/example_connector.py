"""A folder two engines share: disaggregated prefill on one machine (chapter 10), after vLLM's
`ExampleConnector` (`vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py`).

The producer (kv_role "kv_producer") runs the prompt and writes every full prompt block to
the folder, one file per block named by the block's prefix-cache key. The consumer
("kv_consumer") looks a new request's blocks up there and loads them, then computes the rest.
The load is asynchronous: the request waits in WAITING_FOR_REMOTE_KVS until it is done, as the
decode side of vLLM's NIXL connector does (vLLM's ExampleConnector loads synchronously, layer by
layer, before the forward of the step that admits the request, and never the block holding the
prompt's last token; kvlab's scheduler runs every external load the asynchronous way).

vLLM's ExampleConnector writes one safetensors file per layer under a folder named by a hash
of the prompt; kvlab's writes per block, so that two prompts that share a prefix share its
files, as the pool's prefix cache shares blocks. At scale vLLM's NIXL connector does this job
over RDMA from the producer's GPU memory to the consumer's, without a file in between.
"""

from __future__ import annotations

from kvlab.kv_transfer.base import (BlockTransfer, KVConnectorBase, KVConnectorMetadata,
                                    KVConnectorOutput, KVConnectorRole)
from kvlab.kv_transfer.tier import BlockFolder


class ExampleConnector(KVConnectorBase):
    def __init__(self, transfer_config, role: KVConnectorRole, block_size: int,
                 block_bytes: int) -> None:
        super().__init__(transfer_config, role, block_size)
        self.folder = BlockFolder(
            transfer_config.kv_connector_extra_config["shared_storage_path"], block_bytes)
        self._local_hit: dict[str, int] = {}
        self._next_store: dict[str, int] = {}
        self._pending_loads: list[BlockTransfer] = []
        self.num_stored_blocks = 0

    # ---- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if not self.transfer_config.is_kv_consumer:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        first = num_computed_tokens // self.block_size
        # Every full block; if that is the whole prompt, the scheduler still computes its last
        # token, for the logits (vLLM: _update_waiting_for_remote_kv).
        last = request.num_tokens // self.block_size
        hits = 0
        for key in request.block_hashes[first:last]:
            if not self.folder.contains(key):
                break
            hits += 1
        return hits * self.block_size, hits > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        local = self._local_hit.pop(request.request_id, 0)
        if self.transfer_config.is_kv_producer:
            self._next_store[request.request_id] = 0
        if num_external_tokens:
            first, n = local // self.block_size, num_external_tokens // self.block_size
            self._pending_loads.append(BlockTransfer(
                request.request_id, request.block_hashes[first : first + n],
                list(block_ids[first : first + n])))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for request, start, end, block_ids in self._prompt_blocks_done(scheduler_output,
                                                                       self._next_store):
            meta.stores.append(BlockTransfer(request.request_id,
                                             request.block_hashes[start:end], block_ids))
            self.num_stored_blocks += end - start
        return meta

    def request_finished(self, request, block_ids):
        self._next_store.pop(request.request_id, None)
        self._local_hit.pop(request.request_id, None)
        return False, None

    # ---- worker side ------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        self._run_loads(self.folder.read)

    def wait_for_save(self) -> None:
        self._run_stores(self.folder.write)

    def get_finished(self, finished_req_ids=frozenset()) -> KVConnectorOutput:
        out, self._output = self._output, KVConnectorOutput()
        return out

"""The KV connector interface, with vLLM 0.33.0's hook names
(`vllm/distributed/kv_transfer/kv_connector/v1/base.py`).

vLLM builds two instances of a connector: one in the scheduler's process (role SCHEDULER),
which decides what to load and store, and one in each worker (role WORKER), which moves the
bytes. Only the `KVConnectorMetadata` built each step crosses from one to the other, inside
the `SchedulerOutput`; only a `KVConnectorOutput` comes back, inside the model runner's output.
kvlab builds the same two instances, in one process.

The order in one step, as vLLM calls the hooks:

scheduler side, in `Scheduler.schedule`:
    get_num_new_matched_tokens(request, num_computed_tokens)  per waiting request, after the
        local prefix-cache lookup: how many more tokens the connector can supply, and whether
        it loads them asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS)
    update_state_after_alloc(request, block_ids, num_external_tokens)  once its blocks exist
    build_connector_meta(scheduler_output)  once per step, after the step is decided
worker side, in the model runner's `execute_model`:
    start_load_kv(kv_cache)      before the forward
    wait_for_layer_load(layer) / save_kv_layer(layer)  around each attention layer
    wait_for_save()              after the forward
    get_finished(finished_req_ids) -> (done sending, done receiving)
scheduler side again, in `Scheduler.update_from_output`:
    update_connector_output(kv_connector_output)
    request_finished(request, block_ids) -> (delay_free_blocks, kv_transfer_params)

Neither of kvlab's connectors moves KV layer by layer (vLLM's offloading connector does not
either): the per-layer hooks are here, and do nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import time


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclasses.dataclass
class BlockTransfer:
    """One request's blocks to move this step: `keys[i]` (a tier slot or a block hash) to or
    from pool block `block_ids[i]`."""

    req_id: str
    keys: list
    block_ids: list[int]


@dataclasses.dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step."""

    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    stores: list[BlockTransfer] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores)


@dataclasses.dataclass
class KVConnectorOutput:
    """What the worker side reports back (vLLM: `KVConnectorOutput`, vllm/v1/outputs.py)."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    # Loads that failed, by request (vLLM's KVConnectorOutput.failed_recving): the request
    # recomputes or fails, by kv_load_failure_policy.
    failed_recving: set[str] = dataclasses.field(default_factory=set)
    # Stores written, and stores that failed (a write that raised, or a forward that failed
    # before the K/V were complete), each as its list of keys (tier slots or block keys).
    finished_stores: list = dataclasses.field(default_factory=list)
    failed_stores: list = dataclasses.field(default_factory=list)
    # Bytes moved and seconds spent this step, as vLLM's kv_offload metrics count them.
    load_bytes: int = 0
    load_time: float = 0.0
    store_bytes: int = 0
    store_time: float = 0.0


class KVConnectorBase:
    """A connector: subclasses fill in the hooks of their role (see the module docstring)."""

    def __init__(self, transfer_config, role: KVConnectorRole, block_size: int) -> None:
        self.transfer_config = transfer_config
        self.role = role
        self.block_size = block_size
        self._metadata: KVConnectorMetadata | None = None
        # Scheduler side: bytes moved and seconds spent, summed over the workers' reports
        # (vLLM's kv_offload load/store bytes and time).
        self.load_bytes = self.store_bytes = 0
        self.load_time = self.store_time = 0.0

    # ---- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens past `num_computed_tokens` (the local hit, block-aligned) the connector can
        supply, and whether they load asynchronously. None: ask again next step. Must not
        change any state a later call would see (the scheduler may not admit the request)."""
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request was admitted and holds `block_ids`; the last `num_external_tokens` of
        its computed tokens are to be loaded into them."""

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's loads and stores, once the step is decided."""
        return KVConnectorMetadata()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker side reported for a step whose result is being read (subclasses
        call this for the transfer totals)."""
        self.load_bytes += output.load_bytes
        self.load_time += output.load_time
        self.store_bytes += output.store_bytes
        self.store_time += output.store_time

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """The request ended, before its blocks are freed: whether to hold them while they are
        sent (True), and the kv_transfer_params to return with its output."""
        return False, None

    # ---- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache) -> None:
        self.kv_cache = kv_cache

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Before the forward: start (or, synchronous, finish) this step's loads."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: block until its K/V has arrived (layer-wise only)."""

    def save_kv_layer(self, layer_name: str) -> None:
        """After a layer's attention: start saving its K/V (layer-wise only)."""

    def wait_for_save(self) -> None:
        """After the forward: finish (or start) this step's stores."""

    def fail_saves(self) -> None:
        """The forward failed: this step's stores hold no complete K/V; write none of them and
        report them failed (kvlab's; vLLM reports such blocks through its error paths)."""
        out = getattr(self, "_output", None) or KVConnectorOutput()
        self._output = out
        for job in (self._metadata.stores if self._metadata else ()):
            out.failed_stores.append(job.keys)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """What finished this step."""
        return KVConnectorOutput()

    # ---- what both of kvlab's connectors share -----------------------------------------------
    def _prompt_blocks_done(self, scheduler_output, next_store: dict[str, int]):
        """For each scheduled request tracked in `next_store` (request id -> its first block
        not yet offered): the full prompt blocks this step completes, as (request, start, end,
        block ids); `next_store` moves past them. Prompt blocks only (vLLM's offloading
        default, offload_prompt_only)."""
        for request, num_new in scheduler_output.scheduled:
            rid = request.request_id
            start = next_store.get(rid)
            if start is None:
                continue
            done = scheduler_output.num_computed_tokens[rid] + num_new
            end = min(done, request.num_prompt_tokens) // self.block_size
            if end > start:
                next_store[rid] = end
                yield request, start, end, scheduler_output.block_ids[rid][start:end]

    def _run_loads(self, read) -> None:
        """Before the forward: read each load's blocks (`read(keys)` -> host bytes) into the
        pool, timing them; a read that raises OSError fails its request's load."""
        from kvlab.kv_transfer.tier import scatter_blocks

        self._output = KVConnectorOutput()
        for job in self._metadata.loads:
            start = time.perf_counter()
            try:
                data = read(job.keys)
            except OSError:
                self._output.failed_recving.add(job.req_id)
                continue
            scatter_blocks(self.kv_cache, job.block_ids, data)
            self._output.finished_recving.add(job.req_id)
            self._output.load_bytes += data.nbytes
            self._output.load_time += time.perf_counter() - start

    def _run_stores(self, write) -> None:
        """After the forward: write each store's blocks (`write(keys, host bytes)`), timing
        them; a write that raises OSError fails that store."""
        from kvlab.kv_transfer.tier import gather_blocks

        for job in self._metadata.stores:
            start = time.perf_counter()
            data = gather_blocks(self.kv_cache, job.block_ids)
            try:
                write(job.keys, data)
            except OSError:
                self._output.failed_stores.append(job.keys)
                continue
            self._output.finished_stores.append(job.keys)
            self._output.store_bytes += data.nbytes
            self._output.store_time += time.perf_counter() - start

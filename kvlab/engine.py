"""`LLMEngine` (add_request / step / abort_request) and `LLM` (offline `generate`), as in vLLM.

Defined in notebook 00; notebook 03 drives `LLMEngine` step by step. All state lives in the
engine instance: two engines in one notebook never see each other's requests or counters.

One step is four calls, one owner each, as in vLLM v1: `Scheduler.schedule()` ->
`ModelRunner.execute_model()` -> `Scheduler.update_from_output()` -> `OutputProcessor`.
Whatever watches the steps (the step trace, the KV cache events, the workbook's explorer) is a
`StepObserver` beside them (kvlab/step_log.py). The scheduler class, and the KV cache manager's,
are chosen by the config (`scheduler_cls`, `kv_cache_manager_cls`), as vLLM's scheduler_cls.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from kvlab import platforms
from kvlab.beam_search import BeamSearchGroup, BeamSearchOutput, BeamSearchParams
from kvlab.config import EngineConfig, check_int, resolve_class
from kvlab.group_scheduler import GroupScheduler
from kvlab.inputs import ParsedPrompt, parse_prompt
from kvlab.kv_cache import allocate_kv_cache, get_kv_cache_manager_cls, make_kv_cache_manager
from kvlab.kv_cache_coordinator import HybridKVCacheManager, is_hybrid
from kvlab.kv_cache_interface import (bytes_per_block, capacity_line, get_kv_cache_groups,
                                      layer_specs)
from kvlab.kv_quant import check_float_kv_cache_dtype, get_kv_cache_dtype
from kvlab.kv_transfer import KVConnectorRole, create_connector
from kvlab.kv_transfer.tier import block_nbytes
from kvlab.metrics import RequestMetrics
from kvlab.model import Transformer, load_model
from kvlab.attention import get_attention_backend
from kvlab.model_runner import ModelRunner
from kvlab.output_processor import OutputProcessor
from kvlab.outputs import RequestOutput
from kvlab.prefix_cache import get_request_block_hasher
from kvlab.request import Request, RequestGroup
from kvlab.sampling import RequestOutputKind, Sampler, SamplingParams
from kvlab.scheduler import Scheduler, SchedulerOutput
from kvlab.step_log import StepLog, StepObserver

# Default KV budget when kv_cache_tokens is not given: kvlab/platforms.py (vLLM sizes it from
# free GPU memory).
DEFAULT_CPU_KV_BYTES = platforms.DEFAULT_CPU_KV_BYTES
DEFAULT_GPU_KV_FRACTION = platforms.DEFAULT_GPU_KV_FRACTION
# Steps in flight at once under async scheduling (vLLM: VllmConfig.max_concurrent_batches in
# vllm/config/vllm.py, 2 with async scheduling and one pipeline stage; EngineCore's
# batch_queue_size in vllm/v1/engine/core.py).
MAX_CONCURRENT_BATCHES = 2


class EngineStepError(RuntimeError):
    """A step failed inside the model. The requests it was running have been ended with
    finish_reason "error" and their blocks returned; every other request is untouched, and
    the engine can keep stepping. `request_ids` are the caller's ids of the failed requests."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {request_ids}: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


def check_hybrid_config(config: EngineConfig, kv_dtype_is_identity: bool) -> None:
    """What kvlab runs with sliding-window layers (chapter 09), refused before any pool exists:
    the paged layout, K/V at the model's dtype, the SDPA and reference backends, n > 1 as
    child requests, and the hybrid manager itself."""
    refused = []
    if config.kv_layout != "paged":
        refused.append("kv_layout='contiguous' (use 'paged')")
    if not kv_dtype_is_identity:
        refused.append(f"kv_cache_dtype={config.kv_cache_dtype!r} (use 'auto')")
    if config.backend == "flex":
        refused.append("backend='flex' (use 'auto' or 'reference')")
    if config.parallel_sampling == "fork":
        refused.append("parallel_sampling='fork' (use 'child_requests')")
    if config.kv_cache_manager_cls is not None:
        refused.append("kv_cache_manager_cls (the hybrid manager is kvlab's own)")
    if refused:
        raise ValueError("this model has sliding-window layers; kvlab runs them without "
                         + ", ".join(refused))


def check_connector_config(config: EngineConfig, is_hybrid: bool,
                           kv_dtype_is_identity: bool) -> None:
    """What a KV connector cannot run with here, refused before any pool or file exists."""
    if is_hybrid:
        raise ValueError("a KV connector on a hybrid model (chapter 09's windows): kvlab's "
                         "connectors move one KV cache group; drop hf_overrides or the tier")
    if not kv_dtype_is_identity:
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} with a KV connector: "
                         "kvlab's connectors move unquantized blocks; use 'auto'")
    if config.parallel_sampling == "fork":
        raise ValueError("parallel_sampling='fork' with a KV connector: forked samples are "
                         "never looked up; use 'child_requests' (vLLM's)")


def get_scheduler_cls(config: EngineConfig) -> type[Scheduler]:
    """The scheduler class for an EngineConfig (vLLM: SchedulerConfig.get_scheduler_cls):
    `scheduler_cls`, imported when it is a dotted path, a subclass of kvlab.scheduler.Scheduler;
    GroupScheduler (vLLM's scheduler with chapter 02's groups beside it) when None."""
    if config.scheduler_cls is None:
        return GroupScheduler
    return resolve_class("scheduler_cls", config.scheduler_cls, Scheduler)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # The classes the config names are checked first: a wrong one costs no model load.
        scheduler_cls = get_scheduler_cls(config)
        get_kv_cache_manager_cls(config)
        self.loaded = load_model(config.model, config.device, config.dtype)
        self.tokenizer = self.loaded.tokenizer
        self.model = Transformer(self.loaded, fast=config.backend != "reference",
                                 attn_backend=get_attention_backend(config.backend,
                                                                    config.enforce_eager),
                                 hf_overrides=config.hf_overrides)
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        check_float_kv_cache_dtype(config.kv_cache_dtype, self.dtype)  # before any pool exists
        # K/V as stored: "auto" keeps the model's dtype; a lower precision makes a
        # token cost fewer bytes, so a budget in bytes holds more of them.
        self.kv_cache_dtype = get_kv_cache_dtype(config.kv_cache_dtype)
        m = self.model
        self.kv_bytes_per_token = self.kv_cache_dtype.bytes_per_token(
            m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)
        # The caller's config is left as it was; the engine keeps the resolved one.
        config = self.config = config.resolve(
            model_max_len=self.loaded.config.max_position_embeddings,
            default_kv_tokens=self._default_kv_tokens(),
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
        self.vocab_size = self.model.embed_tokens.shape[0]
        eos = self.loaded.hf_model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos]) - {None}

        if config.backend == "flex":  # refused before the pool is allocated
            from kvlab.flex_attention import check_eager_flex

            check_eager_flex(config.num_blocks * config.block_size, self.model.num_heads,
                             config.max_num_batched_tokens, self.device, config.enforce_eager)
        # KV cache events are always recorded: the engine hands them to its observers every
        # step; its StepLog keeps them in `kv_events` (bounded), where the explorer reads them.
        # KV cache groups (chapter 09): one, unless some layers have a sliding window.
        self.kv_cache_groups = get_kv_cache_groups(layer_specs(
            m.layer_types, m.sliding_window, config.block_size,
            self.kv_bytes_per_token // m.num_layers * config.block_size))
        self.is_hybrid = is_hybrid(self.kv_cache_groups)
        num_layer_slots, num_blocks = m.num_layers, config.num_blocks
        if self.is_hybrid:
            check_hybrid_config(config, self.kv_cache_dtype.is_identity(self.dtype))
            # The same bytes as a pool for every layer: a block costs one group's layers. Given
            # in bytes, the pool is those bytes in whole blocks, as vLLM sizes it
            # (available memory // bytes per block, vllm/v1/core/kv_cache_planning.py).
            num_layer_slots = len(self.kv_cache_groups[0].layers)
            if config.kv_cache_memory_bytes is not None:
                num_blocks = config.kv_cache_memory_bytes // bytes_per_block(self.kv_cache_groups)
            else:
                num_blocks = config.num_blocks * m.num_layers // num_layer_slots
            for g, group in enumerate(self.kv_cache_groups):
                for slot, layer in enumerate(group.layers):
                    m.layer_group[layer], m.layer_slot[layer] = g, slot
            self.kv_cache_manager = HybridKVCacheManager(
                self.kv_cache_groups, num_blocks, config.block_size, config.max_model_len,
                config.enable_prefix_caching, config.prefix_caching_hash_algo, config.watermark,
                enable_kv_cache_events=True,
                max_in_flight_tokens=self.max_in_flight_tokens,
                prefix_cache_retention_interval=config.prefix_cache_retention_interval)
        else:
            self.kv_cache_manager = make_kv_cache_manager(config, enable_kv_cache_events=True)
        # A connector keys blocks by the prefix cache's keys, with prefix caching or without
        # (vLLM hashes blocks when either is on).
        transfer = config.resolved_kv_transfer_config
        if transfer is not None:
            check_connector_config(config, self.is_hybrid,
                                   self.kv_cache_dtype.is_identity(self.dtype))
        self.block_hasher = (get_request_block_hasher(config.block_size,
                                                      config.prefix_caching_hash_algo)
                             if config.enable_prefix_caching or transfer is not None else None)
        self.kv_cache = allocate_kv_cache(
            num_layer_slots, num_blocks, config.block_size,
            self.model.num_kv_heads, self.model.head_dim, self.dtype, self.device,
            self.kv_cache_dtype,
        )
        # config.scheduler_cls, as vLLM's; by default GroupScheduler: vLLM's scheduler with
        # chapter 02's groups (forked samples, beams) beside it.
        self.scheduler = scheduler_cls(config, self.kv_cache_manager)
        # Unseeded sampling draws from the engine's own generator (seeded by `seed`): no global
        # random state, so two engines in one notebook never disturb each other.
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.device,
                                        Sampler(self.device, config.seed))
        self.kv_connector = self._make_kv_connector(transfer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}  # every sample of an unfinished request
        self.parents: dict[str, list[Request]] = {}  # caller's request id -> its n samples
        self.beam_groups: dict[str, BeamSearchGroup] = {}  # caller's id -> its beam search
        self.num_requests_added = 0
        self.num_steps = 0  # steps that ran the model and were read
        # Steps scheduled and run whose result is not read yet, newest first (async scheduling).
        self.batch_queue: collections.deque = collections.deque()
        self.step_forward_time = 0.0  # the forward time of the step read last
        # Who hears of each step (kvlab/step_log.py): the engine's own record first.
        self.step_log = StepLog()
        self.observers: list[StepObserver] = [self.step_log]

    def _make_kv_connector(self, transfer):
        """Chapter 10: a KV connector, one instance per role as vLLM builds them (only the
        per-step metadata passes from the scheduler's to the worker's); None without one."""
        if transfer is None:
            return None
        block_bytes = block_nbytes(self.kv_cache)
        connector = create_connector(transfer, KVConnectorRole.SCHEDULER,
                                     self.config.block_size, block_bytes)
        worker = create_connector(transfer, KVConnectorRole.WORKER, self.config.block_size,
                                  block_bytes)
        worker.register_kv_caches(self.kv_cache)
        self.scheduler.connector = connector
        self.scheduler.kv_load_failure_policy = transfer.kv_load_failure_policy
        self.model_runner.kv_connector = worker
        return connector

    def add_observer(self, observer: StepObserver) -> None:
        """Have `observer` hear of every step from now on (after the engine's own StepLog)."""
        self.observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop telling `observer` of steps (a measurement that is over)."""
        self.observers.remove(observer)

    def _notify(self, hook: str, *args) -> None:
        for observer in self.observers:
            getattr(observer, hook)(self, *args)

    # The StepLog's records, under the names the notebooks, plots and tests read.
    @property
    def step_trace(self):
        """The most recent steps' StepRecords, for plots (bounded)."""
        return self.step_log.step_trace

    @property
    def last_scheduler_output(self) -> SchedulerOutput | None:
        """The last step's decision, kept for reading only; never fed back."""
        return self.step_log.last_scheduler_output

    @property
    def kv_events(self):
        """(step number, event): the block pool's KV cache events (kvlab/kv_events.py), the
        most recent ones only."""
        return self.step_log.kv_events

    @property
    def num_kv_events(self) -> int:
        return self.step_log.num_kv_events

    def _default_kv_tokens(self) -> int:
        # The weights and, for the fast path, their fused copies: a constant of the model, so
        # every engine of the process gets the same pool whichever backend came first.
        weight_bytes = 2 * sum(p.numel() * p.element_size()
                               for p in self.loaded.hf_model.parameters())
        return platforms.default_kv_tokens(self.device, self.kv_bytes_per_token, weight_bytes)

    # ---- requests in ----------------------------------------------------------------------
    def validate_request(self, request_id, prompt, params, priority: int = 0):
        """Everything add_request checks, without changing anything. Returns the parsed prompt."""
        # vLLM's Request.priority is an int of any sign. Under policy="fcfs" it is accepted and
        # has no effect, as in vLLM 0.33.0, whose v1 engine does not refuse it either.
        check_int("priority", priority)
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.parents or request_id in self.beam_groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # a SamplingParams can be edited after it was built
        if params.n > self.config.max_num_seqs and self.config.parallel_sampling == "fork":
            raise ValueError(
                f"n={params.n} samples can never run together with max_num_seqs="
                f"{self.config.max_num_seqs}: lower n or raise max_num_seqs"
            )
        return parse_prompt(prompt, self.tokenizer, self.vocab_size, self.config.max_model_len)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Queue one request. `priority` (vLLM's): under policy="priority" a lower value is
        served first; ties go by arrival. `arrival_time` (vLLM's, LLMEngine.add_request): when
        the request arrived, a `time.perf_counter()` stamp; None is now. A server stamps it when
        the HTTP request comes in, so its wait for the engine counts in TTFT and the latencies."""
        params = SamplingParams() if params is None else params
        self.add_parsed_request(
            request_id, self.validate_request(request_id, prompt, params, priority), params,
            priority, arrival_time)

    def add_parsed_request(self, request_id: str, parsed: ParsedPrompt,
                           params: SamplingParams, priority: int = 0,
                           arrival_time: float | None = None) -> None:
        """Add a request that `validate_request` has already checked and tokenized."""
        now = time.perf_counter() if arrival_time is None else arrival_time
        self.num_requests_added += 1
        samples = []
        # Forked samples hold their seats together; vLLM v1's child requests are each a
        # request of their own (one seat each).
        fork = self.config.parallel_sampling == "fork"
        group = RequestGroup(request_id, params.n) if params.n > 1 and fork else None
        for i in range(params.n):
            generator = None
            if params.seed is not None and not params.greedy:
                # Sample i draws from seed + i (vLLM's parallel_sampling.py rule):
                # SamplingParams(n=1, seed=seed + i) reproduces it alone, which is how the tests
                # prove that sharing blocks changed nothing. Unseeded samples draw from the
                # sampler's own generator, all rows in one call.
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed + i)
            samples.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                    prompt=parsed.text,
                    prompt_token_ids=list(parsed.token_ids),
                    sampling_params=params,
                    eos_token_ids=self.eos_token_ids,
                    metrics=RequestMetrics(arrival_time=now),
                    generator=generator,
                    cache_salt=parsed.cache_salt,
                    parent_id=request_id,
                    index=i,
                    group=group,
                    prompt_logprobs=None if params.prompt_logprobs is None else [None],
                    priority=priority,
                    block_hasher=self.block_hasher,
                )
            )
        self.parents[request_id] = samples
        for r in samples:
            self.requests[r.request_id] = r
        self.output_processor.add_request(request_id, samples)
        if fork:
            # The prompt is computed once, by sample 0; the others are forked from it when its
            # prompt is done, sharing its blocks (chapter 02). The group holds their seats.
            samples[0].fork_children = samples[1:]
            self.scheduler.add_request(samples[0])
        else:
            # vLLM v1: n requests. With prefix caching, the first keys its full prompt blocks
            # as it takes them and the others, admitted next, find them in the same step.
            for r in samples:
                self.scheduler.add_request(r)

    def add_beam_search(self, request_id: str, parsed: ParsedPrompt,
                        params: BeamSearchParams) -> BeamSearchGroup:
        """Start one beam search: its first beam is an ordinary request to the scheduler."""
        group = BeamSearchGroup(request_id, parsed.token_ids, params, self.eos_token_ids,
                                self.config.max_model_len, time.perf_counter())
        first = group.beams[0]
        first.cache_salt = parsed.cache_salt
        self.beam_groups[request_id] = group
        self.scheduler.add_request(first)
        return group

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks go back to the pool at once."""
        if request_id in self.beam_groups:
            for beam in self.beam_groups.pop(request_id).live_beams():
                self.scheduler.finish_request(beam, "abort")
            return
        if request_id not in self.parents:
            raise ValueError(f"unknown request_id {request_id!r}")
        self._end(request_id, "abort")
        self._drain_dead_steps()

    def _end(self, request_id: str, reason: str) -> None:
        for r in self.parents.pop(request_id):
            self.scheduler.finish_request(r, reason)
            self.requests.pop(r.request_id, None)
        self.output_processor.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished (vLLM's LLMEngine asks its requests, not its core's queue: a
        step still in flight for requests that have all ended is read at once, below)."""
        return self.scheduler.has_unfinished_requests()

    def _drain_dead_steps(self) -> list[RequestOutput]:
        """Read the steps still in flight once no request is left: under async scheduling a
        request stopped by EOS was given one more step before the stop was seen, and an abort
        can leave its request's step in flight. vLLM's EngineCore loop reads its batch queue
        until it is empty; here nobody would call step() again, so read them now."""
        outputs: list[RequestOutput] = []
        while self.batch_queue and not self.scheduler.has_unfinished_requests():
            outputs += self._read_oldest_step(drain=False)
        return outputs

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix, so the next requests run cold (vLLM:
        LLMEngine.reset_prefix_cache). Refused (False, nothing changes) while requests hold
        blocks, unless `reset_running_requests`, which preempts them first (they recompute)."""
        ok = self.scheduler.reset_prefix_cache(reset_running_requests)
        self.drain_kv_events()
        return ok

    def drain_kv_events(self) -> None:
        """Hand the block pool's new KV cache events to the observers (the StepLog keeps them
        in `kv_events`, stamped with the step count)."""
        events = self.kv_cache_manager.take_events()
        if events:
            self._notify("on_kv_events", events)

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One turn of the engine's loop; returns the requests whose result it read (vLLM's
        LLMEngine.step). The observers hear of each schedule and of each step whose result is
        read (kvlab/step_log.py).

        With async_scheduling (vLLM's default) this is EngineCore.step_with_batch_queue: the
        step is scheduled and handed to the model runner; while fewer than
        MAX_CONCURRENT_BATCHES steps are in flight the call returns at once, with no outputs,
        so the next step is scheduled before this one's tokens are read. Otherwise the oldest
        step in flight is read. On a GPU the forward runs while the host schedules the next
        step; here the CPU runs it at once, so the order, the placeholders and the one-step-late
        stop are vLLM's but no time overlaps. Without it (async_scheduling=False, or while
        chapter 02's groups run) each call schedules, runs and reads one step: EngineCore.step.
        """
        self.drain_kv_events()  # what aborts and resets did since the last step
        # The synchronous loop is the same loop with one step in flight at most; leaving the
        # async loop (a fork group arrived) first reads what is in flight.
        run_ahead = self.config.async_scheduling and self.scheduler.can_run_ahead()
        depth = MAX_CONCURRENT_BATCHES if run_ahead else 1
        if (len(self.batch_queue) < depth
                and (not run_ahead or self.scheduler.has_unfinished_requests())
                and self._schedule_and_run() and len(self.batch_queue) < depth):
            return []  # fill the queue before waiting on a result
        if not self.batch_queue:
            return []
        return self._read_oldest_step()

    def _schedule_and_run(self) -> bool:
        """Schedule one step and run it; queue it to be read. False when nothing was scheduled."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self._notify("on_schedule", scheduler_output)
        if not scheduler_output.has_work:
            self.drain_kv_events()
            return False
        model_output = self._execute_model(scheduler_output)
        # This step's own time (schedule and forward), kept for when it is read: under async
        # scheduling the next step's forward runs in between, and is not this step's.
        self.batch_queue.appendleft((scheduler_output, model_output, time.perf_counter() - start,
                                     self.model_runner.last_forward_time))
        return True

    def _read_oldest_step(self, drain: bool = True) -> list[RequestOutput]:
        """Read the oldest step in flight: append its tokens, check stops, free what finished.
        With `drain`, then the steps left in flight if no request is left to read them for."""
        scheduler_output, model_output, run_s, forward_s = self.batch_queue.pop()
        read_start = time.perf_counter()
        touched = self.scheduler.update_from_output(scheduler_output, model_output)
        self._finish_at_stop_strings(touched)
        # The observers time the step from `start`: its schedule and forward, then its update.
        self.step_forward_time = forward_s
        self._end_step(scheduler_output, read_start - run_s)
        outputs = self._make_outputs(touched)
        return outputs + self._drain_dead_steps() if drain else outputs

    def _execute_model(self, scheduler_output: SchedulerOutput):
        """The model runner's forward and sampling for one step. If it fails, only that step's
        requests end (EngineStepError names them); the engine can keep stepping."""
        try:
            return self.model_runner.execute_model(scheduler_output)
        except BaseException as e:  # an interrupt (Ctrl-C in a notebook) included
            failed = self._fail_step(scheduler_output, e)
            if not isinstance(e, Exception):
                raise
            raise EngineStepError(failed, e) from e

    def _finish_at_stop_strings(self, touched: list[Request]) -> None:
        # Stop strings are found in text, so the output stage finds them; the scheduler ends them.
        for request, stop in self.output_processor.check_stop_strings(touched):
            if request.is_finished:  # ended by length in the same step: the string wins
                request.finish_reason, request.stop_reason = "stop", stop
                continue
            self.scheduler.finish_request(request, "stop", stop_reason=stop)
            request.metrics.finished_time = request.metrics.token_times[-1]

    def _end_step(self, scheduler_output: SchedulerOutput, start: float) -> None:
        """Count the step, tell the observers, and check the pool if asked to."""
        self.num_steps += 1
        self._notify("on_step", scheduler_output, start)
        self.drain_kv_events()
        if self.config.debug_checks:
            self.kv_cache_manager.check_invariants()

    def _make_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        outputs = self.output_processor.make_outputs(touched)
        for out in outputs:
            if out.finished:
                for r in self.parents.pop(out.request_id, ()):
                    self.requests.pop(r.request_id, None)
        return outputs

    def _fail_step(self, sched: SchedulerOutput, error: BaseException) -> list[str]:
        """Only the requests of this step are in an unknown state: their freshly keyed blocks
        hold no K/V, so forget those keys, then end the requests (their blocks come back) and
        let every other request go on. Returns the caller's ids of the failed requests."""
        for request, _ in sched.scheduled:
            self.kv_cache_manager.uncache_unwritten_blocks(
                request, sched.num_computed_tokens[request.request_id])
        # Chapter 10: the connector's report of the failed step (its loads done, its stores
        # not made), so no request waits forever for a load and no unwritten block is offered.
        report, self.model_runner.failed_step_connector_output = (
            self.model_runner.failed_step_connector_output, None)
        if report is not None and self.scheduler.connector is not None:
            for r in self.scheduler._update_from_kv_xfer_finished(report):
                if r.parent_id in self.parents:
                    self._end(r.parent_id, "error")
        failed = list(dict.fromkeys(r.parent_id for r, _ in sched.scheduled))
        for rid in failed:
            if rid in self.beam_groups:
                self.beam_groups[rid].error = f"engine step failed: {error!r}"
                self.abort_request(rid)
            elif rid in self.parents:
                self._end(rid, "error")
        self.drain_kv_events()
        return failed

    # ---- what the notebooks read ------------------------------------------------------------
    def set_attention_backend(self, backend) -> None:
        """Swap the attention backend of a live engine (chapter 00's exercise plugs a
        participant's decode attention in; the roofline bench runs an older path beside the
        current one). The model and the model runner hold the same backend: swap both."""
        self.model.attn_backend = backend
        self.model_runner.attn_backend = backend

    def memory_map(self) -> list[tuple[str | None, int, int]]:
        """Who holds each physical block now, how many of its slots hold tokens, how many are
        reserved (the manager's `memory_map`). A request's end is taken as the longest it can
        reach, prompt + max_tokens - 1 tokens of K/V (its last token is never run): a held slot
        past that is internal waste for certain, though an EOS may end it sooner."""
        running = self.scheduler.running
        return self.kv_cache_manager.memory_map(
            {r.request_id: r.num_computed_tokens for r in running},
            {r.request_id: min(r.num_prompt_tokens + r.sampling_params.max_tokens - 1,
                               self.config.max_model_len) for r in running})

    def block_tables(self) -> dict[str, list[int]]:
        return {r.request_id: self.kv_cache_manager.get_block_ids(r.request_id)
                for r in self.scheduler.running}

    @property
    def max_in_flight_tokens(self) -> int:
        """vLLM's `VllmConfig.max_in_flight_tokens`: a step's budget per batch that may be in
        flight, two under async scheduling (vllm/config/vllm.py)."""
        return (2 if self.config.async_scheduling else 1) * self.config.max_num_batched_tokens

    def kv_cache_capacity(self) -> dict:
        """What vLLM 0.33.0 logs at start-up about this pool (`update_kv_cache_capacity`,
        vllm/v1/core/kv_cache_utils.py): its "KV cache size" in tokens and its "Maximum
        concurrency" for requests of max_model_len, and the line itself."""
        tokens, concurrency, line = capacity_line(
            self.kv_cache_groups, self.kv_cache_manager.block_pool.num_blocks,
            self.config.max_model_len, self.max_in_flight_tokens,
            "GPU" if self.device.type == "cuda" else self.device.type.upper())
        return {"kv_cache_size_tokens": tokens, "kv_cache_max_concurrency": concurrency,
                "line": line}

    def stats(self) -> dict:
        pool = self.kv_cache_manager.block_pool
        kv = self.kv_cache_manager
        return {
            "kv_layout": self.config.kv_layout,
            "block_size": self.config.block_size,
            "num_blocks": pool.num_blocks,  # block 0, the null block, included (vLLM's count)
            "num_usable_blocks": pool.num_usable_blocks,  # all but the null block
            "num_free_blocks": pool.get_num_free_blocks(),
            "num_used_blocks": pool.get_num_used_blocks(),
            "peak_blocks_used": kv.peak_blocks_used,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_cow_copies": kv.num_cow_copies,
            # vLLM's PrefixCacheStats: first admissions, and re-admissions after a preemption
            # apart (a preempted request finding its own blocks is not a shared-prefix hit).
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_hit_rate": (kv.prefix_cache_hits / kv.prefix_cache_queries
                                      if kv.prefix_cache_queries else 0.0),
            "prefix_cache_preempted_queries": kv.prefix_cache_preempted_queries,
            "prefix_cache_preempted_hits": kv.prefix_cache_preempted_hits,
            "kv_cache_dtype": self.kv_cache_dtype.name,
            "kv_bytes_per_token": self.kv_bytes_per_token,  # at kv_cache_dtype, scales included
            "kv_capacity_tokens": pool.num_usable_blocks * self.config.block_size,
            "kv_cache_bytes": self.kv_cache.nbytes,  # the pool (and its scales), as allocated
            "max_model_len": self.config.max_model_len,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_cache_groups": len(self.kv_cache_groups),
            **self.kv_connector_stats(),
        }

    def kv_connector_stats(self) -> dict:
        """The KV connector's counters (chapter 10), under vLLM's metric names less the
        `vllm:` prefix; zeros without a connector. external_prefix_cache_*: prompt tokens
        past the pool's hit, and those the connector supplied, at first admissions (vLLM's
        connector PrefixCacheStats). kv_offload_*: blocks and bytes moved and seconds spent,
        stores dropped for want of room (allocation failures), loads that failed."""
        sched, conn = self.scheduler, self.kv_connector
        stats = {
            "external_prefix_cache_queries": sched.external_prefix_cache_queries,
            "external_prefix_cache_hits": sched.external_prefix_cache_hits,
            "external_prefix_cache_preempted_queries":
                sched.external_prefix_cache_preempted_queries,
            "external_prefix_cache_preempted_hits": sched.external_prefix_cache_preempted_hits,
            "kv_load_failures": sched.num_kv_load_failures,
        }
        for name in ("load_bytes", "load_time", "store_bytes", "store_time"):
            stats[f"kv_offload_{name}"] = getattr(conn, name, 0)
        stats["kv_offload_allocation_failure"] = getattr(conn, "num_allocation_failures", 0)
        stats["kv_offload_tier_blocks"] = getattr(conn, "num_slots", 0)
        stats["kv_offload_tier_blocks_used"] = getattr(conn, "num_tier_blocks_used", 0)
        return stats


def _priority_to_seq(priority, num_prompts: int) -> list[int]:
    """`generate`'s priority as one int per prompt (vLLM: _priority_to_seq in
    vllm/entrypoints/common/offline.py): None is 0 for all, an int is every prompt's."""
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, (list, tuple)):
        if len(priority) != num_prompts:
            raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts")
        return list(priority)
    check_int("priority", priority)
    return [priority] * num_prompts


class LLM:
    """vLLM's offline entry point: build once, then `generate` (or `chat`) many times.

    >>> llm = LLM(block_size=16)                      # the packaged SmolLM2-135M-Instruct
    >>> out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        block_size: int = 16,
        kv_layout: str = "paged",
        kv_cache_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        scheduler_reserve_full_isl: bool = True,
        watermark: float = 0.0,
        long_prefill_token_threshold: int = 0,
        long_prefill_token_threshold_adaptive: bool = False,
        enable_prefix_caching: bool | None = None,
        prefix_caching_hash_algo: str = "sha256",
        scheduling: str = "continuous",
        policy: str = "fcfs",
        scheduling_policy: str | None = None,
        scheduler_cls: str | type | None = None,
        kv_cache_manager_cls: str | type | None = None,
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        backend: str = "auto",
        enforce_eager: bool | None = None,
        parallel_sampling: str = "child_requests",
        async_scheduling: bool = True,
        debug_checks: bool = False,
        hf_overrides: dict | None = None,
        prefix_cache_retention_interval: int | None = 0,
        kv_offloading_size: float | None = None,
        kv_offloading_backend: str = "native",
        kv_transfer_config=None,
    ) -> None:
        # vLLM's LLM and EngineArgs call the policy `scheduling_policy`, its SchedulerConfig
        # `policy` (vllm/engine/arg_utils.py): either name works here.
        if scheduling_policy is not None:
            if policy not in ("fcfs", scheduling_policy):
                raise ValueError(f"policy={policy!r} and scheduling_policy={scheduling_policy!r}: "
                                 "give the scheduling policy once")
            policy = scheduling_policy
        config = EngineConfig(  # validates every knob before anything is loaded
            model=model, block_size=block_size, kv_layout=kv_layout,
            kv_cache_tokens=kv_cache_tokens, kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduler_reserve_full_isl=scheduler_reserve_full_isl, watermark=watermark,
            long_prefill_token_threshold=long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=long_prefill_token_threshold_adaptive,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo, scheduling=scheduling,
            policy=policy, scheduler_cls=scheduler_cls, kv_cache_manager_cls=kv_cache_manager_cls,
            device=device, dtype=dtype, seed=seed, backend=backend,
            enforce_eager=enforce_eager, parallel_sampling=parallel_sampling,
            async_scheduling=async_scheduling, debug_checks=debug_checks,
            hf_overrides=hf_overrides,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            kv_offloading_size=kv_offloading_size, kv_offloading_backend=kv_offloading_backend,
            kv_transfer_config=kv_transfer_config,
        )
        self.llm_engine = LLMEngine(config)
        self.request_counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's `LLM.reset_prefix_cache`: forget every cached prefix so the next `generate`
        runs cold (benchmarks and chapters use it instead of building a new engine). False
        while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        `priority` (vLLM's): one int for every prompt, or one per prompt; under
        policy="priority" a lower value is served first. Every prompt and parameter is checked
        before the first request is added, so bad input anywhere in the list leaves the engine
        exactly as it was.
        """
        engine = self.llm_engine
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts is empty")
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts"
                )
            params = list(sampling_params)
        else:
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, "
                f"got {type(sampling_params).__name__}"
            )
        priorities = _priority_to_seq(priority, len(prompts))
        ids = [f"gen-{self.request_counter + i}" for i in range(len(prompts))]
        # Tokenized once here; nothing is added unless every prompt and parameter passed.
        parsed = [engine.validate_request(rid, prompt, sp, prio)
                  for rid, prompt, sp, prio in zip(ids, prompts, params, priorities)]
        self.request_counter += len(prompts)
        # Offline, only the finished output is wanted: text is decoded once, at the end
        # (vLLM's LLM.generate asks for RequestOutputKind.FINAL_ONLY the same way).
        params = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                  for sp in params]

        for rid, pp, sp, prio in zip(ids, parsed, params, priorities):
            engine.add_parsed_request(rid, pp, sp, prio)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update()
        except BaseException:
            # An interrupt (or any failure) must not strand blocks: abort what is left.
            for rid in ids:
                if rid in engine.parents:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = False, priority=None):
        """One conversation (a list of {"role", "content"}) or a list of them, through the
        tokenizer's chat template; returns one RequestOutput per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one `BeamSearchOutput` per prompt, sequences best first.

        Every prompt's beams are requests to the same scheduler as `generate`'s, stepped by the
        same `engine.step()`; a search holds `beam_width` seats.
        """
        engine = self.llm_engine
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a prompt or a non-empty list of prompts")
        cfg, kv = engine.config, engine.kv_cache_manager
        if engine.is_hybrid:
            raise ValueError("beam search forks block tables, which kvlab does not do for a "
                             "hybrid model's KV cache groups (sliding-window layers)")
        if params.beam_width > cfg.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} beams can never run together with "
                             f"max_num_seqs={cfg.max_num_seqs}: lower beam_width")
        ids = [f"beam-{self.request_counter + i}" for i in range(len(prompts))]
        parsed = [engine.validate_request(rid, p, SamplingParams()) for rid, p in zip(ids, prompts)]
        for p in parsed:
            # Fewest blocks beam search can live with: the shared prompt plus one block per beam.
            need = kv.num_blocks_for(len(p.token_ids)) + params.beam_width
            if need > kv.block_pool.num_usable_blocks:
                raise ValueError(
                    f"beam_width={params.beam_width} with a {len(p.token_ids)}-token prompt needs "
                    f"at least {need} KV blocks; the pool has {kv.block_pool.num_usable_blocks} "
                    "(besides block 0, the null block): lower beam_width "
                    "or raise kv_cache_tokens"
                )
        self.request_counter += len(prompts)
        groups = [engine.add_beam_search(rid, p, params) for rid, p in zip(ids, parsed)]
        try:
            while not all(g.done or g.error for g in groups):
                engine.step()
        finally:
            for rid in ids:  # every beam's blocks come back, whatever happened
                if rid in engine.beam_groups:
                    engine.abort_request(rid)
        for g in groups:
            if g.error:
                raise RuntimeError(g.error)
        return [g.output(engine.tokenizer) for g in groups]

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
            raise TypeError("a conversation must be a list of {'role': ..., 'content': ...} dicts")
        ids = self.get_tokenizer().apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

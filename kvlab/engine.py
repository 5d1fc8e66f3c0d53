"""`LLMEngine` (add_request / step / abort_request) and `LLM` (offline `generate`), as in vLLM.

Defined in notebook 00; notebook 03 drives `LLMEngine` step by step. All state lives in the
engine instance: two engines in one notebook never see each other's requests or counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from kvlab.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from kvlab.config import EngineConfig
from kvlab.inputs import ParsedPrompt, parse_prompt
from kvlab.kv_cache import KVCacheManager, allocate_kv_cache
from kvlab.metrics import RequestMetrics, StepRecord
from kvlab.model import Transformer, load_model
from kvlab.model_runner import ModelRunner
from kvlab.outputs import CompletionOutput, RequestOutput
from kvlab.request import Request, RequestStatus
from kvlab.sampling import SamplingParams, sample
from kvlab.scheduler import Scheduler

# Default KV budget when kv_cache_tokens is not given (vLLM sizes it from free GPU memory).
DEFAULT_CPU_KV_BYTES = 512 * 2**20
DEFAULT_GPU_KV_FRACTION = 0.5  # of the memory still free after the weights


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loaded = load_model(config.model, config.device, config.dtype)
        self.tokenizer = self.loaded.tokenizer
        self.model = Transformer(self.loaded, fast=config.backend != "reference")
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        self.kv_bytes_per_token = self.model.kv_bytes_per_token(self.dtype)
        config.resolve(
            model_max_len=self.loaded.config.max_position_embeddings,
            default_kv_tokens=self._default_kv_tokens(),
        )
        self.vocab_size = self.model.embed_tokens.shape[0]
        eos = self.loaded.hf_model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos]) - {None}

        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.kv_layout, config.max_model_len,
            config.enable_prefix_caching, config.prefix_caching_hash_algo,
        )
        self.kv_cache = allocate_kv_cache(
            self.model.num_layers, config.num_blocks, config.block_size,
            self.model.num_kv_heads, self.model.head_dim, self.dtype, self.device,
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        self.model_runner = ModelRunner(
            self.model, self.kv_cache, self.kv_cache_manager, self.device,
            attention_backend=config.backend,
        )
        self.requests: dict[str, Request] = {}  # every unfinished sample, by its own id
        self.parents: dict[str, list[Request]] = {}  # caller's request id -> its n samples
        self.num_requests_added = 0  # seeds unseeded sampling reproducibly, per engine
        # The most recent steps, for plots; bounded so a long-lived engine does not grow.
        self.step_trace: deque[StepRecord] = deque(maxlen=100_000)
        self.num_steps = 0

    def _default_kv_tokens(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * DEFAULT_GPU_KV_FRACTION) // self.kv_bytes_per_token
        return DEFAULT_CPU_KV_BYTES // self.kv_bytes_per_token

    # ---- requests in ----------------------------------------------------------------------
    def validate_request(self, request_id, prompt, params):
        """Everything add_request checks, without changing anything. Returns the parsed prompt."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} samples can never run together with max_num_seqs="
                f"{self.config.max_num_seqs}: lower n or raise max_num_seqs"
            )
        return parse_prompt(prompt, self.tokenizer, self.vocab_size, self.config.max_model_len)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        params = SamplingParams() if params is None else params
        self.add_parsed_request(request_id, self.validate_request(request_id, prompt, params),
                                params)

    def add_parsed_request(self, request_id: str, parsed: ParsedPrompt,
                           params: SamplingParams) -> None:
        """Add a request that `validate_request` has already checked and tokenized."""
        now = time.perf_counter()
        base_seed = params.seed
        if base_seed is None:  # reproducible per engine, distinct per request and sample
            base_seed = (self.config.seed << 32) + (self.num_requests_added << 12)
        self.num_requests_added += 1
        samples = []
        for i in range(params.n):
            generator = None
            if not params.greedy:
                # Sample i draws from seed + i: SamplingParams(n=1, seed=seed + i) reproduces it
                # alone, which is how the tests prove that sharing blocks changed nothing.
                generator = torch.Generator(device=self.device)
                generator.manual_seed(base_seed + i)
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
                )
            )
        self.parents[request_id] = samples
        for r in samples:
            self.requests[r.request_id] = r
        # The prompt is computed once, by sample 0; the others are forked from it when its
        # prompt is done, sharing its blocks (chapter 02).
        samples[0].fork_children = samples[1:]
        self.scheduler.add_request(samples[0])

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks go back to the pool at once."""
        if request_id not in self.parents:
            raise ValueError(f"unknown request_id {request_id!r}")
        for r in self.parents.pop(request_id):
            if not r.is_finished:
                self.scheduler.finish_request(r, "abort")
            self.requests.pop(r.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that got a token."""
        start = time.perf_counter()
        cow_before = self.kv_cache_manager.num_cow_copies
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        num_decode = sum(
            1 for r, n in sched.scheduled if r.num_computed_tokens >= r.num_prompt_tokens
        )
        for request, _ in sched.scheduled:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = start
        done, logits = self.model_runner.execute_model(sched.scheduled)
        for request, num_new in sched.scheduled:
            request.num_computed_tokens += num_new
            self.kv_cache_manager.cache_blocks(request)  # full blocks become findable
        # Each request whose K/V is complete samples one token. Samples waiting to be forked
        # from it (n > 1) start now, sharing its blocks, and draw from the same logits.
        rows, samplers = [], []
        for i, request in enumerate(done):
            children, request.fork_children = request.fork_children, []
            for r in [request, *(c for c in children if self._fork(request, c, start))]:
                rows.append(i)
                samplers.append(r)
        tokens = []
        if samplers:
            tokens = sample(logits[rows], [r.sampling_params for r in samplers],
                            [r.generator for r in samplers])
        now = time.perf_counter()
        touched: dict[str, None] = {}
        for r, token in zip(samplers, tokens):
            self._append_token(r, token, now)
            touched[r.parent_id] = None
        self.record_step(
            sched.scheduled, num_decode, start, cow_before,
            running=self.scheduler.running, num_waiting=len(self.scheduler.waiting),
        )
        outputs = [self._make_output(pid) for pid in touched]
        for out in outputs:
            if out.finished:
                for r in self.parents.pop(out.request_id):
                    self.requests.pop(r.request_id, None)
        return outputs

    def record_step(self, scheduled, num_decode: int, start: float, cow_before: int,
                    running: list[Request], num_waiting: int) -> None:
        """Append one StepRecord to the trace (the engine's steps and beam search's alike)."""
        self.num_steps += 1
        self.step_trace.append(StepRecord(
            step=self.num_steps,
            request_ids=[r.request_id for r, _ in scheduled],
            num_prefill_tokens=sum(n for _, n in scheduled) - num_decode,
            num_decode_tokens=num_decode,
            num_running=len(running),
            num_waiting=num_waiting,
            num_used_blocks=self.kv_cache_manager.block_pool.get_num_used_blocks(),
            num_cached_tokens=sum(r.num_computed_tokens for r in running),
            num_cow_copies=self.kv_cache_manager.num_cow_copies - cow_before,
            step_time=time.perf_counter() - start,
            forward_time=self.model_runner.last_forward_time,
        ))

    def _fork(self, parent: Request, child: Request, now: float) -> bool:
        """Start a sample from its parent's computed prompt: share blocks, copy nothing."""
        if not self.kv_cache_manager.fork(parent.request_id, child.request_id):
            # Contiguous layout with no free region: it computes its own prompt later.
            self.scheduler.waiting.appendleft(child)
            return False
        child.metrics.first_scheduled_time = now
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.scheduler.running.append(child)
        return True

    def _append_token(self, request: Request, token: int, now: float) -> None:
        request.append_output_token(token, now)
        reason = request.check_stop(self.config.max_model_len)
        if reason is not None:
            self.scheduler.finish_request(request, reason)
            request.metrics.finished_time = now

    def _make_output(self, parent_id: str) -> RequestOutput:
        samples = self.parents[parent_id]
        first = samples[0]
        completions = [
            CompletionOutput(
                index=r.index,
                text=self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
                token_ids=list(r.output_token_ids),
                finish_reason=r.finish_reason,
            )
            for r in samples
        ]
        return RequestOutput(
            request_id=parent_id,
            prompt=first.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=completions,
            finished=all(r.is_finished for r in samples),
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
        )

    # ---- what the notebooks read ------------------------------------------------------------
    def memory_map(self) -> list[tuple[str | None, int]]:
        """Who holds each physical block now, and how many of its slots hold tokens."""
        return self.kv_cache_manager.memory_map(
            {r.request_id: r.num_computed_tokens for r in self.scheduler.running}
        )

    def block_tables(self) -> dict[str, list[int]]:
        return {r.request_id: self.kv_cache_manager.get_block_ids(r.request_id)
                for r in self.scheduler.running}

    def stats(self) -> dict:
        pool = self.kv_cache_manager.block_pool
        return {
            "kv_layout": self.config.kv_layout,
            "block_size": self.config.block_size,
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.get_num_free_blocks(),
            "num_used_blocks": pool.get_num_used_blocks(),
            "peak_blocks_used": self.kv_cache_manager.peak_blocks_used,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_cow_copies": self.kv_cache_manager.num_cow_copies,
            "prefix_cache_queries": self.kv_cache_manager.prefix_cache_queries,
            "prefix_cache_hits": self.kv_cache_manager.prefix_cache_hits,
            "prefix_cache_hit_rate": (
                self.kv_cache_manager.prefix_cache_hits / self.kv_cache_manager.prefix_cache_queries
                if self.kv_cache_manager.prefix_cache_queries else 0.0
            ),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": pool.num_blocks * self.config.block_size,
            "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size(),
            "max_model_len": self.config.max_model_len,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


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
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = False,
        prefix_caching_hash_algo: str = "sha256",
        scheduling: str = "continuous",
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        backend: str = "auto",
    ) -> None:
        config = EngineConfig(  # validates every knob before anything is loaded
            model=model, block_size=block_size, kv_layout=kv_layout,
            kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo, scheduling=scheduling,
            device=device, dtype=dtype, seed=seed, backend=backend,
        )
        self.llm_engine = LLMEngine(config)
        self.request_counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        Every prompt and parameter is checked before the first request is added, so bad input
        anywhere in the list leaves the engine exactly as it was.
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
        ids = [f"gen-{self.request_counter + i}" for i in range(len(prompts))]
        # Tokenized once here; nothing is added unless every prompt passed.
        parsed = [engine.validate_request(rid, prompt, sp)
                  for rid, prompt, sp in zip(ids, prompts, params)]
        self.request_counter += len(prompts)

        for rid, pp, sp in zip(ids, parsed, params):
            engine.add_parsed_request(rid, pp, sp)
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

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = False):
        """One conversation (a list of {"role", "content"}) or a list of them, through the
        tokenizer's chat template; returns one RequestOutput per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one `BeamSearchOutput` per prompt, sequences best first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a prompt or a non-empty list of prompts")
        return beam_search(self.llm_engine, list(prompts), params)

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
            raise TypeError("a conversation must be a list of {'role': ..., 'content': ...} dicts")
        ids = self.get_tokenizer().apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

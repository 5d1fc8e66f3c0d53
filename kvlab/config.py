"""Every engine knob in one place, named as vLLM names it.

Defined in notebook 00; the layouts are the subject of 01, scheduling of 03-04, prefix caching
of 05-06. Validation happens here, before a model is loaded or a block is allocated, so a typo
costs nothing and leaves no state behind.
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
from dataclasses import dataclass

from kvlab.kv_quant import get_kv_cache_dtype
from kvlab.prefix_cache import HASH_ALGOS

KV_LAYOUTS = ("paged", "contiguous")
SCHEDULING_POLICIES = ("continuous", "static")  # the `scheduling` knob (kvlab-only)
POLICIES = ("fcfs", "priority")  # the `policy` knob: vLLM's SchedulerPolicy
BACKENDS = ("auto", "reference", "flex")
PARALLEL_SAMPLING = ("fork", "child_requests")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's SchedulerConfig default (vllm/config/scheduler.py)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # with chunked prefill; vLLM's serve default on a CPU


def batch_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None,
                 enable_chunked_prefill: bool = True, max_model_len: int = 0) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) with kvlab's defaults filled in where None: the
    budget first, then the seats, lowered to the budget only when not given (vLLM's rule:
    EngineArgs._set_default_max_num_seqs_and_batched_tokens_args, vllm/engine/arg_utils.py)."""
    budget = max_num_batched_tokens
    if budget is None:
        budget = (DEFAULT_MAX_NUM_BATCHED_TOKENS if enable_chunked_prefill
                  else max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS))
    seqs = min(DEFAULT_MAX_NUM_SEQS, budget) if max_num_seqs is None else max_num_seqs
    return seqs, budget


def check_int(name: str, value, *, minimum: int | None = None, allow_none: bool = False) -> None:
    """Raise TypeError/ValueError naming `name` unless `value` is an int (not a bool) >= minimum."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def resolve_class(name: str, value, base: type) -> type:
    """`value` as a class: the class itself, or the one a "module.Class" path names (vLLM:
    resolve_obj_by_qualname in vllm/utils/import_utils.py); it must be a subclass of `base`
    (`object`: any class)."""
    cls = value
    if isinstance(value, str):
        module_name, _, attr = value.rpartition(".")
        if not module_name or not attr:
            raise ValueError(f"{name} must be a class or a 'module.Class' path, got {value!r}")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{name}={value!r} names no importable class: {e}") from None
    if not isinstance(cls, type) or not issubclass(cls, base):
        kind = "a class" if base is object else (
            f"a subclass of {base.__module__}.{base.__qualname__}")
        raise TypeError(f"{name} must be {kind} (or the 'module.Class' path of one), "
                        f"got {value!r}")
    return cls


HF_OVERRIDE_KEYS = ("layer_types", "sliding_window")


def check_hf_overrides(overrides) -> None:
    """The overrides kvlab applies, well formed (their length against the model's layers is
    checked once the model is known)."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise TypeError(f"hf_overrides must be a dict, got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"hf_overrides: kvlab applies {HF_OVERRIDE_KEYS}, not {unknown}")
    types = overrides.get("layer_types")
    if types is not None and (not isinstance(types, (list, tuple)) or not types or not all(
            t in ("full_attention", "sliding_attention") for t in types)):
        raise ValueError("hf_overrides['layer_types'] must be a list of 'full_attention' and "
                         f"'sliding_attention', one per layer, got {types!r}")
    if "sliding_window" in overrides:
        check_int("hf_overrides['sliding_window']", overrides["sliding_window"], minimum=2,
                  allow_none=True)


@dataclass
class EngineConfig:
    """The knobs of one engine. Names follow vLLM's `LLM(...)` / `vllm serve` flags.

    `None` means "derive from the model and the machine" (see `resolve`).
    """

    model: str | None = None  # None: the packaged SmolLM2-135M-Instruct (offline)
    block_size: int = 16  # tokens per KV block (vLLM --block-size)
    kv_layout: str = "paged"  # kvlab-only: "paged" (vLLM) or "contiguous" (pre-vLLM baseline)
    kv_cache_tokens: int | None = None  # KV budget in tokens; stands in for gpu_memory_utilization
    # vLLM's names (vllm/config/cache.py). kv_cache_dtype: how K/V are stored ("auto": as the
    # model computes them; kvlab/kv_quant.py lists the rest). kv_cache_memory_bytes: the pool
    # in bytes instead of tokens (as vLLM's, which then ignores gpu_memory_utilization), so the
    # same bytes hold more tokens at a lower precision. Not with kv_cache_tokens.
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    # Most requests running at once (vLLM --max-num-seqs). None: vLLM's default, 256, lowered
    # to max_num_batched_tokens when the budget is smaller (vllm/engine/arg_utils.py,
    # EngineArgs.create_engine_config: max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
    # when it was not given). Given explicitly above the budget it is refused, as vLLM's
    # SchedulerConfig refuses it (vllm/config/scheduler.py).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # token budget of one step (prefill + decode)
    max_model_len: int | None = None  # prompt + output limit; None: the model's context length
    enable_chunked_prefill: bool = True  # split long prompts over several steps (vLLM v1 default)
    # vLLM 0.33.0's name and default (vllm/config/scheduler.py): admit a waiting request only
    # when its whole prompt fits in the free blocks, not just its first chunk, so chunked
    # prefill does not over-admit and then preempt (chapter 04 measures both settings).
    scheduler_reserve_full_isl: bool = True
    # vLLM's name and default (vllm/config/scheduler.py): the fraction of all KV blocks an
    # admission must leave free while other requests run; 0 disables it.
    watermark: float = 0.0
    # vLLM 0.33.0's names and defaults (vllm/config/scheduler.py): the most prompt tokens one
    # request is given in a step while others are queued or running, so that one long prefill
    # does not take the whole budget step after step; 0 (the default) disables it, and it never
    # applies to a request alone in the engine. `..._adaptive` raises it to a fair share,
    # max_num_batched_tokens // (running + waiting requests), when that is larger.
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    # Reuse full KV blocks of shared prefixes (chapter 05). vLLM's name and default
    # (vllm/config/cache.py: CacheConfig.enable_prefix_caching = True). None (the default) is
    # True for the paged layout and False for the contiguous baseline, which cannot share a
    # block; a chapter that wants a cold engine says enable_prefix_caching=False.
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str = "sha256"  # vLLM --prefix-caching-hash-algo; hashlib names
    scheduling: str = "continuous"  # kvlab-only: "continuous" (Orca/vLLM) or "static" batching
    # vLLM's name and default (vllm/config/scheduler.py: policy, `--scheduling-policy`): the
    # order of the waiting queue (kvlab/request_queue.py). "fcfs": arrival order. "priority":
    # the lowest `priority` value a request was given first, ties by arrival; under memory
    # pressure the running request with the highest (priority, arrival) is preempted.
    policy: str = "fcfs"
    # vLLM's name (vllm/config/scheduler.py: scheduler_cls): the scheduler class, or the dotted
    # path "module.Class" of one; a subclass of kvlab.scheduler.Scheduler, built as
    # cls(config, kv_cache_manager) (kvlab.engine.get_scheduler_cls). None:
    # kvlab.group_scheduler.GroupScheduler (vLLM's scheduler with chapter 02's groups beside
    # it). The exercises plug a participant's in here.
    scheduler_cls: str | type | None = None
    # kvlab-only, on the same pattern: the KV cache manager class (or "module.Class"), a
    # subclass of the kv_layout's own manager, built with that manager's arguments
    # (kvlab.kv_cache.get_kv_cache_manager_cls). None: the layout's. vLLM's scheduler builds
    # its manager itself and has no such knob.
    kv_cache_manager_cls: str | type | None = None
    device: str = "auto"  # "auto": CUDA if present, else CPU
    dtype: str = "auto"  # "auto": bfloat16 on GPUs from compute capability 8.0, float16 on
    # older ones (the T4), float32 on CPU (kvlab/platforms.py, as vLLM resolves it)
    seed: int = 0  # seeds sampling of requests that bring no seed of their own
    # kvlab-only. "reference": the readable path (plain matmuls, attention one sequence at a
    # time). "auto": the same arithmetic, faster (fused q/k/v and gate/up matmuls, oneDNN-packed
    # on CPU, batched decode attention). "flex": "auto"'s matmuls with FlexAttention reading the
    # pool in place (the GPU path; on a CPU it runs eagerly, slowly, as a check). Tests prove
    # all three give transformers' tokens.
    backend: str = "auto"
    # vLLM's name (vllm/config/model.py: enforce_eager, default False there: compile and
    # capture CUDA graphs). Here only `backend="flex"` has a compiled form. None: compile it
    # where that pays, on CUDA; True: never compile; False: compile on a CPU too (inductor's
    # C++ FlexAttention kernel; `python -m kvlab.bench compiled-flex` measures it).
    enforce_eager: bool | None = None
    # kvlab-only: how the n samples of SamplingParams(n > 1) share their prompt (chapter 02).
    # "fork": the PagedAttention paper's way (and vLLM v0's): the prompt is computed once and
    # the samples fork its block table, the partly filled last block included; copy-on-write
    # separates them. "child_requests": vLLM v1's way (vllm/v1/engine/parallel_sampling.py):
    # n independent requests that share only full prompt blocks, through the prefix cache.
    parallel_sampling: str = "child_requests"
    # vLLM's name and default (vllm/config/scheduler.py: async_scheduling; VllmConfig turns
    # None into True unless an option forbids it, vllm/config/vllm.py): the engine schedules
    # step t + 1 before it has read step t's sampled tokens, holding at most two steps in flight
    # (EngineCore.step_with_batch_queue, vllm/v1/engine/core.py). The scheduler advances
    # num_computed_tokens when it schedules and counts the token a step will sample as an
    # output placeholder (vllm/v1/core/sched/async_scheduler.py), so a request that stops on
    # EOS is found one step late. False: the synchronous loop (schedule, run, update).
    # Chapter 02's groups (parallel_sampling="fork", beam search) run the synchronous loop.
    async_scheduling: bool = True
    # kvlab-only: run the block pool's full consistency check after every step, so a broken
    # pool (a participant's exercise) is caught at the step that broke it. Costs O(blocks).
    debug_checks: bool = False
    # vLLM's name (vllm/config/model.py: hf_overrides): keys laid over the model's transformers
    # config. kvlab reads two, as vLLM's Llama does (vllm/model_executor/models/llama.py):
    # `layer_types` ("full_attention" or "sliding_attention", one per layer) and
    # `sliding_window` (tokens a sliding-window layer attends to). Chapter 09 runs the packaged
    # model with a window on some layers this way.
    hf_overrides: dict | None = None
    # vLLM 0.33.0's name and default (vllm/config/cache.py): which blocks of a sliding-window
    # group are keyed for the prefix cache. 0: only the windows a later request can resume
    # from; None: every full block (kvlab/kv_cache_coordinator.py).
    prefix_cache_retention_interval: int | None = 0
    # Chapter 10, vLLM 0.33.0's names (vllm/config/cache.py, vllm/config/kv_transfer.py).
    # kv_offloading_size: a second KV tier of this many GiB behind the pool (None: none), run
    # by kv_offloading_backend "native" (vLLM's OffloadingConnector; "lmcache" is refused
    # here). kv_transfer_config: a connector named outright (a KVTransferConfig or a dict of
    # its fields, as `--kv-transfer-config` takes JSON), e.g. the ExampleConnector two
    # engines share for disaggregated prefill. kvlab/kv_transfer/ has both.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_transfer_config: object | None = None
    # Set by `resolve()` on the config it returns: the derived knobs are filled in, and
    # kv_cache_tokens may come from kv_cache_memory_bytes (a conflict only when both are given).
    _resolved: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise TypeError(f"model must be a str (hub id or folder) or None, got {self.model!r}")
        if self.model is not None and not self.model.strip():
            raise ValueError("model must not be empty; pass None for the packaged model")
        check_int("block_size", self.block_size, minimum=1)
        check_choice("kv_layout", self.kv_layout, KV_LAYOUTS)
        check_int("kv_cache_tokens", self.kv_cache_tokens, minimum=1, allow_none=True)
        get_kv_cache_dtype(self.kv_cache_dtype)  # a known name this torch can store
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1, allow_none=True)
        if (self.kv_cache_memory_bytes is not None and self.kv_cache_tokens is not None
                and not self._resolved):
            raise ValueError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} and kv_cache_tokens="
                f"{self.kv_cache_tokens} both size the KV pool: pass one of them")
        check_int("max_num_seqs", self.max_num_seqs, minimum=1, allow_none=True)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1, allow_none=True)
        check_int("max_model_len", self.max_model_len, minimum=2, allow_none=True)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_bool("scheduler_reserve_full_isl", self.scheduler_reserve_full_isl)
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, numbers.Real):
            raise TypeError(f"watermark must be a float, got {type(self.watermark).__name__} "
                            f"{self.watermark!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        check_bool("long_prefill_token_threshold_adaptive",
                   self.long_prefill_token_threshold_adaptive)
        # vLLM refuses the same (SchedulerConfig.verify_max_model_len); checked again on the
        # resolved config, whose max_model_len may come from the model.
        if (self.max_model_len is not None
                and self.long_prefill_token_threshold > self.max_model_len):
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} cannot be "
                f"greater than max_model_len={self.max_model_len}")
        check_bool("debug_checks", self.debug_checks)
        check_hf_overrides(self.hf_overrides)
        if self.prefix_cache_retention_interval not in (0, None):
            raise ValueError(
                f"prefix_cache_retention_interval={self.prefix_cache_retention_interval!r}: kvlab "
                "runs 0 (vLLM's default: keep only the windows a request can resume from) and "
                "None (key every full block)")
        if self.resolved_kv_transfer_config is not None and self.kv_layout != "paged":
            raise ValueError("a KV connector moves blocks: it needs kv_layout='paged'")
        if self.enable_prefix_caching is None:  # vLLM's default where a block can be shared
            self.enable_prefix_caching = self.kv_layout == "paged"
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("async_scheduling", self.async_scheduling)
        check_choice("scheduling", self.scheduling, SCHEDULING_POLICIES)
        check_choice("policy", self.policy, POLICIES)
        # A class, or a path that imports one. Whether it is the right kind of class is the
        # engine's check (LLMEngine, before the model loads): the base classes import this module.
        for name in ("scheduler_cls", "kv_cache_manager_cls"):
            if getattr(self, name) is not None:
                resolve_class(name, getattr(self, name), object)
        check_choice("device", self.device, DEVICES)
        check_choice("dtype", self.dtype, DTYPES)
        check_int("seed", self.seed, minimum=0)
        check_choice("backend", self.backend, BACKENDS)
        if self.enforce_eager is not None:
            check_bool("enforce_eager", self.enforce_eager)
        check_choice("parallel_sampling", self.parallel_sampling, PARALLEL_SAMPLING)
        check_choice("prefix_caching_hash_algo", self.prefix_caching_hash_algo, HASH_ALGOS)
        if self.enable_prefix_caching and self.kv_layout == "contiguous":
            raise ValueError(
                "enable_prefix_caching needs kv_layout='paged': a contiguous region cannot "
                "share blocks with other requests"
            )
        if self.kv_cache_tokens is not None and self.max_model_len is not None:
            self._check_one_request_fits()
        if (self.max_num_seqs is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            # vLLM's SchedulerConfig refuses the same pair, in these words.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                f"or equal to max_num_seqs ({self.max_num_seqs}).")

    @property
    def resolved_kv_transfer_config(self):
        """The connector this config runs (kvlab.kv_transfer.KVTransferConfig), or None: the
        offloading knobs turned into one as vLLM's VllmConfig does."""
        from kvlab.kv_transfer.kv_transfer_config import offloading_transfer_config

        return offloading_transfer_config(self.kv_offloading_size, self.kv_offloading_backend,
                                          self.kv_transfer_config)

    def resolve(self, model_max_len: int, default_kv_tokens: int,
                kv_bytes_per_token: int | None = None) -> EngineConfig:
        """A new config with the `None` knobs filled in once the model is known, checked as a
        whole; this one is left as it was (the caller's config can build another engine).

        Mirrors vLLM: without chunked prefill a whole prompt must fit one step, so the token
        budget must be at least max_model_len (vLLM refuses to start otherwise).
        `kv_bytes_per_token` (at kv_cache_dtype, scales included) turns kv_cache_memory_bytes
        into whole blocks, as vLLM does (`available_memory // bytes_per_block` in
        vllm/v1/core/kv_cache_planning.py).
        """
        kv_cache_tokens, max_model_len = self.kv_cache_tokens, self.max_model_len
        if self.kv_cache_memory_bytes is not None and kv_cache_tokens is None:
            kv_cache_tokens = self._tokens_in_memory_bytes(kv_bytes_per_token)
        if max_model_len is None:
            # A KV budget smaller than the model's context (given, or the automatic one): shrink
            # the context to fit. vLLM does this only when asked, with max_model_len=-1
            # (_auto_fit_max_model_len in vllm/v1/core/kv_cache_planning.py); left unset there,
            # a context one request could not fit in the KV cache stops start-up with an error
            # (check_enough_kv_cache_memory). kvlab fits it so that a small teaching pool needs
            # no second knob.
            max_model_len = min(model_max_len,
                                default_kv_tokens if kv_cache_tokens is None else kv_cache_tokens)
        elif max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context length "
                f"{model_max_len}"
            )
        if kv_cache_tokens is None:
            kv_cache_tokens = max(default_kv_tokens, max_model_len)
        max_num_seqs, budget = batch_limits(self.max_num_seqs, self.max_num_batched_tokens,
                                            self.enable_chunked_prefill, max_model_len)
        # replace() runs __post_init__ again: the filled-in config passes the same checks, one
        # request fitting the pool among them.
        resolved = dataclasses.replace(self, kv_cache_tokens=kv_cache_tokens,
                                       max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=budget, _resolved=True)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than "
                f"max_model_len={max_model_len}: with enable_chunked_prefill=False a whole "
                "prompt must fit in one step; raise the budget, lower max_model_len, or enable "
                "chunked prefill"
            )
        return resolved

    def _tokens_in_memory_bytes(self, kv_bytes_per_token: int | None) -> int:
        if kv_bytes_per_token is None:
            raise ValueError("kv_cache_memory_bytes needs the KV bytes per token to size the pool")
        block_bytes = kv_bytes_per_token * self.block_size
        # vLLM sizes its pool in whole pages and then reserves block 0 as the null block
        # (vllm/v1/core/block_pool.py): the tokens the budget holds leave that block out.
        num_blocks = self.kv_cache_memory_bytes // block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} is smaller than two KV "
                f"blocks (one usable, and block 0, the null block): block_size={self.block_size} tokens x {kv_bytes_per_token} bytes per "
                f"token at kv_cache_dtype={self.kv_cache_dtype!r} is {block_bytes} bytes; "
                "raise kv_cache_memory_bytes, or lower block_size or the KV precision")
        return (num_blocks - 1) * self.block_size

    def _check_one_request_fits(self) -> None:
        if self.kv_cache_tokens < self.max_model_len and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} holds "
                f"{self.kv_cache_tokens} tokens at kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"fewer than one request of max_model_len={self.max_model_len}: raise "
                "kv_cache_memory_bytes, lower max_model_len, or store K/V at a lower precision")
        if self.kv_cache_tokens < self.max_model_len:
            raise ValueError(
                f"kv_cache_tokens={self.kv_cache_tokens} cannot hold one request of "
                f"max_model_len={self.max_model_len}: raise kv_cache_tokens or lower max_model_len"
            )

    @property
    def num_blocks(self) -> int:
        """Blocks in the physical pool: the KV budget rounded up to whole blocks, plus block 0,
        vLLM's null block, which is never handed out (vllm/v1/core/block_pool.py). So
        kv_cache_tokens are the tokens requests can hold, and a pool of N blocks holds
        (N - 1) x block_size of them, as vLLM's --num-gpu-blocks-override N does."""
        return -(-self.kv_cache_tokens // self.block_size) + 1

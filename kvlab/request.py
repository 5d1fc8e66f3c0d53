"""One request as the engine tracks it: its tokens, how many have K/V computed, its state."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvlab.metrics import RequestMetrics
from kvlab.sampling import SamplingParams


@dataclass(eq=False)
class RequestGroup:
    """Requests that share seats: the n samples of one forked request (chapter 02), or the beams
    of one beam search. The group holds `num_seats` of max_num_seqs from the moment its first
    member runs, so the samples forked later, or the beams, always find their seat."""

    group_id: str
    num_seats: int


class RequestStatus(enum.Enum):
    """vLLM's states (vllm/v1/request.py), less those kvlab has no use for."""

    WAITING = "waiting"
    RUNNING = "running"
    # Its blocks were taken back to make room (chapter 03); it waits at the head of the queue
    # and recomputes its prompt and output so far when re-admitted.
    PREEMPTED = "preempted"
    # Admitted with blocks for K/V a KV connector is loading (chapter 10): it stays in the
    # waiting queue, skipped, until the worker reports the load done (vLLM's state).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED = "finished"


@dataclass(eq=False)  # requests compare by identity: two may hold the same tokens
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # the model's end-of-sequence ids (a model may have several)
    metrics: RequestMetrics
    generator: torch.Generator | None = None  # own random stream; None when greedy
    cache_salt: str | None = None
    parent_id: str | None = None  # the id the caller used; differs for the samples of n > 1
    index: int = 0  # which of the parent's n samples this is
    output_token_ids: list[int] = field(default_factory=list)
    # SamplingParams(logprobs=k): per generated token, {token id: logprob} of the top k and
    # the sampled token (vLLM's CompletionOutput.logprobs, as plain floats).
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams(prompt_logprobs=k): filled by the model runner chunk by chunk, starting
    # [None] (the first prompt token has no prediction); None when not asked for.
    prompt_logprobs: list | None = None
    # vLLM v1's one number of progress: tokens whose K/V are in the cache. The scheduler gives a
    # request `num_tokens - num_computed_tokens` new tokens: a whole prompt, a chunk, or the one
    # token sampled last step (a decode). Prefill and decode are the same thing at different sizes.
    num_computed_tokens: int = 0
    # Async scheduling (vllm/v1/core/sched/async_scheduler.py): tokens a step in flight will
    # sample, not yet seen. num_computed_tokens already counts them as computed when the next
    # step is scheduled, so the next decode's input is a token the model runner holds and the
    # request does not (yet). num_in_flight_tokens: scheduled, their step's result not yet read.
    # A request preempted with a step in flight marks that step's output stale: its token is
    # still appended, but it changes no counter (vLLM's num_stale_output_tokens).
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0
    # The stale output is discarded rather than delivered: set when the request may resume
    # before its steps in flight are read (reset_prefix_cache), as vLLM's drop_stale_output.
    drop_stale_output: bool = False
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    # Prefix caching (chapter 05): keys of this request's full blocks, and the prompt tokens
    # found in the cache at its first admission (vLLM's num_cached_tokens).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Hybrid models (chapter 09): where a prefix other requests share ends, when the full-
    # attention groups found it cached and a window group did not; its window's blocks are
    # then kept keyed (vLLM's shared_prefix_boundary, set at the prefix-cache lookup).
    shared_prefix_boundary: int = 0
    # n > 1: the other samples, forked from this one when its prompt is done (chapter 02).
    fork_children: list["Request"] = field(default_factory=list)
    group: RequestGroup | None = None  # seats shared with the other samples or beams
    # Beam search: the BeamSearchGroup that chooses this beam's next token (see beam_search.py);
    # None for ordinary requests, which sample their own.
    beam_group: object | None = None
    # vLLM's Request.priority (vllm/v1/request.py): under policy="priority" the waiting queue
    # serves the lowest value first and the highest is preempted first; "fcfs" ignores it.
    priority: int = 0
    # With prefix caching, the engine's block hasher (prefix_cache.get_request_block_hasher):
    # the prompt's full blocks are keyed when the request is created and each block filled by
    # an appended token when it is appended, as vLLM's Request does (vllm/v1/request.py).
    block_hasher: Callable[["Request"], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.block_hasher is not None:
            self.block_hasher(self)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.block_hasher is not None:
            self.block_hasher(self)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)

    def check_stop(self, max_model_len: int) -> str | None:
        """vLLM's finish reasons: "stop" for EOS or a stop token, "length" for a limit."""
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if not sp.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in sp.stop_token_ids:
            self.stop_reason = last
            return "stop"
        if len(self.output_token_ids) >= sp.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

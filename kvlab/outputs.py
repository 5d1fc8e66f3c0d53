"""What `generate` and `LLMEngine.step` return: vLLM's `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.metrics import RequestMetrics


@dataclass
class Logprob:
    """One token's log probability and its rank among the vocabulary (1 = the most likely), as
    vLLM's `Logprob` (vllm/logprobs.py) less the decoded text (the server adds that). Used for
    prompt logprobs; a generated token's logprobs are plain floats (CompletionOutput.logprobs)."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None (running)
    # What stopped it, as vLLM reports: the stop token id or stop string; None for EOS/length.
    stop_reason: int | str | None = None
    # With SamplingParams(logprobs=k): per token, {token id: logprob} (top k + the sampled one).
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With SamplingParams(prompt_logprobs=k): one entry per prompt token, None for the first
    # (nothing predicts it), else {token id: Logprob} with the prompt's own token first.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class ModelRunnerOutput:
    """What one forward produced (vLLM's class of the same name is in vllm/v1/outputs.py): a
    token for every request that reached the end of its sequence (forked samples included),
    and top logprobs where they were asked for."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # What the KV connector's worker side reported for the step (chapter 10); None without one.
    kv_connector_output: object | None = None

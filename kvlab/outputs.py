"""What `generate` and `LLMEngine.step` return: vLLM's `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.metrics import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", "abort" or None

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

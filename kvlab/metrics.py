"""Per-request timing: arrival, queue time, TTFT and inter-token latencies. Chapter 03 plots them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock stamps of one request (`time.perf_counter()` seconds). Chapter 03 plots them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one stamp per generated token
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class StepRecord:
    """One engine step, for Gantt charts and memory plots."""

    step: int
    request_ids: list[str]  # who ran in this step
    num_prefill_tokens: int  # prompt (or recomputed) tokens
    num_decode_tokens: int  # one per request that was generating
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_cached_tokens: int  # tokens whose K/V the pool holds after the step
    num_cow_copies: int  # blocks copied on write before this step's forward
    step_time: float  # seconds, schedule + forward + sample
    forward_time: float  # seconds in the model forward and logits; the rest is engine overhead

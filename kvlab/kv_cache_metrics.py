"""How long KV blocks live, sit idle and wait between hits: the residency behind eviction.

Chapter 05's eviction lesson, measured from the outside: `kvlab serve` exposes these as vLLM's
histograms `vllm:kv_block_lifetime_seconds`, `vllm:kv_block_idle_before_evict_seconds` and
`vllm:kv_block_reuse_gap_seconds` (`vllm/v1/metrics/loggers.py`). The bookkeeping follows
vLLM's `vllm/v1/core/kv_cache_metrics.py`, in our own words: a sampled fraction of blocks get a
birth time when they are handed out, a short ring of access times each time a prefix hit takes
them back (`BlockPool.touch`), and are reported when the pool hands them out again (their
content is overwritten: evicted) or the prefix cache is reset.

The pool calls it only when one is attached (`BlockPool.metrics_collector`), so the plain path
pays one `is not None` per block handed out.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

NUM_ACCESSES_KEPT = 4  # vLLM keeps the last 4 access times per block, too


@dataclass(frozen=True)
class BlockEviction:
    """One sampled block's life, reported when it was evicted (seconds)."""

    lifetime: float  # handed out -> evicted
    idle: float  # last allocation or hit -> evicted
    reuse_gaps: tuple[float, ...]  # between consecutive recorded accesses


class KVCacheMetricsCollector:
    """Per-block timestamps for a sampled `sample_rate` of blocks (vLLM's default 0.01; the
    workshop's pools are small, so kvlab serve samples every block by default). All state lives
    in the instance; its random draws come from its own generator."""

    def __init__(self, sample_rate: float = 1.0, seed: int = 0) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.rng = random.Random(seed)
        self.born: dict[int, float] = {}  # block id -> allocation time
        self.accesses: dict[int, deque] = {}  # block id -> last access times (allocation first)
        self.evictions: list[BlockEviction] = []

    def on_block_allocated(self, block_id: int) -> None:
        if self.sample_rate >= 1 or self.rng.random() < self.sample_rate:
            now = time.monotonic()
            self.born[block_id] = now
            self.accesses[block_id] = deque([now], maxlen=NUM_ACCESSES_KEPT)

    def on_block_accessed(self, block_id: int) -> None:
        ring = self.accesses.get(block_id)
        if ring is not None:
            ring.append(time.monotonic())

    def on_block_evicted(self, block_id: int) -> None:
        born = self.born.pop(block_id, None)
        if born is None:
            return
        ring = list(self.accesses.pop(block_id))
        now = time.monotonic()
        self.evictions.append(BlockEviction(
            now - born, now - ring[-1], tuple(b - a for a, b in zip(ring, ring[1:]))))

    def reset(self) -> None:
        """The prefix cache was reset: every block's history ends without an eviction."""
        self.born.clear()
        self.accesses.clear()

    def drain(self) -> list[BlockEviction]:
        events, self.evictions = self.evictions, []
        return events

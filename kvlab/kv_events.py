"""KV cache events: what the block pool tells the outside world about cached blocks.

vLLM's block pool records these (`vllm/distributed/kv_events.py`: `BlockStored`,
`BlockRemoved`, `AllBlocksCleared`) and publishes them over ZMQ, so that a router can send a
request to the replica that already holds its prefix. kvlab keeps the same three events in an
in-process list that a consumer drains with `take_events()` (the engine explorer, chapter 05):
no sockets. Besides vLLM's fields, each event names the physical blocks (`block_ids`), which is
what a picture of the pool needs; vLLM's events carry hashes only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVCacheEvent:
    """Base class of the three events."""


@dataclass(frozen=True)
class BlockStored(KVCacheEvent):
    """Full blocks were given prefix-cache keys: from now on a request can hit them."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the key of the block before the first one; None at 0
    token_ids: list[int]  # the tokens the blocks hold, in order
    block_size: int
    block_ids: list[int] = field(default_factory=list)  # kvlab's addition


@dataclass(frozen=True)
class BlockRemoved(KVCacheEvent):
    """Blocks lost their keys: reused for other tokens (eviction), or never written."""

    block_hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)  # kvlab's addition


@dataclass(frozen=True)
class AllBlocksCleared(KVCacheEvent):
    """`reset_prefix_cache()` dropped every key at once."""

"""What attention needs to know about one step, independent of which backend runs it.

Defined in notebook 01. The model runner builds `CommonAttentionMetadata` once per step (vLLM
has a class of the same name in `vllm/v1/attention/backends/utils.py`); the chosen backend turns
it into its own `AttentionMetadata` (see `attention.py` and `flex_attention.py`). This module
imports no backend, so the backends can import it without a circle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and in the KV pool (vLLM's names)."""

    slot_mapping: torch.Tensor  # (T,) pool slot of each new token: block_id * block_size + offset
    query_start_loc: list[int]  # (B + 1,) sequence i's new tokens are [start[i], start[i + 1])
    seq_lens: list[int]  # (B,) tokens in each sequence's context after this step
    block_table_ids: list[list[int]]  # B lists: logical block -> physical block, context only
    block_size: int
    num_blocks: int  # blocks in the pool
    device: torch.device
    layer_kv_bytes_per_token: int | None = None  # one layer's K and V of one token (None: unknown)
    dtype: torch.dtype = torch.float32  # the KV pool's (and the queries') dtype
    # The layers' window (chapter 09): a token at position p reads positions
    # p - sliding_window + 1 .. p; None: every earlier position (full attention).
    sliding_window: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.num_tokens == self.num_seqs


@dataclass
class AttentionMetadata:
    """The part every backend keeps: where to write this step's K/V. Backends subclass it."""

    slot_mapping: torch.Tensor  # (T,)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the host, on `device`, without making the host wait.

    A copy from ordinary (pageable) memory to a GPU blocks the host until the driver has staged
    it; from pinned memory it is queued like a kernel (`non_blocking`), and torch's caching host
    allocator keeps the pinned block until the copy has run. On a CPU: the tensor itself.
    Every host-to-device copy of a step goes through here (tests/engine/test_gpu_paths.py counts them).
    """
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)

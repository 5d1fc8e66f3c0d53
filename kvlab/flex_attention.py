"""The GPU attention path (`backend="flex"`): FlexAttention over the KV pool, in place.

The reference path gathers each sequence's blocks into a contiguous copy before attending. Here
nothing is copied: the pool of one layer is viewed as one long row of slots, every new token of
the step is one query row, and a mask says which slot each query may see. The mask is the block
tables, rewritten: query j of sequence i sees slot s when s's block is in i's table and the
position it holds there is at or before j's own.

FlexAttention wants the mask in two forms: `mask_mod`, a function of (query, slot) evaluated
inside the kernel, and a sparse list of which (128-query tile, 128-slot tile) pairs hold any
visible slot at all, so the kernel skips the rest of the pool. Both are built here once per step
from the block tables (the mask is never evaluated over the pool to build them) and shared by
every layer. On a GPU the kernel is compiled; on a CPU it runs eagerly, evaluating the
mask on every (query, slot) pair: slow, and only meant as the check that the tests run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvlab.attention_metadata import AttentionMetadata, CommonAttentionMetadata

TILE = 128  # FlexAttention's sparse block size, in queries and in slots


def flex_block_mask(block_tables: list[list[int]], query_start_loc: list[int],
                    seq_lens: list[int], num_blocks: int, block_size: int,
                    device: torch.device):
    """The step's mask as a FlexAttention BlockMask over (new tokens) x (every slot of the pool)."""
    from torch.nn.attention.flex_attention import BlockMask

    num_new = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
    num_seqs, total, num_slots = len(num_new), query_start_loc[-1], num_blocks * block_size
    # Each query's sequence and position.
    cpu = torch.device("cpu")  # built on the host (explicit: never the default device)
    q_seq = torch.repeat_interleave(torch.arange(num_seqs, device=cpu),
                                    torch.tensor(num_new, device=cpu))
    q_pos = torch.cat([torch.arange(n - k, n, device=cpu) for n, k in zip(seq_lens, num_new)])
    # Each block sits at one logical index, whichever tables hold it: a block shared through the
    # prefix cache or a fork holds the same positions in every sequence that shares it. So one
    # (num_blocks,) map and the padded tables answer "is slot s in sequence i, and where".
    ids = [torch.tensor(table, dtype=torch.long, device=cpu) for table in block_tables]
    tables = torch.full((num_seqs, max(len(t) for t in ids)), -1, dtype=torch.long, device=cpu)
    block_logical = torch.full((num_blocks,), -1, dtype=torch.long, device=cpu)
    for i, t in enumerate(ids):
        tables[i, : len(t)] = t
        block_logical[t] = torch.arange(len(t), device=cpu)
    if any(not torch.equal(block_logical[t], torch.arange(len(t), device=cpu)) for t in ids):
        raise RuntimeError("a KV block sits at two logical positions; the flex mask needs one")

    kv_num_blocks, kv_indices = _sparse_tiles(ids, query_start_loc, block_size, num_slots)
    q_seq, q_pos, tables, block_logical = (t.to(device) for t in (q_seq, q_pos, tables,
                                                                  block_logical))

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        logical = block_logical[block]
        in_table = tables[q_seq[q_idx], logical.clamp(min=0)] == block
        position = logical * block_size + kv_idx % block_size
        return (logical >= 0) & in_table & (position <= q_pos[q_idx])

    return BlockMask.from_kv_blocks(kv_num_blocks.to(device), kv_indices.to(device),
                                    BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(total, num_slots))


def _sparse_tiles(block_tables: list[torch.Tensor], query_start_loc: list[int], block_size: int,
                  num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each 128-query tile, the 128-slot tiles that hold a block of any of its sequences:
    kv_num_blocks (1, 1, q_tiles) and kv_indices (1, 1, q_tiles, slot_tiles), as FlexAttention
    stores a BlockMask. Every listed tile is partial (mask_mod decides inside it)."""
    cpu = torch.device("cpu")
    total = query_start_loc[-1]
    q_tiles, kv_tiles = -(-total // TILE), -(-num_slots // TILE)
    seq_tiles = []
    for table in block_tables:
        first = table * block_size
        lo, hi = first // TILE, (first + block_size - 1) // TILE  # a block may span tiles
        span = torch.arange(block_size // TILE + 2, device=cpu)
        tiles = lo[:, None] + span[None, :]
        seq_tiles.append(torch.unique(tiles[tiles <= hi[:, None]]))
    kv_num_blocks = torch.zeros((1, 1, q_tiles), dtype=torch.int32, device=cpu)
    kv_indices = torch.zeros((1, 1, q_tiles, kv_tiles), dtype=torch.int32, device=cpu)
    starts = torch.tensor(query_start_loc, device=cpu)
    for j in range(q_tiles):
        # Sequences with a query in [j * TILE, (j + 1) * TILE).
        seqs = ((starts[:-1] < (j + 1) * TILE) & (starts[1:] > j * TILE)).nonzero().flatten()
        tiles = torch.unique(torch.cat([seq_tiles[i] for i in seqs.tolist()]))
        kv_num_blocks[0, 0, j] = len(tiles)
        kv_indices[0, 0, j, : len(tiles)] = tiles
    return kv_num_blocks, kv_indices


@functools.cache
def _flex_kernel(device_type: str):
    """Compiled for a GPU (its fused kernel); eager on a CPU (a correctness check only)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention


@dataclass
class FlexMetadata(AttentionMetadata):
    block_mask: object  # FlexAttention's BlockMask over (new tokens) x (every slot of the pool)


class FlexBackend:
    """`backend="flex"`: one FlexAttention call per layer over the whole pool."""

    name = "flex"

    def build(self, common: CommonAttentionMetadata) -> FlexMetadata:
        mask = flex_block_mask(common.block_table_ids, common.query_start_loc, common.seq_lens,
                               common.num_blocks, common.block_size, common.device)
        return FlexMetadata(slot_mapping=common.slot_mapping, block_mask=mask)

    def forward(self, q, kv_layer, meta: FlexMetadata, scale: float) -> torch.Tensor:
        return paged_attention_flex(q, kv_layer, meta, scale)


def paged_attention_flex(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: FlexMetadata, scale: float
) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D), every sequence of the step in one call over the pool."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    # The pool as one long sequence of slots: (1, Hkv, num_blocks * block_size, D), a view.
    k = kv_layer[0].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = kv_layer[1].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    o = _flex_kernel(q.device.type)(q.transpose(0, 1)[None], k, v, block_mask=meta.block_mask,
                       scale=scale, enable_gqa=True)  # (1, Hq, T, D)
    return o[0].transpose(0, 1)

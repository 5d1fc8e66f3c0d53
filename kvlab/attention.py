"""Attention over a paged KV cache: write new K/V through the slot mapping, read past K/V
through the block table.

Defined in notebook 01. `paged_attention_reference` is the version to read: one sequence at a
time, gather its blocks, attend. `paged_attention_decode` is the same arithmetic for a batch of
single-token decodes in one call (block tables padded, padding masked out); it is what makes
batch-16 decoding cheap, and tests prove it gives the same tokens.

`backend="flex"` sends every step through `flex_attention.paged_attention_flex` instead (the GPU
path): PyTorch's FlexAttention reads the pool in place, the block tables turned into a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.flex_attention import paged_attention_flex


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flat batch and in the KV pool (vLLM's names)."""

    slot_mapping: torch.Tensor  # (T,) pool slot of each new token: block_id * block_size + offset
    query_start_loc: list[int]  # (B + 1,) sequence i's new tokens are [start[i], start[i + 1])
    seq_lens: list[int]  # (B,) tokens in each sequence's context after this step
    block_tables: list[torch.Tensor]  # B tensors of block ids, logical block -> physical block
    # Fast path, only set when every sequence has exactly one new token (a pure decode step):
    decode_block_table: torch.Tensor | None = None  # (B, max_blocks), padded with block 0
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, max_blocks * block_size), True = attend
    use_reference: bool = False  # force the one-sequence-at-a-time path
    flex_block_mask: object | None = None  # FlexAttention's BlockMask, when backend="flex"


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """Store this step's keys and values into their slots of the pool.

    kv_layer: (2, num_blocks, block_size, Hkv, D); k, v: (T, Hkv, D). Viewing the pool as one
    long row of slots makes a slot number an ordinary index.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_layer[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    kv_layer[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def gather_kv(kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """One sequence's past keys and values, in order, read through its block table.

    Returns k, v: (Hkv, seq_len, D). The blocks may lie anywhere in the pool; indexing with the
    block table puts them back in logical order.
    """
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    k = kv_layer[0][block_table].view(-1, num_kv_heads, head_dim)[:seq_len]  # (L, Hkv, D)
    v = kv_layer[1][block_table].view(-1, num_kv_heads, head_dim)[:seq_len]
    return k.transpose(0, 1), v.transpose(0, 1)


def paged_attention_reference(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D), one sequence at a time."""
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        num_new = end - start
        k, v = gather_kv(kv_layer, meta.block_tables[i], seq_len)  # (Hkv, L, D)
        qi = q[start:end].transpose(0, 1)  # (Hq, num_new, D)
        # A leading batch dimension of 1: without it SDPA on CPU takes a slow path (5x here).
        qi, k, v = qi[None], k[None], v[None]
        if num_new == 1:
            # A decode token is the newest position: it may see the whole context, no mask.
            o = F.scaled_dot_product_attention(qi, k, v, scale=scale, enable_gqa=True)
        elif num_new == seq_len:
            # A whole prompt at once: plain causal attention.
            o = F.scaled_dot_product_attention(qi, k, v, scale=scale, is_causal=True,
                                               enable_gqa=True)
        else:
            # New tokens after a cached or already-computed part (a prefill chunk): new token j
            # sits at position seq_len - num_new + j and sees keys up to and including itself.
            q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def paged_attention_decode(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Every sequence decodes one token: q (B, Hq, D) -> (B, Hq, D) in one kernel call."""
    B, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    bt = meta.decode_block_table  # (B, max_blocks)
    k = kv_layer[0][bt].view(B, -1, num_kv_heads, head_dim).transpose(1, 2)  # (B, Hkv, L, D)
    v = kv_layer[1][bt].view(B, -1, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
    )  # (B, Hq, 1, D)
    return o[:, :, 0, :]


def paged_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    if meta.flex_block_mask is not None:
        return paged_attention_flex(q, kv_layer, meta, scale)
    if meta.decode_block_table is not None and not meta.use_reference:
        return paged_attention_decode(q, kv_layer, meta, scale)
    return paged_attention_reference(q, kv_layer, meta, scale)

"""Attention over a paged KV cache: write new K/V through the slot mapping, read past K/V
through the block table.

Defined in notebook 01. `paged_attention_reference` is the version to read: one sequence at a
time, gather its blocks, attend. `paged_attention_decode` is the same arithmetic for a batch of
single-token decodes in one call (block tables padded, padding masked out); it is what makes
batch-16 decoding cheap, and tests prove it gives the same tokens.

Each backend owns a metadata builder and a forward, and the engine picks one at start, as vLLM
picks an attention backend (`vllm/v1/attention/backends/`): "reference" (the version to read),
"auto" (SDPA, batched decode) and "flex" (`flex_attention.py`: PyTorch's FlexAttention reads the
pool in place, the block tables turned into a mask; the GPU path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.attention_metadata import AttentionMetadata, CommonAttentionMetadata


@dataclass
class SDPAMetadata(AttentionMetadata):
    """What the reference and SDPA backends read (vLLM's names)."""

    query_start_loc: list[int]  # (B + 1,) sequence i's new tokens are [start[i], start[i + 1])
    seq_lens: list[int]  # (B,) tokens in each sequence's context after this step
    block_tables: list[torch.Tensor]  # B tensors of block ids, logical block -> physical block
    # SDPA backend, only set when every sequence has exactly one new token (a pure decode step):
    decode_block_table: torch.Tensor | None = None  # (B, max_blocks), padded with block 0
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, max_blocks * block_size), True = attend


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
    q: torch.Tensor, kv_layer: torch.Tensor, meta: SDPAMetadata, scale: float
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
    q: torch.Tensor, kv_layer: torch.Tensor, meta: SDPAMetadata, scale: float
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


class ReferenceBackend:
    """One sequence at a time: the version to read (`backend="reference"`)."""

    name = "reference"

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        # Every table in one host-to-device copy, then split into views (one per sequence).
        tables = common.block_table_ids
        flat = torch.tensor([b for t in tables for b in t], dtype=torch.long, device="cpu")
        flat = flat.to(common.device)
        return SDPAMetadata(
            slot_mapping=common.slot_mapping,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_tables=list(flat.split([len(t) for t in tables])),
        )

    def forward(self, q, kv_layer, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        return paged_attention_reference(q, kv_layer, meta, scale)


class SDPABackend(ReferenceBackend):
    """The default (`backend="auto"`): a pure decode step attends for every sequence in one
    SDPA call over padded block tables; any step with a prefill goes one sequence at a time."""

    name = "auto"

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        if not (common.num_seqs > 1 and common.is_pure_decode):
            return super().build(common)
        # The batched decode path reads only the padded table: no per-sequence tables. Pad the
        # block tables to one rectangle (with block 0, which is masked out) so all sequences
        # attend in one call. Built on the host, moved once.
        meta = SDPAMetadata(slot_mapping=common.slot_mapping,
                            query_start_loc=common.query_start_loc,
                            seq_lens=common.seq_lens, block_tables=[])
        bs, tables = common.block_size, common.block_table_ids
        max_blocks = max(len(b) for b in tables)
        table = torch.zeros((common.num_seqs, max_blocks), dtype=torch.long, device="cpu")
        for i, b in enumerate(tables):
            table[i, : len(b)] = torch.tensor(b, dtype=torch.long, device="cpu")
        key_pos = torch.arange(max_blocks * bs, device="cpu")
        lens = torch.tensor(common.seq_lens, device="cpu")
        mask = key_pos[None, :] < lens[:, None]  # (B, L)
        meta.decode_block_table = table.to(common.device)
        meta.decode_mask = mask[:, None, None, :].to(common.device)  # (B, 1, 1, L)
        return meta

    def forward(self, q, kv_layer, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        if meta.decode_block_table is not None:
            return paged_attention_decode(q, kv_layer, meta, scale)
        return paged_attention_reference(q, kv_layer, meta, scale)


def get_attention_backend(name: str):
    """The backend for EngineConfig.backend, chosen once when the engine starts."""
    if name == "reference":
        return ReferenceBackend()
    if name == "auto":
        return SDPABackend()
    if name == "flex":
        from kvlab.flex_attention import FlexBackend  # imports FlexAttention only when asked

        return FlexBackend()
    raise ValueError(f"unknown attention backend {name!r}")

"""Attention over a paged KV cache: write new K/V through the slot mapping, read past K/V
through the block table.

Defined in notebook 01. `paged_attention_reference` is the version to read: one sequence at a
time, gather its blocks, attend. `paged_attention_decode` is the same arithmetic for every
single-token decode of a step at once (`python -m kvlab.bench roofline` measures it): the block tables padded to one
rectangle, the padding masked out, one copy of the blocks per group of sequences into a buffer
that stays in the CPU's cache, then one SDPA call per group. Tests prove both give the same
tokens.

Each backend owns a metadata builder and a forward, and the engine picks one at start, as vLLM
picks an attention backend (`vllm/v1/attention/backends/`): "reference" (the version to read),
"auto" (SDPA, batched decode) and "flex" (`flex_attention.py`: PyTorch's FlexAttention reads the
pool in place, the block tables turned into a mask; the GPU path). vLLM's own CPU backend
(`vllm/v1/attention/backends/cpu_attn.py`) calls a C++ kernel that reads the pool through the
block table with no copy at all; PyTorch's eager operators have no such kernel, hence the copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvlab.attention_metadata import AttentionMetadata, CommonAttentionMetadata, to_device
from kvlab.kv_quant import QuantizedKVLayer

# The batched decode path copies a group of sequences' blocks, then SDPA reads the copy. Groups
# of at most this many bytes (K and V, one layer) keep the copy in the CPU's cache (32 MiB of L3
# on the 2-core machine it was tuned on) until SDPA reads it: there, 64 sequences at context
# 256 (25 MB) in one group took 1.3x the time of groups of 21 (8 MB each); 2 and 4 MB groups
# were no faster than 8 (more, smaller calls).
DECODE_GROUP_BYTES = 8 * 2**20


@dataclass
class DecodeMetadata:
    """The batched decode path's view of a step: built once, read by every layer."""

    rows: slice | torch.Tensor  # which of the step's tokens (rows of q) are the decodes
    num_seqs: int  # B: the decoding sequences
    max_len: int  # L: max_blocks * block_size, the padded context every decode attends over
    # Groups of decodes, each (first, end, index): sequences [first, end) and the rows of the
    # layer's pool viewed as (2 * num_blocks, block_size * Hkv * D) that hold their K then V
    # blocks, in block-table order. Padding points at block 0, masked out below.
    groups: list[tuple[int, int, torch.Tensor]]
    mask: torch.Tensor  # (B, 1, 1, L) float: 0 up to each sequence's length, -inf past it


@dataclass
class SDPAMetadata(AttentionMetadata):
    """What the reference and SDPA backends read (vLLM's names)."""

    query_start_loc: list[int]  # (B + 1,) sequence i's new tokens are [start[i], start[i + 1])
    seq_lens: list[int]  # (B,) tokens in each sequence's context after this step
    # Block ids of the sequences attended one at a time, logical block -> physical block: every
    # sequence for the reference backend, the prefills (more than one new token) for SDPA.
    block_tables: list[torch.Tensor]
    per_seq: list[int] = field(default_factory=list)  # which sequence each table belongs to
    sliding_window: int | None = None  # the group's window (chapter 09); None: full attention
    decode: DecodeMetadata | None = None  # SDPA backend: the single-token sequences, batched


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """Store this step's keys and values into their slots of the pool.

    kv_layer: (2, num_blocks, block_size, Hkv, D); k, v: (T, Hkv, D). Viewing the pool as one
    long row of slots makes a slot number an ordinary index. A pool at a lower precision
    (kv_cache_dtype, kvlab/kv_quant.py) quantizes them on the way in, scales into the same slots.
    """
    if isinstance(kv_layer, QuantizedKVLayer):
        kv_layer.write(k, v, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_layer[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    kv_layer[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def gather_kv(kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """One sequence's past keys and values, in order, read through its block table.

    Returns k, v: (Hkv, seq_len, D). The blocks may lie anywhere in the pool; indexing with the
    block table puts them back in logical order (and, at a lower precision, dequantized).
    """
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    if isinstance(kv_layer, QuantizedKVLayer):
        k_blocks, v_blocks = kv_layer.gather(block_table)
    else:
        k_blocks, v_blocks = kv_layer[0][block_table], kv_layer[1][block_table]
    k = k_blocks.view(-1, num_kv_heads, head_dim)[:seq_len]  # (L, Hkv, D)
    v = v_blocks.view(-1, num_kv_heads, head_dim)[:seq_len]
    return k.transpose(0, 1), v.transpose(0, 1)


def attend_one(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor,
               seq_len: int, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One sequence's new tokens q: (num_new, Hq, D) -> (num_new, Hq, D), over its whole
    context (the new tokens' own K/V are already in the pool).

    Grouped-query attention without `enable_gqa`: on a GPU no fused SDPA kernel takes
    `enable_gqa` beside a mask (flash takes no mask, the memory-efficient kernel no GQA), and
    before compute capability 8.0 (no flash) none takes it at all, so SDPA would fall back to
    its math kernel for every prompt. A whole prompt repeats each KV head for its query heads
    (one copy of this sequence's K/V, then causal attention: flash or memory-efficient); a chunk
    folds the query heads that share a KV head into that head's rows, as the decode path does,
    with a float mask (memory-efficient or cuDNN).

    A sliding window (chapter 09) hides, from the token at position p, every key before
    p - sliding_window + 1: those blocks may already be the null block, and must not be read.
    """
    num_new, num_heads, head_dim = q.shape
    k, v = gather_kv(kv_layer, block_table, seq_len)  # (Hkv, L, D)
    group = num_heads // k.shape[0]
    windowed = sliding_window is not None and seq_len > sliding_window
    # A leading batch dimension of 1: without it SDPA on CPU takes a slow path (5x here).
    if num_new == 1 and not windowed:
        # A decode token is the newest position: it may see the whole context, no mask.
        qi = q.view(k.shape[0], group, head_dim)  # (Hkv, group, D): query head h reads h // group
        o = F.scaled_dot_product_attention(qi[None], k[None], v[None], scale=scale)
        return o[0].reshape(1, num_heads, head_dim)
    if num_new == seq_len and not windowed:
        # A whole prompt at once: plain causal attention, every query head its own K/V head.
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # (Hq, L, D)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                           scale=scale, is_causal=True)
        return o[0].transpose(0, 1)
    # New tokens after a cached or already-computed part (a prefill chunk): new token j sits at
    # position seq_len - num_new + j and sees keys up to and including itself. Rows are
    # (query head in its group, token): the mask repeats once per head of the group.
    q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
    keys = torch.arange(seq_len, device=q.device)[None, :]
    hidden = keys > q_pos[:, None]  # (num_new, L)
    if windowed:
        hidden |= keys <= q_pos[:, None] - sliding_window
    mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
        hidden, float("-inf")).repeat(group, 1)  # (group * num_new, L), in the queries' dtype
    qi = q.view(num_new, k.shape[0], group, head_dim).permute(1, 2, 0, 3)  # (Hkv, group, T, D)
    o = F.scaled_dot_product_attention(qi.reshape(1, k.shape[0], group * num_new, head_dim),
                                       k[None], v[None], attn_mask=mask, scale=scale)
    # (1, Hkv, group * T, D) -> (T, Hq, D)
    return o.view(k.shape[0], group, num_new, head_dim).permute(2, 0, 1, 3).reshape(
        num_new, num_heads, head_dim)


def paged_attention_reference(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: SDPAMetadata, scale: float
) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D), one sequence at a time."""
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[start:end] = attend_one(q[start:end], kv_layer, meta.block_tables[i], seq_len, scale,
                                    meta.sliding_window)
    return out


def paged_attention_decode(q: torch.Tensor, kv_layer: torch.Tensor, decode: DecodeMetadata,
                           scale: float, buffer: torch.Tensor) -> torch.Tensor:
    """Every decode of the step at once: q (B, Hq, D) -> (B, Hq, D).

    Per group of sequences: one `index_select` copies their blocks (K and V in the same call)
    into `buffer` in logical order, then one SDPA call attends. The query heads that share a
    KV head (grouped-query attention) go in as that head's query rows, so each K/V row is read
    once per KV head rather than once per query head. At a lower precision the copy is
    dequantized on the way into `buffer`.
    """
    B, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
    group_size, L = num_heads // num_kv_heads, decode.max_len
    quantized = isinstance(kv_layer, QuantizedKVLayer)
    # row r < num_blocks: K of block r; V after
    pool = None if quantized else kv_layer.view(2 * num_blocks, -1)
    q = q.view(B, num_kv_heads, group_size, head_dim)  # query head h reads KV head h // group
    out = None if len(decode.groups) == 1 else q.new_empty(q.shape)
    for first, end, index in decode.groups:
        n = end - first
        kv = buffer[: 2 * n * (L // block_size)]
        if quantized:
            kv_layer.read_rows(index, out=kv)
        else:
            torch.index_select(pool, 0, index, out=kv)
        kv = kv.view(2, n, L, num_kv_heads, head_dim).transpose(2, 3)  # (2, n, Hkv, L, D)
        o = F.scaled_dot_product_attention(q[first:end], kv[0], kv[1],
                                           attn_mask=decode.mask[first:end], scale=scale)
        if out is None:  # one group: its output is the whole answer
            return o.reshape(B, num_heads, head_dim)
        out[first:end] = o
    return out.view(B, num_heads, head_dim)


def device_block_tables(common: CommonAttentionMetadata, seqs: list[int]) -> list[torch.Tensor]:
    """The block tables of sequences `seqs` on the device: one host-to-device copy, split into
    views (one per sequence); no copy at all when there is none (a pure decode step)."""
    if not seqs:
        return []
    tables = common.block_table_ids
    flat = torch.tensor([b for i in seqs for b in tables[i]], dtype=torch.long, device="cpu")
    return list(to_device(flat, common.device).split([len(tables[i]) for i in seqs]))


class ReferenceBackend:
    """One sequence at a time: the version to read (`backend="reference"`)."""

    name = "reference"

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        every = list(range(common.num_seqs))
        return SDPAMetadata(
            slot_mapping=common.slot_mapping,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_tables=device_block_tables(common, every),
            per_seq=every,
            sliding_window=common.sliding_window,
        )

    def forward(self, q, kv_layer, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        return paged_attention_reference(q, kv_layer, meta, scale)


class SDPABackend(ReferenceBackend):
    """The default (`backend="auto"`): every sequence with one new token (a decode) attends in
    `paged_attention_decode`, all of them at once, whatever else the step holds; a sequence
    with more (a prompt or a prompt's chunk) attends on its own, as in the reference."""

    name = "auto"

    def __init__(self) -> None:
        # The copy buffer of the decode path, grown when a step needs more and reused by every
        # layer and step after: a fresh multi-megabyte tensor per layer would cost the page
        # faults of new memory each time. One per engine (each engine makes its backend).
        self.buffer: torch.Tensor | None = None

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        starts = common.query_start_loc
        decodes = [i for i in range(common.num_seqs) if starts[i + 1] - starts[i] == 1]
        prefills = [i for i in range(common.num_seqs) if starts[i + 1] - starts[i] != 1]
        meta = SDPAMetadata(slot_mapping=common.slot_mapping, query_start_loc=starts,
                            seq_lens=common.seq_lens, per_seq=prefills,
                            block_tables=device_block_tables(common, prefills),
                            sliding_window=common.sliding_window)
        if decodes:
            meta.decode = self.build_decode(common, decodes)
        return meta

    @staticmethod
    def build_decode(common: CommonAttentionMetadata, decodes: list[int]) -> DecodeMetadata:
        """The rectangle of block tables, the copy groups and the mask, on the host, moved once."""
        bs, tables, starts = common.block_size, common.block_table_ids, common.query_start_loc
        max_blocks = max(len(tables[i]) for i in decodes)
        # Padding with block 0: its slots are read and masked out (the pool starts zeroed, and a
        # finite value times a zero weight adds nothing).
        table = torch.tensor([tables[i] + [0] * (max_blocks - len(tables[i])) for i in decodes],
                             dtype=torch.long, device="cpu")  # (B, max_blocks)
        B, L = len(decodes), max_blocks * bs
        lens = torch.tensor([common.seq_lens[i] for i in decodes], device="cpu")
        # Sequences per copy group: as many as fit DECODE_GROUP_BYTES (all, if unknown).
        # A CPU cache size: on a GPU one group holds every sequence.
        per_seq = L * (common.layer_kv_bytes_per_token or 0) if common.device.type == "cpu" else 0
        group = max(1, min(B, DECODE_GROUP_BYTES // per_seq)) if per_seq else B
        bounds, indices = [], []
        for first in range(0, B, group):
            blocks = table[first : first + group].flatten()
            indices.append(torch.cat((blocks, blocks + common.num_blocks)))  # K rows, then V rows
            bounds.append((first, min(B, first + group)))
        parts = [*indices, lens]
        rows = None
        if decodes == list(range(B)):  # decodes first, as the scheduler puts them: a view
            rows = slice(0, B)
        else:
            parts.append(torch.tensor([starts[i] for i in decodes], dtype=torch.long,
                                      device="cpu"))
        # One host-to-device copy for the step's decode metadata.
        moved = to_device(torch.cat(parts), common.device).split([len(p) for p in parts])
        groups = [(first, end, index) for (first, end), index in zip(bounds, moved)]
        lens = moved[len(indices)]
        if rows is None:
            rows = moved[-1]
        # Additive, in the queries' dtype: SDPA's fused CUDA kernels refuse a float32 bias beside
        # bf16 queries. Made where it is read (no copy of a (B, L) tensor).
        positions = torch.arange(L, device=common.device)[None, :]
        past = positions >= lens[:, None]  # (B, L)
        if common.sliding_window is not None:  # and before the window (chapter 09)
            past |= positions < lens[:, None] - common.sliding_window
        mask = torch.zeros((B, L), dtype=common.dtype, device=common.device).masked_fill_(
            past, float("-inf"))
        return DecodeMetadata(rows=rows, num_seqs=B, max_len=L, groups=groups,
                              mask=mask[:, None, None, :])

    def forward(self, q, kv_layer, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        decode = meta.decode
        if decode is not None:
            buffer = self.scratch(decode, kv_layer)
            o = paged_attention_decode(q[decode.rows], kv_layer, decode, scale, buffer)
            if not meta.per_seq:  # a pure decode step: nothing else to attend
                return o
            out = torch.empty_like(q)
            out[decode.rows] = o
        else:
            out = torch.empty_like(q)
        for i, table in zip(meta.per_seq, meta.block_tables):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = attend_one(q[start:end], kv_layer, table, meta.seq_lens[i], scale,
                                        meta.sliding_window)
        return out

    def scratch(self, decode: DecodeMetadata, kv_layer: torch.Tensor) -> torch.Tensor:
        """The copy buffer, big enough for this step's largest group (grown, never shrunk)."""
        _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
        row = block_size * num_kv_heads * head_dim  # one block of K (or V)
        rows = 2 * max(end - first for first, end, _ in decode.groups) * decode.max_len
        rows //= kv_layer.shape[2]  # blocks, not slots
        if (self.buffer is None or self.buffer.shape[0] < rows or self.buffer.shape[1] != row
                or self.buffer.dtype != kv_layer.dtype or self.buffer.device != kv_layer.device):
            # In the dtype attention reads (a quantized pool's compute dtype).
            self.buffer = torch.empty((rows, row), dtype=kv_layer.dtype, device=kv_layer.device)
        return self.buffer


def get_attention_backend(name: str, enforce_eager: bool | None = None):
    """The backend for EngineConfig.backend, chosen once when the engine starts (enforce_eager:
    whether flex may compile, see EngineConfig)."""
    if name == "reference":
        return ReferenceBackend()
    if name == "auto":
        return SDPABackend()
    if name == "flex":
        from kvlab.flex_attention import FlexBackend  # imports FlexAttention only when asked

        return FlexBackend(enforce_eager)
    raise ValueError(f"unknown attention backend {name!r}")

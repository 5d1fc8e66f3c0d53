"""The GPU attention path (`backend="flex"`): FlexAttention over the KV pool, in place.

Defined for notebook 07 (the capstone's "on a GPU" section). The reference path gathers each
sequence's blocks into a contiguous copy before attending. Here nothing is copied: the pool of
one layer is viewed as one long row of slots, every new token of the step is one query row, and
a mask says which slot each query may see. The mask is the block tables, rewritten: query j of
sequence i sees slot s when s's block is in i's table and the position it holds there is at or
before j's own.

FlexAttention wants the mask in two forms: `mask_mod`, a function of (query, slot) evaluated
inside the kernel, and a sparse list of which (16-query tile, one-block slot tile) pairs hold
any visible slot at all, so the kernel skips the rest of the pool. Both read tensors that
`FlexMaskBuilder` allocates once and refills every step from the block tables (the mask is never
evaluated over the pool to build them); every layer of the step shares them.

Compiled or eager (`enforce_eager`, vLLM's knob, `vllm/config/model.py`). Compiled,
`torch.compile` generates the kernel for the shapes it sees: Triton on a GPU, inductor's C++
template on a CPU. A compiled kernel pays only if it is compiled a few times, not every step, so
everything it reads keeps its shape from step to step: the query rows are padded to a power of
two (at least 16); the mask's tensors are buffers sized once by the pool (grown in the rare step
that needs more) and held static; `mask_mod` and each padded length's BlockMask are made once.
The first step compiles one graph; the first step with another padded length compiles a second
with the rows symbolic (dynamo's automatic dynamic shapes); after that no step of that engine
compiles, and another engine compiles one more graph only if its pool differs
(`python -m kvlab.bench compiled-flex` counts them; tests/bench/test_compiled_flex.py holds the count).
Eager, FlexAttention evaluates `mask_mod` on every (query, slot) pair: slow, a correctness check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvlab.attention_metadata import AttentionMetadata, CommonAttentionMetadata, to_device
from kvlab.kv_quant import QuantizedKVLayer

# FlexAttention's sparse block sizes: the mask's tile list says, per tile of Q_TILE query rows,
# which tiles of slots hold anything those rows may see. vLLM's flex backend
# (vllm/v1/attention/backends/flex_attention.py, _get_block_sizes) uses 16 queries and one KV
# block of slots. Timed here on the CPU kernel alone (block_size 16), 16 x 16 beat 128 x 128
# several times over on a batch of decodes and more on a step mixing decodes with a prefill
# chunk: a small tile lists little beyond what its own rows see.
Q_TILE = 16
MIN_ROWS = 16  # the smallest padded query length (compiled): a lone decode token is 16 rows


def slot_tile(block_size: int) -> int:
    """Slots per tile: one KV block when that is a power of two in [16, 128], else the power of
    two nearest below, kept in that range (the GPU kernel tiles in powers of two; a block may
    span tiles or share one, the tile list allows both)."""
    return min(128, max(16, 1 << (block_size.bit_length() - 1)))


def padded_rows(num_tokens: int) -> int:
    """The power of two at or above max(num_tokens, MIN_ROWS): the step's query rows, compiled.

    Powers of two keep the lengths the kernel sees to a handful, and the floor of 16 keeps a
    single-token step off a size-1 query, which dynamo would specialise (a graph of its own;
    inductor's CPU decoding template for it fails to compile in torch 2.13).
    """
    return 1 << (max(num_tokens, MIN_ROWS) - 1).bit_length()


def keep_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these shapes never become symbolic: a change compiles a graph of their own.

    Only the query rows may turn symbolic (dynamo's automatic dynamic shapes, after the first
    step with another padded length). These shapes change only with the pool (another engine)
    or when a buffer grows, and a graph with them symbolic fails to compile on the CPU in
    torch 2.13 (inductor's C++ FlexAttention template: found by benchmarks/gpu_check.py's CPU
    dry run, whose engines have pools of different sizes)."""
    for t in tensors:
        for dim in range(t.dim()):
            torch._dynamo.mark_static(t, dim)


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1 for every i, concatenated."""
    offsets = torch.cumsum(counts, 0) - counts
    return (torch.repeat_interleave(starts - offsets, counts)
            + torch.arange(int(counts.sum()), device=starts.device))


class FlexMaskBuilder:
    """The tensors the mask reads, allocated once and refilled each step, and the BlockMask
    over them: one per padded query length, made the first time that length is seen.

    Per query row r: `q_pos[r]` (its position; -1 for a padding row, which sees nothing) and
    `q_table[r]` (where its sequence's block table starts in `tables`, all the step's tables
    end to end). Per pool block b: `block_logical[b]`, its index in the tables that hold it
    (blocks shared through the prefix cache or a fork sit at the same index in each). Then row
    r sees slot s of block b at offset o when
        block_logical[b] * block_size + o <= q_pos[r]
        and tables[q_table[r] + block_logical[b]] == b.
    The first test also keeps the second inside r's own table: a position at or before q_pos[r]
    is inside the sequence, so its logical index is below the table's length. `block_logical`
    is never cleared: a block left over from an earlier step fails the table test.

    Buffers start large enough for the default token budget (2,048 rows) and grow to the next
    power of two in the rare step that needs more: the only steps where the shapes the kernel
    sees change.
    """

    def __init__(self, num_blocks: int, block_size: int, device: torch.device, pad: bool,
                 q_tile: int = Q_TILE, kv_tile: int | None = None) -> None:
        self.num_blocks, self.block_size, self.device, self.pad = (num_blocks, block_size,
                                                                   device, pad)
        self.q_tile, self.kv_tile = q_tile, kv_tile or slot_tile(block_size)
        self.num_slots = num_blocks * block_size
        self.kv_tiles = -(-self.num_slots // self.kv_tile)
        self.block_logical = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self.step_blocks: torch.Tensor | None = None  # the last step's tables, end to end
        self._allocate(rows=2048, table_entries=padded_rows(2 * num_blocks))
        keep_static(self.block_logical)

    def _allocate(self, rows: int, table_entries: int) -> None:
        """(Re)make the row and table buffers, the tile list and `mask_mod`."""
        dev = self.device
        self.rows, self.table_entries = rows, table_entries
        self.q_pos = torch.full((rows,), -1, dtype=torch.long, device=dev)
        self.q_table = torch.zeros((rows,), dtype=torch.long, device=dev)
        self.tables = torch.full((table_entries,), -1, dtype=torch.long, device=dev)
        # One row per query tile, one column per slot tile of the pool (the CPU kernel checks
        # the list covers the pool), plus one that is never written (stays 0): a GPU kernel may
        # read the entry after a row's last, and vLLM's flex backend
        # (vllm/v1/attention/backends/flex_attention.py) keeps such a sentinel column for it.
        q_tiles = -(-rows // self.q_tile)
        self.kv_num_blocks = torch.zeros((1, 1, q_tiles), dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros((1, 1, q_tiles, self.kv_tiles + 1), dtype=torch.int32,
                                      device=dev)
        keep_static(self.q_pos, self.q_table, self.tables, self.kv_num_blocks, self.kv_indices)
        self.mask_mod = self._make_mask_mod()
        self._block_masks: dict[int, object] = {}

    def _make_mask_mod(self):
        block_size, block_logical = self.block_size, self.block_logical
        q_pos, q_table, tables = self.q_pos, self.q_table, self.tables
        last = self.table_entries - 1

        def mask_mod(b, h, q_idx, kv_idx):
            block = kv_idx // block_size
            logical = block_logical[block]
            position = logical * block_size + kv_idx % block_size
            in_table = tables[(q_table[q_idx] + logical).clamp(0, last)] == block
            return (logical >= 0) & (position <= q_pos[q_idx]) & in_table

        return mask_mod

    def build(self, block_tables: list[list[int]], query_start_loc: list[int],
              seq_lens: list[int]):
        """Refill the buffers for one step; return its BlockMask over (rows) x (every slot)."""
        cpu = torch.device("cpu")  # built on the host (explicit: never the default device)
        num_tokens, num_seqs = query_start_loc[-1], len(seq_lens)
        rows = padded_rows(num_tokens) if self.pad else num_tokens
        starts = torch.tensor(query_start_loc, device=cpu)
        lens_t = torch.tensor([len(t) for t in block_tables], device=cpu)
        seq_lens_t = torch.tensor(seq_lens, device=cpu)
        flat = torch.tensor([b for t in block_tables for b in t], dtype=torch.long, device=cpu)
        logical = _ranges(torch.zeros(num_seqs, dtype=torch.long, device=cpu), lens_t)
        kv_num_blocks, kv_indices = _sparse_tiles(
            flat, lens_t, logical, starts, seq_lens_t, self.block_size, self.q_tile,
            self.kv_tile, -(-rows // self.q_tile), self.kv_tiles)
        if rows > self.rows or len(flat) > self.table_entries:
            # More than any step before: grow what is short (the only shape changes).
            self._allocate(max(self.rows, rows), max(self.table_entries, padded_rows(len(flat))))

        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=cpu),
                                             starts[1:] - starts[:-1])
        # Row r of sequence i holds position seq_len[i] - (end[i] - r).
        q_pos = (seq_lens_t - starts[1:])[seq_of_row] + torch.arange(num_tokens, device=cpu)
        table_starts = torch.cumsum(lens_t, 0) - lens_t
        # Checked on the host, where the tables are: on a GPU a check of the device's copy
        # would make the host wait for it every step.
        if len(torch.unique(flat * (int(lens_t.max()) + 1) + logical)) != len(torch.unique(flat)):
            raise RuntimeError("a KV block sits at two logical positions; the flex mask needs one")
        # Everything the step's mask reads, in one host-to-device copy, then placed into the
        # buffers on the device (copies there do not make the host wait).
        q_tiles, width = kv_indices.shape
        parts = (q_pos, table_starts[seq_of_row], flat, logical, kv_num_blocks.long(),
                 kv_indices.long().flatten())
        (q_pos, q_table, flat, logical, kv_num_blocks, kv_indices) = to_device(
            torch.cat(parts), self.device).split([len(p) for p in parts])
        # Padding rows keep q_pos = -1 (they see nothing); rows past `rows` are never read.
        self.q_pos[num_tokens:rows].fill_(-1)
        self.q_pos[:num_tokens].copy_(q_pos)
        self.q_table[:num_tokens].copy_(q_table)
        self.tables[: len(flat)].copy_(flat)
        self.step_blocks = flat  # every block the step reads (a quantized pool dequantizes them)
        self.block_logical[flat] = logical
        self.kv_num_blocks[0, 0, :q_tiles].copy_(kv_num_blocks)
        self.kv_indices[0, 0, :q_tiles, :width].copy_(kv_indices.view(q_tiles, width))
        return self._block_mask(rows)

    def _block_mask(self, rows: int):
        """The BlockMask for `rows` query rows: made once per length, it only wraps the buffers.

        The tile list keeps its full capacity (rows past the step's are never read), so its
        shape does not change with the step; `compute_q_blocks=False` leaves out the
        transposed (query tiles per slot tile) lists, which only the backward pass reads."""
        from torch.nn.attention.flex_attention import BlockMask

        mask = self._block_masks.get(rows)
        if mask is None:
            mask = BlockMask.from_kv_blocks(self.kv_num_blocks, self.kv_indices,
                                            BLOCK_SIZE=(self.q_tile, self.kv_tile),
                                            mask_mod=self.mask_mod,
                                            seq_lengths=(rows, self.num_slots),
                                            compute_q_blocks=False)
            if self.pad:  # a handful of padded lengths; unpadded (eager), one per step
                self._block_masks[rows] = mask
        return mask


def _sparse_tiles(flat: torch.Tensor, lens: torch.Tensor, logical: torch.Tensor,
                  starts: torch.Tensor, seq_lens: torch.Tensor, block_size: int, q_tile: int,
                  kv_tile: int, q_tiles: int, kv_tiles: int):
    """For each query tile, the slot tiles holding a block that some row of the tile may see,
    in ascending order: kv_num_blocks (q_tiles,) and kv_indices (q_tiles, widest row). Every
    listed tile is partial (mask_mod decides inside it). Built from the (sequence, block) pairs
    alone, so the cost follows the tables, not the pool."""
    cpu = flat.device
    first = flat * block_size
    lo, hi = first // kv_tile, (first + block_size - 1) // kv_tile  # a block may span tiles
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cpu), lens)
    # Every (sequence, block, slot tile), then with every query tile the sequence's rows
    # [start[i], start[i + 1]) fall in.
    span = hi - lo + 1
    pair_kv = _ranges(lo, span)
    pair_seq, pair_first = (torch.repeat_interleave(x, span) for x in (seq, logical * block_size))
    q_lo = (starts[:-1] // q_tile)[pair_seq]
    q_span = ((starts[1:] - 1) // q_tile)[pair_seq] - q_lo + 1
    pair_q = _ranges(q_lo, q_span)
    pair_kv, pair_seq, pair_first = (torch.repeat_interleave(x, q_span)
                                     for x in (pair_kv, pair_seq, pair_first))
    # Causal: a block whose first position comes after every row of the tile (of that
    # sequence) is left out; row r of sequence i holds position seq_len[i] - end[i] + r.
    end = starts[1:][pair_seq]
    last_row = torch.minimum(end, (pair_q + 1) * q_tile) - 1
    keep = pair_first <= seq_lens[pair_seq] - end + last_row
    key = torch.unique(pair_q[keep] * kv_tiles + pair_kv[keep])  # by query tile, then slot tile
    tile_q, tile_kv = key // kv_tiles, key % kv_tiles
    kv_num_blocks = torch.bincount(tile_q, minlength=q_tiles).to(torch.int32)
    column = torch.arange(len(key), device=cpu) - (torch.cumsum(kv_num_blocks, 0)
                                                   - kv_num_blocks)[tile_q]
    kv_indices = torch.zeros((q_tiles, int(kv_num_blocks.max())), dtype=torch.int32, device=cpu)
    kv_indices[tile_q, column] = tile_kv.to(torch.int32)
    return kv_num_blocks, kv_indices


def flex_block_mask(block_tables: list[list[int]], query_start_loc: list[int],
                    seq_lens: list[int], num_blocks: int, block_size: int,
                    device: torch.device | str, pad: bool = False, **tiles):
    """One step's mask as a FlexAttention BlockMask over (new tokens) x (every slot of the pool),
    from a fresh builder (the engine keeps one builder and refills it; this is for tests)."""
    return FlexMaskBuilder(num_blocks, block_size, torch.device(device), pad, **tiles).build(
        block_tables, query_start_loc, seq_lens)


@functools.cache
def compiled_flex_attention():
    """FlexAttention through torch.compile, made once per process. Dynamo keeps the compiled
    graphs on flex_attention's code object, so every engine in the process shares them, and
    the recompile limit (`torch._dynamo.config.recompile_limit`) counts them together.
    fullgraph: a graph break would fail loudly, never fall back to eager in silence."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True)


def use_compiled(enforce_eager: bool | None, device: torch.device) -> bool:
    """enforce_eager=None: compile where it pays (CUDA); True: never; False: also on a CPU."""
    return device.type == "cuda" if enforce_eager is None else not enforce_eager


# Eager FlexAttention (no compiled kernel) computes a score for every query row and every slot
# of the pool, in float32, per layer: a (heads, rows, slots) tensor. On a CPU the pools are
# small (512 MiB of KV by default); an H200's default pool holds millions of slots, and a
# 2,048-row prefill over it would need hundreds of GB. Beyond this much, eager flex is refused
# on CUDA at the engine's start.
EAGER_FLEX_MAX_SCORE_BYTES = 2 * 2**30


def check_eager_flex(num_slots: int, num_heads: int, max_num_batched_tokens: int,
                     device: torch.device, enforce_eager: bool | None) -> None:
    """Refuse eager flex on CUDA over a pool whose score tensor would not fit (see above)."""
    if device.type != "cuda" or use_compiled(enforce_eager, device):
        return
    rows = max_num_batched_tokens
    need = num_heads * rows * num_slots * 4
    if need > EAGER_FLEX_MAX_SCORE_BYTES:
        most = EAGER_FLEX_MAX_SCORE_BYTES // (num_heads * rows * 4)
        raise ValueError(
            f"backend='flex' with enforce_eager=True scores every query against every slot of "
            f"the pool: {num_heads} heads x {rows} rows x {num_slots} slots in float32 is "
            f"{need / 2**30:.1f} GiB per layer, over the {EAGER_FLEX_MAX_SCORE_BYTES // 2**30} "
            f"GiB eager flex is allowed on CUDA. Let flex compile (enforce_eager=None or False), "
            f"or use backend='auto', or lower kv_cache_tokens to {most} or less (or "
            "max_num_batched_tokens)")


class FlexCompileError(RuntimeError):
    """torch.compile could not build FlexAttention's kernel for this device and dtype."""


@dataclass
class FlexMetadata(AttentionMetadata):
    block_mask: object  # FlexAttention's BlockMask over (query rows) x (every slot of the pool)
    padded: bool  # compiled: the queries go in as a fresh (1, Hq, rows, D) tensor, every step
    block_ids: torch.Tensor | None = None  # the step's blocks, on the device (may repeat)


class FlexBackend:
    """`backend="flex"`: one FlexAttention call per layer over the whole pool."""

    name = "flex"

    def __init__(self, enforce_eager: bool | None = None) -> None:
        self.enforce_eager = enforce_eager
        self.builder: FlexMaskBuilder | None = None  # made at the first step (pool size known)
        self.kernel = None
        self.kernel_options: dict | None = None
        # A quantized pool (kv_cache_dtype): one layer's pool in the compute dtype, into which
        # each layer dequantizes the step's blocks before the kernel reads it in place. Made at
        # the first quantized step; every layer and step reuses it (one shape: one graph).
        self.dequantized: torch.Tensor | None = None

    def build(self, common: CommonAttentionMetadata) -> FlexMetadata:
        if self.builder is None:
            compiled = use_compiled(self.enforce_eager, common.device)
            self.builder = FlexMaskBuilder(common.num_blocks, common.block_size, common.device,
                                           pad=compiled)
            if not compiled:
                from torch.nn.attention.flex_attention import flex_attention

                self.kernel = flex_attention
            else:
                self.kernel = compiled_flex_attention()
                if common.device.type == "cuda":
                    # As vLLM's flex backend does with its own 16-row tiles (get_kernel_options
                    # in vllm/v1/attention/backends/flex_attention.py): the GPU kernel's tiles
                    # match the mask's, and the general kernel is used even for a few query rows.
                    self.kernel_options = {"FORCE_USE_FLEX_ATTENTION": True,
                                           "BLOCK_M": self.builder.q_tile,
                                           "BLOCK_N": self.builder.kv_tile}
        mask = self.builder.build(common.block_table_ids, common.query_start_loc, common.seq_lens)
        return FlexMetadata(slot_mapping=common.slot_mapping, block_mask=mask,
                            padded=self.builder.pad, block_ids=self.builder.step_blocks)

    def dequantize(self, kv_layer: QuantizedKVLayer, block_ids: torch.Tensor) -> torch.Tensor:
        """The step's blocks of a quantized layer, dequantized into the one-layer scratch pool
        at their own block ids; the other blocks hold stale (finite) values the mask hides.
        kvlab differs: vLLM's flex backend refuses a quantized cache (auto, float16 and
        bfloat16 only: vllm/v1/attention/backends/flex_attention.py); its Triton backend, which
        takes them, dequantizes tile by tile inside the kernel
        (vllm/v1/attention/ops/triton_unified_attention.py)."""
        if self.dequantized is None or self.dequantized.shape != kv_layer.shape:
            self.dequantized = torch.zeros(kv_layer.shape, dtype=kv_layer.dtype,
                                           device=kv_layer.device)
        k, v = kv_layer.gather(block_ids)
        self.dequantized[0, block_ids] = k
        self.dequantized[1, block_ids] = v
        return self.dequantized

    def forward(self, q, kv_layer, meta: FlexMetadata, scale: float) -> torch.Tensor:
        if isinstance(kv_layer, QuantizedKVLayer):
            kv_layer = self.dequantize(kv_layer, meta.block_ids)
        if not meta.padded:  # eager: nothing to compile
            return paged_attention_flex(q, kv_layer, meta, scale, self.kernel,
                                        self.kernel_options)
        try:
            return paged_attention_flex(q, kv_layer, meta, scale, self.kernel,
                                        self.kernel_options)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (re-raised with the way out; the cause chained)
            # A step compiles the first time it meets a shape (the first step; the first with
            # another padded length). On an older GPU the Triton kernel may not build: Turing's
            # shared memory, bf16. Say so, and what runs instead, not inductor's page of trace.
            raise FlexCompileError(
                f"backend='flex' could not compile FlexAttention on {describe_device(q)} "
                f"({str(q.dtype)[6:]}): {type(e).__name__}: {first_line(e)}. "
                "Use backend='auto' (SDPA, nothing to compile), or enforce_eager=True with "
                "a small kv_cache_tokens") from e


def describe_device(t: torch.Tensor) -> str:
    if t.device.type != "cuda":
        return str(t.device)
    major, minor = torch.cuda.get_device_capability(t.device)
    return f"{torch.cuda.get_device_name(t.device)} (compute capability {major}.{minor})"


def first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def paged_attention_flex(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: FlexMetadata, scale: float, kernel=None,
    kernel_options: dict | None = None,
) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D), every sequence of the step in one call over the pool."""
    if kernel is None:
        from torch.nn.attention.flex_attention import flex_attention as kernel
    T, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    rows = meta.block_mask.seq_lengths[0]
    # The pool as one long sequence of slots: (1, Hkv, num_blocks * block_size, D), a view.
    k = kv_layer[0].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = kv_layer[1].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    if not meta.padded:
        qp = q.transpose(0, 1)[None]  # (1, Hq, T, D), a view
    else:
        keep_static(k, v)  # the pool: one graph per pool size, never a symbolic one
        # Padded to the step's row count, the padding rows attending to nothing; always a copy,
        # so the compiled kernel sees the same strides whether or not this step needed padding.
        qp = q.new_zeros((1, num_heads, rows, head_dim))
        qp[0, :, :T] = q.transpose(0, 1)
    o = kernel(qp, k, v, block_mask=meta.block_mask, scale=scale, enable_gqa=True,
               kernel_options=kernel_options)
    return o[0, :, :T].transpose(0, 1)  # (T, Hq, D)

"""Chapter 01 exercise: attention for one decode token over a paged KV cache.

What it teaches: the cache is a pool of blocks, and a sequence's keys and values are wherever its
block table says. Gather them back in order through the table, cut at the sequence's length (the
last block is only partly filled), let each group of query heads read its shared KV head
(grouped-query attention), and the result is chapter 00's attention over the contiguous
sequence. The case machinery is chapter 00's (`ch00_attention`).
"""

from __future__ import annotations

import torch  # noqa: F401 - the solution's namespace, as the participant's cell has it

from kvlab.workbook.exercises._common import Case, Exercise
from kvlab.workbook.exercises.ch00_attention import (
    IMPORTS,
    _fixed,
    _ParticipantDecodeBackend,
    _random_shapes,
    real_model_case,
)


def paged_decode_attention(q, kv_layer, block_table, seq_len, scale):
    """Attention output of one decode token: q (num_heads, head_dim) -> (num_heads, head_dim).

    kv_layer is one layer of the pool, (2, num_blocks, block_size, num_kv_heads, head_dim):
    keys at [0], values at [1]. Token p of this sequence sits in block block_table[p //
    block_size], slot p % block_size. The new token's K/V are already written (position
    seq_len - 1).
    """
    num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    # Gather: indexing the pool with the block table puts this sequence's blocks back in
    # logical order; flatten (blocks, slots) into one row of positions and cut it at seq_len,
    # since the last block is usually only partly filled (its other slots are not ours).
    k = kv_layer[0][block_table].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # (L, Hkv, D)
    v = kv_layer[1][block_table].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # (L, Hkv, D)
    # Grouped-query attention: query head h reads KV head h // group, so repeat each KV head
    # for the `group` query heads that share it.
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # (L, Hq, D)
    v = v.repeat_interleave(group, dim=1)  # (L, Hq, D)
    # The decode token is the newest position: it may see every key, so there is no mask.
    scores = torch.einsum("hd,lhd->hl", q, k) * scale  # (Hq, L)
    weights = torch.softmax(scores, dim=-1)  # each query head's weights sum to 1
    return torch.einsum("hl,lhd->hd", weights, v)  # (Hq, D)


STUB = '''import torch


def paged_decode_attention(q, kv_layer, block_table, seq_len, scale):
    """Attention output of one decode token: q (num_heads, head_dim) -> (num_heads, head_dim).

    Row h of the output is chapter 00's decode_attention for query head h, over this
    sequence's seq_len tokens (the newest one's included). kv_layer: one layer of the pool,
    (2, num_blocks, block_size, num_kv_heads, head_dim), keys at [0], values at [1].
    block_table: this sequence's block ids, a list, possibly with more blocks than seq_len
    tokens fill. Which slots of which blocks hold its tokens, in which order, the engine's slot
    table above shows; every other slot of the pool holds another sequence's K/V or garbage.
    Example: q (9, 64), kv_layer (2, 40, 16, 3, 64), block_table [12, 3], seq_len 20 ->
    a tensor (9, 64).
    """
    raise NotImplementedError("your turn")
'''


EXERCISE = Exercise(
    name="paged_attention",
    chapter="01_contiguous_vs_paged",
    title="Attention through the block table",
    prompt=(
        "Write chapter 00's decode attention again, now over the paged pool: a sequence's keys "
        "and values are not in one region but in blocks anywhere in the pool. Where its token p "
        "is, and which slots are not its own, work out from the engine's slot table above. The "
        "check compares you with PyTorch's SDPA, then runs the real model with your function "
        "in every decode step."
    ),
    full_version=(
        "kvlab's decode path (kvlab/attention.py, paged_attention_decode) attends for every "
        "decode token of a step in one call: it gathers each sequence's blocks through its block "
        "table, folds each KV head's group of query heads into rows so no K/V is repeated, and "
        "masks the slots past each sequence's length, since sequences in one batch differ in "
        "length (chapter 03). Prefills attend over the cached past and the new chunk with a "
        "causal mask (chapters 04 and 05). The step's new K/V are written first, through the slot"
        " mapping (write_kv), so every layer reads its own token. backend=\"flex\" does the same "
        "with FlexAttention, compiled on a GPU (chapter 07)."
    ),
    stub=STUB,
    hint=(
        "In the slot table, write the block and the slot of r0's position 4 in terms of its "
        "block table and the block size; then ask which slots of its last block it has not "
        "written. Indexing kv_layer[0] with the whole block table gives (len(block_table), "
        "block_size, num_kv_heads, head_dim): flatten the first two dimensions and you have "
        "chapter 00's region."
    ),
    solution=paged_decode_attention,
    imports=IMPORTS,
    cases=[
        Case("one KV head per query head, one full block", _fixed(
            "1 head, head_dim 4, block_size 4, seq_len 4", seed=1, num_heads=1, num_kv_heads=1,
            head_dim=4, block_size=4, seq_len=4),
            "Chapter 01's slot table: the sequence's tokens are in the blocks of its table; "
            "chapter 00's attention over them: softmax(q . k * scale) weights the values."),
        Case("blocks anywhere in the pool, in block-table order", _fixed(
            "2 heads, block_size 2, seq_len 8, shuffled block table", seed=3, num_heads=2,
            num_kv_heads=2, head_dim=4, block_size=2, seq_len=8),
            "Chapter 01's slot table: r0's block table is [2, 1], and its positions 0-3 are in "
            "block 2, position 4 in block 1. Entry i of the table holds positions "
            "i * block_size onwards, whatever the block's id."),
        Case("the last block partly filled: its other slots are not ours", _fixed(
            "block_size 5, seq_len 7 (block 1 holds 2 tokens and 3 garbage slots)", seed=4,
            num_heads=3, num_kv_heads=3, head_dim=4, block_size=5, seq_len=7),
            "Chapter 01's slot table: a request's last block fills slot by slot, and its slots "
            "past the newest token are not written (they hold garbage here). Attend over "
            "exactly seq_len keys."),
        Case("a single token (seq_len 1)", _fixed(
            "2 heads, block_size 4, seq_len 1", seed=2, num_heads=2, num_kv_heads=2, head_dim=4,
            block_size=4, seq_len=1), "One token, in slot 0 of the table's first block: with "
            "one key the softmax weight is 1, so each query head's output is that value."),
        Case("seq_len an exact multiple of block_size", _fixed(
            "block_size 4, seq_len 8", seed=5, num_heads=2, num_kv_heads=1, head_dim=8,
            block_size=4, seq_len=8), "Chapter 01's slot table: a block holds block_size "
            "positions, so 8 tokens in blocks of 4 fill exactly two."),
        Case("a block table longer than the sequence needs", _fixed(
            "block_size 4, seq_len 6, 3 blocks in the table", seed=6, num_heads=2,
            num_kv_heads=2, head_dim=4, block_size=4, seq_len=6, extra_blocks=1),
            "Chapter 01's allocation table: a table can hold more blocks than the tokens "
            "reach (A's row of 7 tokens keeps 3 blocks); read seq_len tokens, not "
            "len(block_table) * block_size."),
        Case("block_size 1", _fixed(
            "block_size 1, seq_len 5", seed=7, num_heads=2, num_kv_heads=2, head_dim=4,
            block_size=1, seq_len=5), "The slot table with block_size 1: position p is slot "
            "0 of the table's block p."),
        Case("grouped-query attention: 9 query heads share 3 KV heads (SmolLM2)", _fixed(
            "9 query heads, 3 KV heads, head_dim 8, block_size 4, seq_len 10", seed=8,
            num_heads=9, num_kv_heads=3, head_dim=8, block_size=4, seq_len=10),
            "Chapter 00's SDPA table: query heads 0, 1, 2 read KV head 0, 3-5 KV head 1, 6-8 "
            "KV head 2; query head h reads KV head h // (num_heads // num_kv_heads)."),
        Case("multi-query attention: 4 query heads, 1 KV head", _fixed(
            "4 query heads, 1 KV head, block_size 4, seq_len 6", seed=9, num_heads=4,
            num_kv_heads=1, head_dim=4, block_size=4, seq_len=6),
            "Chapter 00's SDPA table, taken to one KV head: every query head reads it."),
        Case("the scale is applied to q . k", _fixed(
            "scale 0.37", seed=10, num_heads=2, num_kv_heads=2, head_dim=4, block_size=4,
            seq_len=6, scale=0.37),
            "Chapter 00's contract: multiply the scores by `scale` before the softmax (it is "
            "not always 1/sqrt(D))."),
        Case("40 random shapes, block sizes and lengths", _random_shapes,
             "Any shape: chapter 01's slot table for where each token is, chapter 00's SDPA "
             "table for which KV head each query head reads."),
        Case("real model: the decode path of every layer, same tokens as kvlab",
             real_model_case("paged_attention", _ParticipantDecodeBackend),
             "The fast cases passed, so compare what your function does with a (9, 64) query and "
             "a (2, num_blocks, 4, 3, 64) pool.", real_model=True),
    ],
)
EXERCISES = [EXERCISE]

"""The GPU path's mask, checked point by point and tile by tile against the block tables.

Eager FlexAttention (what runs on a CPU) evaluates `mask_mod` everywhere and ignores the sparse
tile list, so the engine-level tests cannot catch a tile left out; these tests can.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.flex_attention import TILE, flex_block_mask


def brute_force(block_tables, query_start_loc, seq_lens, num_blocks, block_size):
    """(T, S) bool: query j of sequence i sees slot s when s's block is at logical index L of
    i's table and L * block_size + offset <= j's position."""
    rows = []
    for table, start, end, n in zip(block_tables, query_start_loc, query_start_loc[1:], seq_lens):
        where = {b: i for i, b in enumerate(table)}
        for pos in range(n - (end - start), n):
            rows.append([s // block_size in where
                         and where[s // block_size] * block_size + s % block_size <= pos
                         for s in range(num_blocks * block_size)])
    return torch.tensor(rows)


CASES = {
    # A decode, a prefill chunk after a shared cached prefix, a whole prompt; blocks scattered.
    "block 8": (8, 64, [[40, 3, 17], [40, 3, 9, 60, 22], [5, 6, 7, 8, 50, 51, 52, 53, 54, 55]],
                [0, 1, 31, 111], [20, 36, 80]),
    "block 256 spans tiles": (256, 4, [[2], [2, 0]], [0, 1, 301], [200, 500]),
    "block 20 straddles tiles": (20, 40, [[39, 1, 12], [7, 30, 31, 2, 25, 18, 19]],
                                 [0, 40, 180], [55, 140]),
}


@pytest.mark.parametrize("case", CASES)
def test_mask_equals_the_block_tables_and_lists_every_needed_tile(case):
    block_size, num_blocks, tables, starts, seq_lens = CASES[case]
    mask = flex_block_mask(tables, starts, seq_lens, num_blocks, block_size, "cpu")
    truth = brute_force(tables, starts, seq_lens, num_blocks, block_size)
    T, S = truth.shape
    q_idx, kv_idx = torch.arange(T)[:, None], torch.arange(S)[None, :]
    assert torch.equal(mask.mask_mod(0, 0, q_idx, kv_idx), truth)
    kv_num_blocks, kv_indices = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    for qt in range((T + TILE - 1) // TILE):
        listed = set(kv_indices[qt, : kv_num_blocks[qt]].tolist())
        rows = truth[qt * TILE : (qt + 1) * TILE]
        needed = {kt for kt in range((S + TILE - 1) // TILE)
                  if rows[:, kt * TILE : (kt + 1) * TILE].any()}
        assert needed <= listed, (qt, needed - listed)
        assert len(listed) <= len(needed) + 2  # sparse: little beyond what the tables touch


def test_a_block_at_two_logical_positions_is_refused():
    with pytest.raises(RuntimeError, match="two logical positions"):
        flex_block_mask([[1, 2], [2, 1]], [0, 1, 2], [10, 10], 4, 8, "cpu")

"""The GPU path's mask, checked point by point and tile by tile against the block tables.

Eager FlexAttention (what runs on a CPU by default) evaluates `mask_mod` everywhere and ignores
the sparse tile list, so the engine-level tests cannot catch a tile left out; these tests can.
They also hold the builder to its promise for the compiled kernel: buffers, `mask_mod` and the
BlockMask of a padded length are made once and refilled, and what an earlier step left in them
changes nothing.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.flex_attention import FlexMaskBuilder, flex_block_mask, padded_rows, slot_tile


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


def check_mask(mask, truth, block_size: int):
    """mask_mod equals `truth` on the real rows and sees nothing from a padding row; every tile
    holding a visible slot is listed, and (each block inside one tile) nothing else is."""
    q_tile, kv_tile = mask.BLOCK_SIZE
    aligned = kv_tile % block_size == 0
    rows, S = mask.seq_lengths
    T = truth.shape[0]
    got = mask.mask_mod(0, 0, torch.arange(rows)[:, None], torch.arange(S)[None, :])
    assert torch.equal(got[:T], truth)
    assert not got[T:].any()
    kv_num_blocks, kv_indices = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    for qt in range(-(-rows // q_tile)):
        listed = kv_indices[qt, : kv_num_blocks[qt]].tolist()
        assert listed == sorted(set(listed))
        tile = got[qt * q_tile : (qt + 1) * q_tile]
        needed = {kt for kt in range(-(-S // kv_tile))
                  if tile[:, kt * kv_tile : (kt + 1) * kv_tile].any()}
        assert needed <= set(listed), (qt, needed - set(listed))
        if aligned:
            assert set(listed) == needed, (qt, set(listed) - needed)
        else:  # a block spanning tiles may list a tile of its not-yet-visible part
            assert len(listed) <= len(needed) + 2


CASES = {
    # A decode, a prefill chunk after a shared cached prefix, a whole prompt; blocks scattered.
    "block 8": (8, 64, [[40, 3, 17], [40, 3, 9, 60, 22], [5, 6, 7, 8, 50, 51, 52, 53, 54, 55]],
                [0, 1, 31, 111], [20, 36, 80]),
    "block 16": (16, 48, [[40, 3], [40, 3, 9, 30, 22, 7, 8, 9 + 32], [1]],
                 [0, 1, 101, 110], [20, 125, 9]),
    "block 256 spans tiles": (256, 4, [[2], [2, 0]], [0, 1, 301], [200, 500]),
    "block 20 straddles tiles": (20, 40, [[39, 1, 12], [7, 30, 31, 2, 25, 18, 19]],
                                 [0, 40, 180], [55, 140]),
}


@pytest.mark.parametrize("tiles", [{}, {"q_tile": 128, "kv_tile": 128}], ids=["16", "128"])
@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("case", CASES)
def test_mask_equals_the_block_tables_and_lists_exactly_the_needed_tiles(case, pad, tiles):
    block_size, num_blocks, tables, starts, seq_lens = CASES[case]
    mask = flex_block_mask(tables, starts, seq_lens, num_blocks, block_size, "cpu", pad, **tiles)
    assert mask.seq_lengths[0] == (padded_rows(starts[-1]) if pad else starts[-1])
    assert mask.q_indices is None and mask.full_kv_indices is None  # forward-only mask
    check_mask(mask, brute_force(tables, starts, seq_lens, num_blocks, block_size), block_size)


def test_padded_rows_are_powers_of_two_from_16():
    assert [padded_rows(n) for n in (1, 15, 16, 17, 100, 128, 129, 2048)] == [
        16, 16, 16, 32, 128, 128, 256, 2048]
    assert [slot_tile(b) for b in (1, 8, 16, 20, 64, 128, 256)] == [16, 16, 16, 16, 64, 128, 128]


def test_steps_refill_the_same_buffers_and_leftovers_change_nothing():
    """Two steps on one builder: the second gets the same BlockMask object (same padded
    length), and the first step's blocks, now in nobody's table or at another index, are not
    seen. A third step reuses them; a fourth, larger one grows them and is still exact."""
    builder = FlexMaskBuilder(num_blocks=40, block_size=4, device=torch.device("cpu"), pad=True)
    steps = [
        ([[5, 6, 7], [5, 6, 9, 10]], [0, 9, 12], [10, 14]),  # block 5, 6 shared
        ([[9, 6], [11, 12, 5, 13]], [0, 1, 3], [6, 14]),  # 6 and 5 now at other indices
    ]
    masks = []
    for tables, starts, lens in steps:
        masks.append(builder.build(tables, starts, lens))
        check_mask(masks[-1], brute_force(tables, starts, lens, 40, 4), 4)
    assert masks[0] is masks[1]
    buffers = (builder.q_pos, builder.tables, builder.kv_indices)
    big = [list(range(i * 8, i * 8 + 8)) for i in range(5)]  # 5 x 32 tokens: 160 rows
    starts = [0, 32, 64, 96, 128, 160]
    mask = builder.build(big, starts, [32] * 5)
    check_mask(mask, brute_force(big, starts, [32] * 5, 40, 4), 4)
    assert builder.q_pos is buffers[0]  # 256 rows fit the 2,048 it started with
    huge = [list(range(40))] * 30  # 30 sequences sharing all 40 blocks: 1,200 table entries
    starts = list(range(31))
    mask = builder.build(huge, starts, [160] * 30)
    assert builder.tables is not buffers[1] and builder.tables.shape[0] >= 1200
    check_mask(mask, brute_force(huge, starts, [160] * 30, 40, 4), 4)


def test_a_block_at_two_logical_positions_is_refused():
    with pytest.raises(RuntimeError, match="two logical positions"):
        flex_block_mask([[1, 2], [2, 1]], [0, 1, 2], [10, 10], 4, 8, "cpu")

"""Chapter 02 exercise: copy-on-write.

`copy_on_write` teaches the price of sharing, paid late and only where needed: before a step
writes into a block that other tables still hold (ref_cnt > 1), the writer swaps it for a fresh
block, records (source, destination) so the model runner copies the K/V first, and drops its
reference to the old one. The last holder writes in place. (The fork itself, a copied table and
one more reference per block, is shown on chapter 02's path, not asked for: two lines with no
rule to find.)

Checked on kvlab's own pool (`IdPool`), against `KVCacheManager` on random states, then inside
a real engine generating n=3 forked samples of one prompt.
"""

from __future__ import annotations

import random

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, IdPool, Mismatch, cdiv, short
from kvlab.kv_cache import KVCacheManager
from kvlab.sampling import RequestOutputKind, SamplingParams


def _pool_with_table(num_blocks: int, table_len: int,
                     seed: int = 0) -> tuple[IdPool, list[int]]:
    """A pool where one table of `table_len` blocks exists, each held once (block ids
    scattered)."""
    rng = random.Random(seed)
    pool = IdPool(num_blocks)
    taken = pool.get_new_blocks(num_blocks)
    rng.shuffle(taken)
    table, rest = taken[:table_len], taken[table_len:]
    pool.free_blocks(rest)
    return pool, table


# n=3 samples of two prompts: the prompt is computed once and forked; the samples then write
# into the shared, partly filled last block, which copy-on-write separates.
# Fork by name: kvlab's default, as vLLM v1's, is child requests, which never fork.
_ENGINE = dict(block_size=4, max_model_len=64, kv_cache_tokens=256, parallel_sampling="fork")


def _batches():
    prompts = _real_engine.prompt_ids([10, 13])
    sample3 = SamplingParams(n=3, max_tokens=10, temperature=0.8, seed=11, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY)
    return [[(f"r{i}", {"prompt_token_ids": p}, sample3) for i, p in enumerate(prompts)]]


def _real_model(manager_cls):
    def run(impl):
        expected = _real_engine.reference_workload(
            "forked_samples", _ENGINE, _batches,
            lambda engine, _run: engine.kv_cache_manager.num_cow_copies > 0,
            "the workload no longer copies")
        engine, got = _real_engine.run_with(
            _ENGINE, _batches,
            kv_cache_manager_cls=_real_engine.with_attrs(manager_cls, impl=impl))
        _real_engine.compare_tokens(expected, got, "your code")
        _real_engine.check_bookkeeping(engine)
    return run


# ---- copy_on_write -------------------------------------------------------------------------------
def copy_on_write(block_table, num_computed_tokens, block_size, pool):
    """Give this table private copies of the shared blocks this step writes into; return the
    (source, destination) pairs whose K/V must be copied."""
    copies = []
    # This step writes from position num_computed_tokens on: into the block holding that
    # position and any block after it in the table. (Blocks appended later for the new tokens
    # come fresh from the pool: never shared.) Earlier blocks are only read: sharing is fine.
    for i in range(num_computed_tokens // block_size, len(block_table)):
        if pool.ref_cnt(block_table[i]) > 1:
            # Other tables still read this block: writing into it would change their past.
            (fresh,) = pool.get_new_blocks(1)
            # The model runner copies the K/V of (source, destination) before the forward.
            copies.append((block_table[i], fresh))
            # Drop our reference; the other tables keep theirs (the last one writes in place).
            pool.free_blocks([block_table[i]])
            block_table[i] = fresh
    return copies


COW_STUB = '''def copy_on_write(block_table, num_computed_tokens, block_size, pool):
    """Called just before a step writes this sequence's new tokens, which go to positions
    num_computed_tokens .. (the end of the last block of block_table: the table already
    covers the step's tokens). block_table: this sequence's block ids, a list to change in
    place; other sequences' tables may hold the same blocks. pool: pool.ref_cnt(block_id) (how
    many tables hold it), pool.get_new_blocks(n) (n free block ids, each now held once) and
    pool.free_blocks(block_ids) (drops one hold on each; a block held by nobody is free again).
    Return the list of (source, destination) block-id pairs whose K/V the model runner must
    copy before the step, [] when none.
    Afterwards: no other sequence reads anything this step writes, every other sequence's
    table and contents are as before, and no block is left held by nobody.
    Example (nothing shared): block_size 4, block_table [3, 5] each held once,
    num_computed_tokens 6 -> returns [], block_table still [3, 5].
    """
    raise NotImplementedError("your turn")
'''


def _check_cow(before, table, copies, first, refs, free_before, pool, situation) -> None:
    """Behaviour, whatever fresh block ids were chosen: every shared block from `first` on is
    swapped for a fresh private block, recorded once, and its old reference dropped; nothing
    else changes."""
    shared = [i for i in range(first, len(before)) if refs[before[i]] > 1]
    if not isinstance(copies, (list, tuple)):
        raise Mismatch("a list of (old, fresh) pairs", short(copies), situation)
    if len(table) != len(before):
        raise Mismatch(f"a block table of {len(before)} blocks", short(table), situation)
    for i, (old, new) in enumerate(zip(before, table)):
        if i in shared and new == old:
            what = ("the block this step writes into" if i == first else
                    f"block {i} of the table, which this step writes into")
            raise Mismatch(f"{what} (id {old}, ref_cnt {refs[old]}) replaced by a fresh block",
                           "the same, shared block: writing into it would change what the "
                           "other sequences read", situation)
        if i not in shared and new != old:
            why = ("only read by this step" if i < first else
                   f"held by this table alone (ref_cnt {refs[old]})")
            raise Mismatch(f"block {old} at index {i} kept ({why})", f"replaced by {new}",
                           situation)
    want = sorted((before[i], table[i]) for i in shared)
    try:
        got = sorted(tuple(c) for c in copies)
    except TypeError:
        raise Mismatch(f"copies {want}", short(copies), situation) from None
    if got != want:
        raise Mismatch(f"copies {want} (old, fresh)", short(copies), situation)
    for i in shared:
        new, old = table[i], before[i]
        if refs[new] != 0:
            raise Mismatch(f"a fresh block (free before) in place of {old}",
                           f"block {new}, which was already held", situation)
        if pool.ref_cnt(new) != 1:
            raise Mismatch(f"the fresh block {new} held once", f"ref_cnt {pool.ref_cnt(new)}",
                           situation)
        if pool.ref_cnt(old) != refs[old] - 1:
            raise Mismatch(f"block {old} to lose this table's reference "
                           f"(ref_cnt {refs[old]} -> {refs[old] - 1})",
                           f"ref_cnt {pool.ref_cnt(old)}", situation)
    if pool.get_num_free_blocks() != free_before - len(shared):
        raise Mismatch(f"{free_before - len(shared)} free blocks afterwards",
                       f"{pool.get_num_free_blocks()}", situation)


def _cow_scene(table_len: int, refs_of_table: list[int], num_computed_tokens: int,
               block_size: int, num_free: int = 4, seed: int = 0):
    def run(impl):
        num_blocks = table_len + num_free
        pool, table = _pool_with_table(num_blocks, table_len, seed)
        for b, extra in zip(table, refs_of_table):
            for _ in range(extra - 1):
                pool.touch([b])
        _cow_call(impl, pool, table, num_computed_tokens, block_size)
    return run


def _cow_call(impl, pool, table, num_computed_tokens, block_size) -> None:
    before = list(table)
    refs = {b: pool.ref_cnt(b) for b in range(pool.num_blocks)}
    free = pool.get_num_free_blocks()
    situation = (f"block_size {block_size}, num_computed_tokens {num_computed_tokens}, "
                 f"block_table {before} with ref counts {[refs[b] for b in before]}")
    copies = impl(table, num_computed_tokens, block_size, pool)
    _check_cow(before, table, copies, num_computed_tokens // block_size, refs, free, pool,
               situation)


def _three_writers(impl) -> None:
    """The notebook's scene: three tables share two blocks; each writes token 6 in turn."""
    pool = IdPool(8)
    parent = pool.get_new_blocks(2)
    tables = {"parent": parent, "child1": list(parent), "child2": list(parent)}
    pool.touch(parent)
    pool.touch(parent)
    for name in ("child1", "child2", "parent"):
        _cow_call(impl, pool, tables[name], 6, 4)
    if pool.ref_cnt(parent[0]) != 3:
        raise Mismatch("the tables' first block (only read) still shared by all three",
                       f"ref_cnt {pool.ref_cnt(parent[0])}")


def _cow_random(impl) -> None:
    rng = random.Random(3)
    for trial in range(200):
        block_size = rng.choice([1, 2, 4, 8])
        table_len = rng.randint(1, 5)
        refs = [rng.choice([1, 1, 2, 3]) for _ in range(table_len)]
        num_computed = rng.randint(0, table_len * block_size)
        _cow_scene(table_len, refs, num_computed, block_size, num_free=table_len,
                   seed=trial)(impl)


class _CopyOnWriteManager(KVCacheManager):
    """kvlab's KVCacheManager whose allocate_slots does copy-on-write with the participant's
    function (prefix caching off)."""

    impl = None

    def allocate_slots(self, request_id, num_tokens, num_computed_tokens=0,
                       new_computed_blocks=(), request=None, *, full_sequence_must_fit=False,
                       has_scheduled_reqs=True) -> bool:
        # The admission gate (scheduler_reserve_full_isl) is kvlab's, not the exercise's.
        if full_sequence_must_fit and not self.full_sequence_fits(request, new_computed_blocks,
                                                                  has_scheduled_reqs=False):
            return False
        blocks = self.req_to_blocks.get(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        first = num_computed_tokens // self.block_size
        num_shared = sum(1 for blk in blocks[first:] if blk.ref_cnt > 1)
        # kvlab's own all-or-nothing check: the new blocks and the copies must all fit.
        if max(num_new, 0) + num_shared > self.block_pool.get_num_free_blocks():
            return False
        pool = IdPool(self.block_pool)
        table = [blk.block_id for blk in blocks]
        before = list(table)
        refs = {b: pool.ref_cnt(b) for b in range(pool.num_blocks)}
        free = pool.get_num_free_blocks()
        copies = self.impl(table, num_computed_tokens, self.block_size, pool)
        _check_cow(before, table, copies, first, refs, free, pool,
                   f"request {request_id} in the engine: block_table {before}, "
                   f"num_computed_tokens {num_computed_tokens}")
        self.pending_copies += [tuple(c) for c in copies]
        self.num_cow_copies += len(copies)
        blocks = [self.block_pool.blocks[b] for b in table]
        if num_new > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new))
        self.req_to_blocks[request_id] = blocks
        self._note_peak()
        return True


COPY_ON_WRITE = Exercise(
    name="copy_on_write",
    chapter="02_copy_on_write",
    title="Copy-on-write",
    prompt=(
        "Write copy-on-write, the step a sequence takes before it writes its new tokens into "
        "blocks it may share. Work out from the scene above which blocks a write copies, which "
        "stay shared, what happens to the reference counts, and why the parent wrote in place. "
        "The check replays chapter 02's scene and random ones, then runs n=3 samples on the "
        "real model with your function."
    ),
    full_version=(
        "In kvlab the copy is part of allocate_slots (kvlab/kv_cache.py): before a step writes "
        "from num_computed_tokens on, each shared block in that range is swapped for a fresh one "
        "and the (source, destination) pair queued; the model runner copies those blocks' K/V in "
        "every layer before the forward (take_pending_copies). vLLM 0.33.0's v1 engine has no "
        "fork, so nothing to copy: its parallel samples are separate requests that share their "
        "prompt's full blocks through the prefix cache (vllm/v1/engine/parallel_sampling.py; "
        "kvlab's parallel_sampling=\"child_requests\", later in this chapter)."
    ),
    stub=COW_STUB,
    hint=(
        "In the scene, child1 wrote token 6: which block holds position 6, and why was block 1 "
        "not copied? After child1's copy, block 2's reference count fell by one: whose "
        "reference was that, and what was left for the parent?"
    ),
    solution=copy_on_write,
    cases=[
        Case("after a fork: the shared, partly filled last block is copied",
             _cow_scene(2, [2, 2], 6, 4),
             "Chapter 02's scene: token 6 goes to slot 2 of the table's second block; the other table "
             "still reads slots 0-1 of it, so it is copied first."),
        Case("a shared block before the write position is only read: still shared",
             _cow_scene(3, [2, 2, 2], 9, 4),
             "Chapter 02's scene: block 1, only read, stayed shared. Blocks wholly before "
             "num_computed_tokens are never written."),
        Case("a write that starts a new block copies nothing", _cow_scene(2, [2, 2], 8, 4),
             "Position 8 is the first slot of block 2, which is not in the table yet: it will "
             "be a fresh block."),
        Case("a block this table holds alone is written in place", _cow_scene(2, [2, 1], 5, 4),
             "Chapter 02's scene: the parent, last, held block 2 alone (ref_cnt 1) and wrote in place."),
        Case("a chunk writing into two shared blocks copies both", _cow_scene(3, [1, 2, 3], 4, 4),
             "Every shared block from the write position to the end of the table is written, so "
             "copied (the scene's rule, over a chunk of several tokens)."),
        Case("three tables share: the first two writers copy, the last writes in place",
             _three_writers,
             "Chapter 02's scene: each copy drops one reference from the old block; the last "
             "holder has ref_cnt 1 and writes in place."),
        Case("200 random tables and ref counts", _cow_random,
             "Chapter 02's scene, everywhere: a block this step writes into that others hold is "
             "copied (fresh block, (old, fresh) recorded, one reference dropped); the rest stay."),
        Case("real model: n=3 samples writing into shared blocks, same tokens as kvlab",
             _real_model(_CopyOnWriteManager), "A wrong copy changes what another sample "
             "reads: its tokens differ from kvlab's (chapter 02's scene, on the real model).",
             real_model=True),
    ],
)

EXERCISES = [COPY_ON_WRITE]

"""Chapter 01 exercises: the block pool, and paged allocation on top of it.

`block_pool` teaches the pool's three rules: blocks come from the head of a free queue and freed
ones go back to its head, in the order given (vLLM 0.33.0's `BlockPool.free_blocks`: a block
that holds no cached prefix is reused first; chapter 05 adds the blocks that do, which go to the
tail); every block counts the block tables that hold it (reference counts, which let chapter 02
share blocks); and a request gets all the blocks it asks for or none.

`allocate_slots` teaches paged allocation: a request takes blocks only as its tokens reach them,
so it holds at most one partly filled block, and a request that cannot get what it needs takes
nothing (the scheduler then preempts or waits).

Both are compared, operation by operation, with kvlab's own `BlockPool` / `KVCacheManager`, then
run inside a real engine (a tight pool, so requests are preempted and blocks reused).
"""

from __future__ import annotations

import random
from collections import OrderedDict

from kvlab.block_pool import BlockPool
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, IdPool, Mismatch, cdiv, short
from kvlab.kv_cache import KVCacheManager
from kvlab.sampling import RequestOutputKind, SamplingParams


# ---- block_pool ------------------------------------------------------------------------------
class TinyBlockPool:
    """Block ids 0 .. num_blocks - 1, their reference counts, and a free queue."""

    def __init__(self, num_blocks):
        # Every block starts free, held by nobody. The free queue's head is the next block to
        # be reused.
        self.ref_cnt = [0] * num_blocks
        self.free_queue = OrderedDict((block_id, None) for block_id in range(num_blocks))

    def get_num_free_blocks(self):
        return len(self.free_queue)

    def get_new_blocks(self, num_blocks):
        # All or nothing: check first, so a request that cannot get every block it needs
        # leaves the pool exactly as it was.
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot get {num_blocks} blocks: {len(self.free_queue)} are free")
        block_ids = []
        for _ in range(num_blocks):
            # From the head: the most recently freed block (or, at the start, the lowest id).
            block_id, _ = self.free_queue.popitem(last=False)
            self.ref_cnt[block_id] = 1  # one block table holds it now
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids):
        # One more block table holds each block (a fork shares it, a prefix-cache hit takes it
        # back). A free block leaves the queue, so it cannot be handed to anyone else.
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free_blocks(self, block_ids):
        # Drop one reference each; the blocks that nobody holds any more go back to the head of
        # the queue, in the order given (the first given is reused first), as vLLM 0.33.0 does
        # with blocks that hold no cached prefix: nothing can hit them, so reuse them first.
        freed = []
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                freed.append(block_id)
        for block_id in reversed(freed):
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)


POOL_STUB = '''from collections import OrderedDict


class TinyBlockPool:
    """Block ids 0 .. num_blocks - 1, a reference count each (how many block tables hold the
    block), and a free queue: the blocks nobody holds, in the order they will be handed out.
    Every call must leave the pool as kvlab's pool in the trace above leaves it.

    get_new_blocks(n): a list of n block ids from the free queue, each now held once; if fewer
        than n are free, raise ValueError.
    free_blocks(block_ids): drop one reference each; a block whose count reaches 0 is free.
    touch(block_ids): one more reference each (a free block is held again).
    get_num_free_blocks(): how many blocks are free, an int.
    Invariant: a block is in the free queue exactly when its count is 0.
    Example: pool = TinyBlockPool(4); pool.get_new_blocks(3) -> [0, 1, 2];
    pool.get_num_free_blocks() -> 1
    """

    def __init__(self, num_blocks):
        raise NotImplementedError("your turn")

    def get_num_free_blocks(self):
        raise NotImplementedError("your turn")

    def get_new_blocks(self, num_blocks):
        raise NotImplementedError("your turn")

    def touch(self, block_ids):
        raise NotImplementedError("your turn")

    def free_blocks(self, block_ids):
        raise NotImplementedError("your turn")
'''


class _Oracle:
    """kvlab's own BlockPool, in ids."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = IdPool(BlockPool(num_blocks, null_block=False))

    def __getattr__(self, name):
        return getattr(self.pool, name)


def _ids(value, what: str) -> list[int]:
    try:
        out = list(value)
    except TypeError:
        raise Mismatch(f"{what} to return a list of block ids", short(value)) from None
    return out


def _free_count(pool, history) -> int:
    n = pool.get_num_free_blocks()
    if isinstance(n, bool) or not isinstance(n, int):
        raise Mismatch("get_num_free_blocks() to return an int", short(n), _story(history))
    return n


def _story(history: list[str]) -> str:
    """The operations so far: the first (the pool's size) and the last few."""
    head, tail = history[:1], history[1:]
    return "after: " + "; ".join(head + (["..."] if len(tail) > 7 else []) + tail[-7:])


def _script(impl, num_blocks: int, ops, title: str = "") -> None:
    """Replay operations on the participant's pool and on kvlab's, comparing as they go."""
    theirs, oracle = impl(num_blocks), _Oracle(num_blocks)
    history = [f"{title}TinyBlockPool({num_blocks})"]
    for op, arg in ops:
        if op == "get":
            want_error = arg > oracle.get_num_free_blocks()
            call = f"get_new_blocks({arg})"
            if want_error:
                free_before = oracle.get_num_free_blocks()
                try:
                    got = theirs.get_new_blocks(arg)
                except ValueError:
                    got = ValueError
                if got is not ValueError:
                    raise Mismatch(f"{call} to raise ValueError ({free_before} free)",
                                   f"it returned {short(got)}", _story(history))
                if _free_count(theirs, history) != free_before:
                    raise Mismatch(f"{call} to take nothing when it fails ({free_before} free)",
                                   f"{_free_count(theirs, history)} free afterwards",
                                   _story(history))
            else:
                want = oracle.get_new_blocks(arg)
                got = _ids(theirs.get_new_blocks(arg), call)
                if got != want:
                    raise Mismatch(f"{call} -> {want}", str(short(got)), _story(history))
        elif op == "free":
            call = f"free_blocks({arg})"
            theirs.free_blocks(list(arg))
            oracle.free_blocks(list(arg))
        elif op == "touch":
            call = f"touch({arg})"
            theirs.touch(list(arg))
            oracle.touch(list(arg))
        history.append(call if op != "get" or want_error else f"{call} -> {want}")
        want_free, got_free = oracle.get_num_free_blocks(), _free_count(theirs, history)
        if want_free != got_free:
            raise Mismatch(f"get_num_free_blocks() == {want_free}", str(got_free),
                           _story(history))


def _fixed(num_blocks, ops):
    return lambda impl: _script(impl, num_blocks, ops)


def _random_scripts(impl) -> None:
    rng = random.Random(1)
    for trial in range(150):
        num_blocks = rng.randint(1, 10)
        oracle, held, ops = _Oracle(num_blocks), [], []
        for _ in range(30):
            kind = rng.choice(["get", "get", "free", "free", "touch"])
            if kind == "get":
                n = rng.randint(0, oracle.get_num_free_blocks() + 1)
                ops.append(("get", n))
                if n <= oracle.get_num_free_blocks():
                    held += oracle.get_new_blocks(n)
            elif kind == "free" and held:
                distinct = sorted(set(held))
                freed = rng.sample(distinct, rng.randint(1, len(distinct)))
                for block_id in freed:
                    held.remove(block_id)  # one reference each
                ops.append(("free", freed))
                oracle.free_blocks(freed)
            elif kind == "touch":
                candidates = sorted(set(held)) + oracle.free_block_ids()
                if candidates:
                    chosen = list(dict.fromkeys(rng.sample(candidates,
                                                           rng.randint(1, len(candidates)))))
                    ops.append(("touch", chosen))
                    oracle.touch(chosen)
                    held += chosen
        _script(impl, num_blocks, ops, title=f"(random script {trial}) ")


class _ParticipantPoolManager(KVCacheManager):
    """kvlab's KVCacheManager over the participant's block pool (`impl(num_blocks)`, wrapped in
    a `_ParticipantPool`): the engine builds it as its kv_cache_manager_cls."""

    impl = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.block_pool = _ParticipantPool(self.impl(self.num_blocks), self.num_blocks)


class _ParticipantPool(BlockPool):
    """kvlab's BlockPool, with every decision taken by the participant's pool.

    kvlab keeps its own ref counts and free queue alongside (the superclass's fields), only to
    check, after each call, that the participant's answers are consistent with who holds what.
    """

    def __init__(self, theirs, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.theirs = theirs
        # vLLM's pool takes its null block, block 0, off the head of its free queue once made
        # (vllm/v1/core/block_pool.py): do the same with the participant's pool.
        first = _ids(theirs.get_new_blocks(1), "get_new_blocks(1) on a new pool")
        if first != [0]:
            raise Mismatch("a new pool's first block to be block 0", short(first))

    def _agree(self, call: str) -> None:
        got = self.theirs.get_num_free_blocks()
        if got != len(self.free_queue):
            raise Mismatch(f"after {call} in the engine, {len(self.free_queue)} free blocks "
                           "(blocks no request holds)", f"your pool counts {got}")

    def get_num_free_blocks(self) -> int:
        return self.theirs.get_num_free_blocks()

    def get_new_blocks(self, num_blocks: int):
        call = f"get_new_blocks({num_blocks})"
        ids = _ids(self.theirs.get_new_blocks(num_blocks), call)
        if len(ids) != num_blocks or len(set(ids)) != num_blocks:
            raise Mismatch(f"{call} to return {num_blocks} distinct ids", short(ids))
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < self.num_blocks:
                raise Mismatch(f"block ids in 0..{self.num_blocks - 1}", short(i))
            if self.blocks[i].ref_cnt:
                raise Mismatch(f"{call} to hand out free blocks",
                               f"block {i}, which a request still holds")
        out = []
        for i in ids:
            blk = self.blocks[i]
            del self.free_queue[i]
            self._evict(blk)
            blk.ref_cnt = 1
            out.append(blk)
        self._agree(call)
        return out

    def touch(self, blocks) -> None:
        ids = [b.block_id for b in blocks]
        self.theirs.touch(ids)
        super().touch(blocks)
        self._agree(f"touch({ids})")

    def free_blocks(self, blocks) -> None:
        ids = [b.block_id for b in blocks]
        self.theirs.free_blocks(ids)
        super().free_blocks(blocks)
        self._agree(f"free_blocks({ids})")


# 12 blocks of 4 tokens: four sequences of about 22 tokens need 24, so the newest request is
# preempted and recomputed, and blocks are freed and reused; n=2 forks share blocks (touch).
_TIGHT = dict(block_size=4, max_model_len=48, kv_cache_tokens=48, max_num_seqs=8)


def _tight_batches():
    prompts = _real_engine.prompt_ids([9, 10, 11])
    sample2 = SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=7, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY)
    return [[("r0", {"prompt_token_ids": prompts[0]}, _real_engine.GREEDY),
             ("r1", {"prompt_token_ids": prompts[1]}, sample2),
             ("r2", {"prompt_token_ids": prompts[2]}, _real_engine.GREEDY)]]


def _preempts(engine, _run) -> bool:
    return engine.scheduler.num_preemptions > 0


def _pool_real_model(impl) -> None:
    expected = _real_engine.reference_workload("tight_pool", _TIGHT, _tight_batches, _preempts,
                                          "the workload no longer preempts")

    engine, got = _real_engine.run_with(
        _TIGHT, _tight_batches,
        kv_cache_manager_cls=_real_engine.with_attrs(_ParticipantPoolManager, impl=impl))
    _real_engine.compare_tokens(expected, got, "your block pool")
    _real_engine.check_bookkeeping(engine)


BLOCK_POOL = Exercise(
    name="block_pool",
    chapter="01_contiguous_vs_paged",
    title="The block pool",
    prompt=(
        "Write the block pool: block ids with a reference count each, and a free queue. Its "
        "rules are yours to work out from the trace of kvlab's pool above: which end of the "
        "queue new blocks come from, where freed blocks go and in which order, and what a "
        "request that asks for too many blocks leaves behind. The check replays the same "
        "operations on your pool and on kvlab's, then runs a real engine on yours."
    ),
    full_version=(
        "kvlab's BlockPool (kvlab/block_pool.py) hands out KVCacheBlock objects rather than ids, "
        "keeps the free queue as vLLM does, and adds the prefix cache (chapter 05): a full block "
        "can be filed under its key, a freed keyed block goes to the tail of the queue (the last "
        "to be reused, so a later request can still hit it), a hit takes a free block back out of"
        " the queue (touch), and reusing a keyed block evicts its key. It records vLLM's KV cache"
        " events (BlockStored, BlockRemoved, AllBlocksCleared) for the explorer, and "
        "reset_prefix_cache drops every key when nothing is held (chapter 05)."
    ),
    stub=POOL_STUB,
    hint=(
        "Put the free queue of each line of the trace beside the line before it: which end "
        "does get_new_blocks take from, where do the blocks of free_blocks([1, 3]) land, which "
        "of the two first, and what did the refused call change? An OrderedDict is a queue you "
        "can also delete from in the middle: popitem(last=False) pops the head, "
        "`queue[block_id] = None` then `queue.move_to_end(block_id, last=False)` puts a block "
        "at the head, `del queue[block_id]` takes a block out. Keep a list of ref counts beside "
        "it."
    ),
    solution=TinyBlockPool,
    imports="from collections import OrderedDict",
    cases=[
        Case("a fresh pool hands out blocks 0, 1, 2, ... in order",
             _fixed(5, [("get", 2), ("get", 1), ("get", 0)]),
             "Chapter 01's pool trace, first lines: a new pool's free queue is 0, 1, ..., "
             "num_blocks - 1, and get_new_blocks(4) took 0, 1, 2, 3 from its head."),
        Case("freed blocks go back to the head: the latest call's blocks are reused first",
             _fixed(4, [("get", 4), ("free", [2, 0]), ("free", [3]), ("get", 3)]),
             "Chapter 01's pool trace: free_blocks([1, 3]) turned the queue [4, 5] into "
             "[1, 3, 4, 5]: freed blocks go to the head, the first given at the very head, so "
             "the latest call's blocks are reused first. After freeing 2, 0, then 3, the next "
             "three blocks are 3, 2, 0."),
        Case("freed blocks are reused before blocks never used",
             _fixed(4, [("get", 3), ("free", [2, 0]), ("get", 3)]),
             "Chapter 01's pool trace: free_blocks([1, 3]) made [4, 5] into [1, 3, 4, 5], the "
             "first given at the very head. Here the queue is [3]; freeing 2, 0 makes it "
             "[2, 0, 3], so the next three blocks are 2, 0, 3."),
        Case("all or nothing: asking for more than is free raises ValueError and takes nothing",
             _fixed(3, [("get", 2), ("get", 2), ("get", 1)]),
             "Chapter 01's pool trace: the refused get_new_blocks left the free queue exactly "
             "as it was. A request that cannot run on part of its blocks must not keep them "
             "(nobody else could use them): check the free count before popping anything."),
        Case("asking for exactly every free block succeeds", _fixed(3, [("get", 1), ("get", 2)]),
             "n blocks can be handed out when n <= the number of free blocks (chapter 01's "
             "allocation table: B's last row took the last free block)."),
        Case("a shared block stays held until its last reference is dropped",
             _fixed(3, [("get", 2), ("touch", [1]), ("free", [1]), ("get", 1), ("free", [1]),
                        ("get", 1)]),
             "Chapter 01's pool trace: after touch([2]) block 2 was held twice, and "
             "free_blocks([2, 0]) freed only 0. touch adds a reference, free_blocks drops one; "
             "only a block at 0 references is free."),
        Case("touching a free block takes it out of the free queue",
             _fixed(4, [("get", 2), ("free", [0, 1]), ("touch", [0]), ("get", 3)]),
             "Chapter 01's pool trace: touch([4]) on a free block took 4 out of the free queue "
             "(nobody else may be handed it). Later it is freed again like any other block."),
        Case("a block touched several times needs as many frees",
             _fixed(2, [("get", 1), ("touch", [0]), ("touch", [0]), ("free", [0]),
                        ("free", [0]), ("get", 2)]),
             "Chapter 01's pool trace: each touch is one more reference to drop."),
        Case("150 random scripts of get / free / touch, compared with kvlab's BlockPool",
             _random_scripts, "Every line of chapter 01's pool trace, in any order: head in, "
             "head out, the first freed first, all or nothing, one reference per touch."),
        Case("real model: a tight pool (preemption, n=2 forks), same tokens as kvlab",
             _pool_real_model, "The engine frees a request's blocks last block first, shares "
             "blocks between the samples of n=2 with touch, and frees them as samples finish.",
             real_model=True),
    ],
)


# ---- allocate_slots --------------------------------------------------------------------------
def allocate_slots(block_table, num_tokens, block_size, pool):
    """Grow `block_table` in place to cover `num_tokens` tokens; False (taking nothing) if the
    pool has too few free blocks."""
    # A block holds block_size tokens; round up, since a partly filled block is a whole block.
    num_needed = (num_tokens + block_size - 1) // block_size
    # Blocks already in the table stay where they are: only the missing ones are new. (A table
    # can already cover more, e.g. a step that computes fewer tokens than it holds room for.)
    num_new = max(0, num_needed - len(block_table))
    # All or nothing: a request that cannot get every block takes none, and the scheduler
    # decides what to do (preempt someone, or wait).
    if num_new > pool.get_num_free_blocks():
        return False
    block_table.extend(pool.get_new_blocks(num_new))
    return True


ALLOCATE_STUB = '''def allocate_slots(block_table, num_tokens, block_size, pool):
    """Before a step computes a request's first num_tokens tokens, give its block table (a
    list of block ids, changed in place) room for them, as kvlab's KVCacheManager does in the
    allocation table above: afterwards block_table and the pool's free count must be what
    that table would show, and the return value its answer (True or False). A block holds
    block_size tokens. New blocks come only from pool.get_new_blocks(n) (a list of n ids,
    appended in that order); pool.get_num_free_blocks() says how many it has.
    Example: block_size 4, block_table [], num_tokens 8, 4 free blocks -> block_table becomes
    [a, b] (two ids from the pool), 2 free blocks left, returns True.
    """
    raise NotImplementedError("your turn")
'''


def _alloc_case(table_len: int, num_tokens: int, block_size: int, num_free: int):
    """One allocate_slots call, on a pool where a table of `table_len` blocks exists."""
    def run(impl):
        _alloc_compare(impl, table_len, num_tokens, block_size, num_free)
    return run


def _alloc_compare(impl, table_len, num_tokens, block_size, num_free) -> None:
    # kvlab's own manager on one pool, the participant's function on an identical one.
    results = []
    for side in ("kvlab", "yours"):
        manager = KVCacheManager(table_len + num_free + 2, block_size)
        # Block 0 is the null block and another request holds block 1, so the table's blocks
        # are not simply 0, 1, 2, ...
        manager.allocate_slots("other", 1)
        if table_len:
            manager.allocate_slots("r", table_len * block_size)
        pool = IdPool(manager.block_pool)
        table = manager.get_block_ids("r")
        if side == "kvlab":
            ok = manager.allocate_slots("r", num_tokens)
            table = manager.get_block_ids("r")
        else:
            ok = impl(table, num_tokens, block_size, pool)
        results.append((ok, list(table), pool.get_num_free_blocks()))
    (want_ok, want_table, want_free), (ok, table, free) = results
    situation = (f"block_size {block_size}, a table of {table_len} blocks, num_tokens "
                 f"{num_tokens}, {num_free} free blocks")
    if ok != want_ok:
        raise Mismatch(f"{want_ok}", f"{short(ok)}", situation)
    if table != want_table:
        raise Mismatch(f"block_table {want_table}", f"{table}", situation)
    if free != want_free:
        raise Mismatch(f"{want_free} free blocks afterwards", f"{free}", situation)


def _alloc_random(impl) -> None:
    rng = random.Random(2)
    for _ in range(300):
        block_size = rng.choice([1, 2, 3, 4, 16])
        table_len = rng.randint(0, 5)
        num_tokens = rng.randint(max(1, (table_len - 1) * block_size), (table_len + 4) * block_size)
        _alloc_compare(impl, table_len, num_tokens, block_size, rng.randint(0, 5))


class _ParticipantAllocateManager(KVCacheManager):
    """kvlab's KVCacheManager whose allocate_slots is the participant's function (prefix caching
    off, no forks: the paged path of chapter 01)."""

    impl = None

    def allocate_slots(self, request_id, num_tokens, num_computed_tokens=0,
                       new_computed_blocks=(), request=None, *, full_sequence_must_fit=False,
                       has_scheduled_reqs=True) -> bool:
        # The admission gate (scheduler_reserve_full_isl) is kvlab's, not the exercise's.
        if full_sequence_must_fit and not self.full_sequence_fits(request, new_computed_blocks,
                                                                  has_scheduled_reqs=False):
            return False
        pool = IdPool(self.block_pool)
        table = self.get_block_ids(request_id)
        before, free_before = list(table), pool.get_num_free_blocks()
        ok = self.impl(table, num_tokens, self.block_size, pool)
        need = max(0, cdiv(num_tokens, self.block_size) - len(before))
        situation = (f"request {request_id}: {num_tokens} tokens, {len(before)} blocks held, "
                     f"{free_before} free")
        if ok != (need <= free_before):
            raise Mismatch(f"allocate_slots to return {need <= free_before}", short(ok),
                           situation)
        want_len = len(before) + (need if ok else 0)
        if table[: len(before)] != before or len(table) != want_len:
            raise Mismatch(f"a block table of {want_len} blocks starting {before}",
                           short(table), situation)
        if pool.get_num_free_blocks() != free_before - (want_len - len(before)):
            raise Mismatch(f"{free_before - (want_len - len(before))} free blocks afterwards",
                           f"{pool.get_num_free_blocks()}", situation)
        self.req_to_blocks[request_id] = [self.block_pool.blocks[i] for i in table]
        self._note_peak()
        return bool(ok)


def _tight_batches_n1():
    prompts = _real_engine.prompt_ids([9, 10, 11, 12])
    return [[(f"r{i}", {"prompt_token_ids": p}, _real_engine.GREEDY) for i, p in enumerate(prompts)]]


def _allocate_real_model(impl) -> None:
    expected = _real_engine.reference_workload("tight_pool_n1", _TIGHT, _tight_batches_n1,
                                          _preempts, "the workload no longer preempts")
    engine, got = _real_engine.run_with(
        _TIGHT, _tight_batches_n1,
        kv_cache_manager_cls=_real_engine.with_attrs(_ParticipantAllocateManager, impl=impl))
    _real_engine.compare_tokens(expected, got, "your allocate_slots")
    _real_engine.compare_traces(expected, got, "with your allocate_slots the engine")
    _real_engine.check_bookkeeping(engine)


ALLOCATE_SLOTS = Exercise(
    name="allocate_slots",
    chapter="01_contiguous_vs_paged",
    title="Paged allocation: allocate_slots",
    prompt=(
        "Write paged allocation: before a step computes a request's tokens, its block table "
        "must have room for them. Work out the rule from the allocation table above: how many "
        "blocks a call takes, which blocks a table keeps, and what a refused call leaves "
        "behind. The check compares you with kvlab's KVCacheManager, then runs a real engine "
        "whose pool is too small, so requests are refused and preempted."
    ),
    full_version=(
        "kvlab's KVCacheManager.allocate_slots (kvlab/kv_cache.py) keeps each request's table "
        "itself (req_to_blocks) and takes the totals as arguments. On top of this chapter's rule "
        "it copies a shared block before the step writes into it (copy-on-write, chapter 02), "
        "starts a table with prefix-cache hits and keys the blocks the step fills (chapter 05), "
        "and, when the scheduler admits a request, can refuse unless the whole prompt fits now "
        "(scheduler_reserve_full_isl) or would dip into the watermark (chapter 04)."
    ),
    stub=ALLOCATE_STUB,
    hint=(
        "Read the allocation table's rows for A at 3, 4, 5 and 9 tokens: how many blocks does "
        "A hold for each, and how many did each call take? Then B's refused row: what changed? "
        "A count of blocks for n tokens rounds n / block_size up; decide with "
        "pool.get_num_free_blocks() before you call pool.get_new_blocks."
    ),
    solution=allocate_slots,
    cases=[
        Case("an empty table: 5 tokens in blocks of 4 take 2 blocks", _alloc_case(0, 5, 4, 4),
             "Chapter 01's allocation table: A at 5 tokens held 2 blocks of 4. A partly "
             "filled block is a whole block: round up."),
        Case("exactly two blocks' worth: 8 tokens take 2 blocks, not 3", _alloc_case(0, 8, 4, 4),
             "Chapter 01's allocation table: A at 4 tokens held 1 block of 4, not 2. "
             "(8 + 4 - 1) // 4 == 2."),
        Case("one token past a block boundary takes a new block", _alloc_case(2, 9, 4, 3),
             "Chapter 01's allocation table: A went from 2 blocks at 5 tokens to 3 at 9; "
             "token 8 (the 9th) is the first slot of a third block."),
        Case("a table that already covers the tokens takes nothing", _alloc_case(2, 7, 4, 3),
             "Chapter 01's allocation table: A at 4 tokens, already holding the block that 3 "
             "tokens took, took nothing and said True. Only the missing blocks are new."),
        Case("a table longer than needed is left alone", _alloc_case(3, 5, 4, 2),
             "Chapter 01's allocation table: A asked for 7 tokens while holding 3 blocks and "
             "kept all 3. The number of new blocks is never negative, and a table never "
             "shrinks here."),
        Case("exactly as many free blocks as needed: yes", _alloc_case(1, 12, 4, 2),
             "Chapter 01's allocation table: B's last row needed 1 block with 1 free and got "
             "it. needed <= free is enough."),
        Case("one block short: False, and nothing taken", _alloc_case(1, 13, 4, 2),
             "Chapter 01's allocation table: B's refused row left its table and the free count "
             "as they were. Check before you take: a refused request must not keep part of its "
             "blocks (it cannot run on them, and nobody else can use them)."),
        Case("block_size 1", _alloc_case(2, 5, 1, 3),
             "Chapter 01's allocation table with blocks of 1 token: one block per token."),
        Case("300 random calls, compared with kvlab's KVCacheManager", _alloc_random,
             "Every row of chapter 01's allocation table, for any block_size: round up, take "
             "only the missing blocks, all or nothing."),
        Case("real model: a tight pool, same schedule and tokens as kvlab", _allocate_real_model,
             "Every step calls allocate_slots for each request before it runs.", real_model=True),
    ],
)

EXERCISES = [BLOCK_POOL, ALLOCATE_SLOTS]

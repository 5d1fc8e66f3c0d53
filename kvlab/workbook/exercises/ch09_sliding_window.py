"""Chapter 09 exercise: which blocks a sliding-window group gives back while a request runs.

What it teaches: the token at position p of a sliding-window layer reads positions
p - sliding_window + 1 .. p, so before the step that computes position `num_computed_tokens`
every block lying wholly before that window will never be read again: it goes back to the pool
and the null block (id 0) takes its place in the table, so logical block i still holds
positions i x block_size onward. A block the window still reaches in part stays.

Checked against the rule on hand-made and random tables, then plugged into a windowed engine's
window group on the real model: the same tokens as transformers' windowed model, and no more
blocks held than the engine's own rule holds.
"""

from __future__ import annotations

import random

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, short


def remove_skipped_blocks(block_table, num_computed_tokens, sliding_window, block_size):
    """(new table, ids given back) before the step that computes position num_computed_tokens."""
    # The next token (position num_computed_tokens) reads from num_computed_tokens -
    # sliding_window + 1 on: every position before that is skipped from now on.
    num_skipped_tokens = max(0, num_computed_tokens - sliding_window + 1)
    # Only whole blocks go back (a block partly inside the window is still read), and only
    # blocks the table has (the next step may not have been given its blocks yet).
    num_skipped_blocks = min(num_skipped_tokens // block_size, len(block_table))
    table, freed = list(block_table), []
    # From the last skipped block backwards: the blocks before one already given back were
    # given back with it (vLLM's SingleTypeKVCacheManager.remove_skipped_blocks).
    for i in range(num_skipped_blocks - 1, -1, -1):
        if table[i] == 0:
            break
        freed.append(table[i])
        table[i] = 0
    return table, freed


STUB = '''def remove_skipped_blocks(block_table, num_computed_tokens, sliding_window, block_size):
    """A sliding-window group's block table for one request, just before the step that computes
    the token at position num_computed_tokens (tokens 0 .. num_computed_tokens - 1 are in the
    cache). block_table: block ids; logical block i holds positions i * block_size to
    (i + 1) * block_size - 1; 0 is the null block (a block already given back).

    Return (new_table, freed): new_table has the same length, with 0 in place of every block
    that no token from position num_computed_tokens on will read; freed lists the ids given back
    now, each once, in any order. The table may be shorter than the positions computed so far
    would need (the step's own blocks come after this call).
    Example: block_size 4, sliding_window 6, block_table [7, 3, 9], num_computed_tokens 5
    -> ([7, 3, 9], []).
    """
    raise NotImplementedError("your turn")
'''


def _call(impl, table, computed, window, bs):
    out = impl(list(table), computed, window, bs)
    try:
        new, freed = out
        new, freed = list(new), list(freed)
    except (TypeError, ValueError):
        raise Mismatch("(new_table, freed): two lists", short(out)) from None
    return new, freed


def _expect(impl, table, computed, window, bs, why: str) -> None:
    want_table, want_freed = remove_skipped_blocks(table, computed, window, bs)
    new, freed = _call(impl, table, computed, window, bs)
    where = (f"block_table {table}, num_computed_tokens {computed}, sliding_window {window}, "
             f"block_size {bs}")
    if new != want_table:
        raise Mismatch(f"new_table {want_table} ({where})", f"{new}", why)
    if sorted(freed) != sorted(want_freed):
        raise Mismatch(f"freed {sorted(want_freed)} ({where})", f"{sorted(freed)}",
                       "each block given back once, the null block never: " + why)


def _case(table, computed, window, bs, why):
    return lambda impl: _expect(impl, table, computed, window, bs, why)


def _random_tables(impl) -> None:
    rng = random.Random(9)
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 8, 16])
        window = rng.randint(2, 40)
        computed = rng.randint(0, 120)
        n = rng.randint(0, -(-(computed + 1) // bs))
        ids = rng.sample(range(1, 500), n)
        nulls = rng.randint(0, max(0, min(n, (computed - window + 1) // bs)))
        table = [0] * nulls + ids[nulls:]
        _expect(impl, table, computed, window, bs,
                "the chapter's trace: block i is given back once every position in it is "
                "before the window of the token being computed")


def _plugged_into_the_engine(impl) -> str:
    """The participant's rule in place of the window group's own, on the real model."""
    import torch

    from kvlab import LLM, SamplingParams
    from kvlab.bench.hybrid import group_kinds, overrides
    from kvlab.model import windowed_reference

    window, bs = 24, 4
    hf = overrides(window)
    prompts = _real_engine.prompt_ids([50, 33])
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with _real_engine.one_thread():
        counts = {}
        for who in ("kvlab", "yours"):
            llm = LLM(hf_overrides=hf, block_size=bs, kv_cache_tokens=512, max_model_len=128,
                      max_num_batched_tokens=16, debug_checks=True)
            kv = llm.llm_engine.kv_cache_manager
            mgr = kv.managers[group_kinds(llm).index("window")]
            if who == "yours":
                mgr.remove_skipped_blocks = _plug(impl, mgr)
            peak = [0]
            step = llm.llm_engine.step

            def counting_step(step=step, kv=kv, mgr=mgr, peak=peak):
                out = step()
                held = sum(sum(not b.is_null for b in t) for t in mgr.req_to_blocks.values())
                peak[0] = max(peak[0], held)
                return out
            llm.llm_engine.step = counting_step
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
            counts[who] = (peak[0], [o.outputs[0].token_ids for o in outs])
            kv.check_invariants()
        ref = windowed_reference(llm.llm_engine.loaded, hf)
        with torch.inference_mode():
            want = [ref.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    (mine_peak, mine), (kv_peak, _) = counts["yours"], counts["kvlab"]
    if mine != want:
        raise Mismatch("the tokens of transformers' windowed model", "other tokens",
                       "a block the window still reaches was given back: its positions now read "
                       "the null block (or another request's K/V)")
    if mine_peak > kv_peak:
        raise Mismatch(f"at most {kv_peak} window blocks held at once (kvlab's rule)",
                       f"{mine_peak}", "a block wholly before the window is never read again: "
                       "holding it only takes memory from other requests")
    return (f"same tokens as transformers' windowed model; window blocks held at most "
            f"{mine_peak} at once (kvlab's rule: {kv_peak})")


def _plug(impl, mgr):
    """A window manager's remove_skipped_blocks that asks the participant's function."""
    def remove(request_id, num_computed_tokens):
        table = mgr.req_to_blocks.get(request_id)
        if not table:
            return
        ids = [blk.block_id for blk in table]
        new, freed = impl(list(ids), num_computed_tokens, mgr.sliding_window, mgr.block_size)
        by_id = {blk.block_id: blk for blk in table}
        given = []
        for i, (old, now) in enumerate(zip(ids, new)):
            if now == 0 and old != 0:
                given.append(by_id[old])
                table[i] = mgr.null_block
        if given:
            mgr.block_pool.free_blocks(list(reversed(given)))
    return remove


EXERCISE = Exercise(
    name="window_blocks",
    chapter="09_sliding_window",
    title="What a sliding-window group gives back",
    prompt=(
        "Write which blocks a sliding-window group gives back before a step, and the table "
        "that is left. Work it out from the window group's block tables printed above, step by "
        "step: which blocks turned into 0, and at which position. The check compares you with "
        "the rule on many tables, then puts your function inside a windowed engine on the real "
        "model."
    ),
    full_version=(
        "vLLM's SlidingWindowManager.remove_skipped_blocks (vllm/v1/core/"
        "single_type_kv_cache_manager.py) runs from allocate_slots before each step's blocks "
        "are counted, on the tokens already processed (a step still in flight may read the "
        "older blocks), and gives the blocks back last first, stopping at one already null. A "
        "prefix hit starts a table with null blocks where the window has already passed "
        "(add_computed_blocks; this chapter's shared-prefix section), and chunked local "
        "attention (Llama 4) skips whole chunks the same way."
    ),
    stub=STUB,
    hint=(
        "In the printed tables, find the first step at which block 0 became 0: which positions "
        "does that block hold, and which positions does the token computed at that step read? "
        "Then ask the same of the next block."
    ),
    solution=remove_skipped_blocks,
    cases=[
        Case("a short request: nothing is before the window", _case(
            [7, 3, 9], 5, 6, 4, "position 5 reads positions 0-5: every block is still read"),
             "Position p reads p - window + 1 .. p: here from 0."),
        Case("a block the window still reaches in part stays", _case(
            [7, 3, 9, 4], 10, 6, 4, "position 10 reads 5-10: block 0 (0-3) goes, block 1 "
            "(4-7) stays"), "Only a block whose every position is before the window goes back."),
        Case("several blocks at once (a chunk, or a prefix hit)", _case(
            [7, 3, 9, 4, 8, 6], 21, 6, 4, "position 21 reads 16-21: blocks 0-3 go"),
             "After a long chunk the window has moved past many blocks at once."),
        Case("blocks already given back are not given back again", _case(
            [0, 0, 9, 4, 8, 6], 21, 6, 4, "blocks 0 and 1 were null already: only 2 and 3 "
            "go now"), "A 0 in the table is the null block: it is never freed."),
        Case("a table shorter than the skipped positions", _case(
            [7, 3], 40, 6, 4, "position 40 reads 35-40, past both blocks: both go"),
             "Skip only the blocks the table has."),
        Case("a window smaller than a block", _case(
            [7, 3, 9], 9, 2, 4, "position 9 reads 8-9: blocks 0 and 1 go"),
             "The same rule whatever the sizes."),
        Case("300 random tables", _random_tables,
             "Block i holds positions i * block_size .. (i + 1) * block_size - 1."),
        Case("real model: your rule inside a windowed engine's window group",
             _plugged_into_the_engine,
             "Compare the tokens and the blocks held printed above with kvlab's rule.",
             real_model=True, timeout_s=300),
    ],
)

EXERCISES = [EXERCISE]

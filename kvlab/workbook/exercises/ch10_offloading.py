"""Chapter 10 exercise: how many tokens the second tier can supply (the connector's
get_num_new_matched_tokens, on the scheduler's side).

What it teaches: after the pool's own prefix-cache hit, the tier supplies the run of the
request's full blocks it holds from there on, and nothing past its first miss (a block is only
the same prefix if every block before it is); the blocks the pool already found are not loaded
again; a partial last block is never in the tier, and a load may cover the whole prompt (the
scheduler then computes its last token again, for the logits).

Checked against the rule on hand-made and random cases, then plugged into an engine with a
tier on the real model: the tokens must equal an engine without one, and the tier must supply
exactly what kvlab's rule finds.
"""

from __future__ import annotations

import random

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Mismatch, Case, Exercise, short


def tier_hit(block_keys, num_local_tokens, num_tokens, tier_keys, block_size):
    """Tokens the tier can load past the pool's hit of num_local_tokens."""
    first = num_local_tokens // block_size  # the pool's hit is whole blocks
    last = min(len(block_keys), num_tokens // block_size)  # full blocks only
    hits = 0
    for key in block_keys[first:last]:
        if key not in tier_keys:
            break  # a later block is a different prefix without this one
        hits += 1
    return hits * block_size


STUB = '''def tier_hit(block_keys, num_local_tokens, num_tokens, tier_keys, block_size):
    """How many of a waiting request's tokens the second tier can load into the pool.

    block_keys: the prefix-cache keys of the request's full blocks, in order (block i holds
    tokens i * block_size .. (i + 1) * block_size - 1). num_local_tokens: the tokens the pool's
    own prefix cache found for it (a whole number of blocks). num_tokens: the request's tokens.
    tier_keys: the keys the tier holds (a set). Return the number of tokens (an int) the tier
    will supply, loaded into new blocks after the pool's hit.
    """
    raise NotImplementedError("your turn")
'''


def _call(impl, keys, local, n, tier, bs):
    got = impl(list(keys), local, n, frozenset(tier), bs)
    if isinstance(got, bool) or not isinstance(got, int):
        raise Mismatch("an int (tokens)", short(got))
    return got


def _expect(impl, keys, local, n, tier, bs, why: str) -> None:
    want = tier_hit(keys, local, n, tier, bs)
    got = _call(impl, keys, local, n, tier, bs)
    held = "".join("T" if k in tier else "." for k in keys)
    where = (f"{len(keys)} full blocks, tier holds [{held}] (T: held), pool's hit "
             f"{local} tokens, {n} tokens, blocks of {bs}")
    if got != want:
        raise Mismatch(f"{want} tokens ({where})", f"{got}", why)


def _case(held: str, local: int, n: int, bs: int, why: str):
    keys = [f"k{i}" for i in range(len(held))]
    tier = {k for k, h in zip(keys, held) if h == "T"}
    return lambda impl: _expect(impl, keys, local, n, tier, bs, why)


def _random(impl) -> None:
    rng = random.Random(10)
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 8, 16])
        n = rng.randint(1, 200)
        keys = [f"k{i}" for i in range(n // bs)]
        tier = {k for k in keys if rng.random() < 0.8}
        local = rng.randint(0, max(0, (n - 1) // bs)) * bs
        _expect(impl, keys, local, n, tier, bs,
                "the chapter's block maps: the tier's run starts after the pool's hit and stops "
                "at its first missing block")


def _plugged_into_the_engine(impl) -> str:
    """The participant's rule in place of the offloading connector's lookup, on the real
    model: a multi-tenant workload whose pool forgets what the tier keeps."""
    from kvlab import LLM, SamplingParams
    from kvlab.bench.offload import rag_requests

    requests = rag_requests(num_tenants=3, rounds=2, doc_len=70, question_len=10, seed=4)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(block_size=8, kv_cache_tokens=160, max_model_len=96, debug_checks=True)
    runs = {}
    with _real_engine.one_thread():
        for who in ("plain", "kvlab", "yours"):
            llm = LLM(kv_offloading_size=None if who == "plain" else 0.01, **kw)
            conn = llm.llm_engine.kv_connector
            if who == "yours":
                own = conn.get_num_new_matched_tokens

                def ask(request, num_computed, conn=conn, own=own):
                    want, _ = own(request, num_computed)
                    got = _call(impl, request.block_hashes, num_computed, request.num_tokens,
                                set(conn.index), conn.block_size)
                    if got > want:
                        raise Mismatch(f"at most {want} tokens (what the tier holds in a run "
                                       f"after the pool's {num_computed})", f"{got}",
                                       "a block the tier lacks, or one past a missing block, "
                                       "would load the wrong K/V")
                    return got, got > 0
                conn.get_num_new_matched_tokens = ask
            tokens = [llm.generate(r, sp)[0].outputs[0].token_ids for r in requests]
            runs[who] = (tokens, llm.stats()["external_prefix_cache_hits"])
    if runs["yours"][0] != runs["plain"][0]:
        raise Mismatch("the tokens of an engine without a tier", "other tokens")
    if runs["yours"][1] != runs["kvlab"][1]:
        raise Mismatch(f"{runs['kvlab'][1]} tokens supplied by the tier (kvlab's rule)",
                       f"{runs['yours'][1]}", "the tier's run may cover every full block of "
                       "the prompt; it starts where the pool's hit ends")
    return (f"same tokens as without a tier; the tier supplied {runs['yours'][1]} tokens, as "
            "kvlab's rule does")


EXERCISE = Exercise(
    name="tier_hit",
    chapter="10_offloading",
    title="How many tokens the tier can supply",
    prompt=(
        "Write the offloading connector's lookup: how many of a waiting request's tokens the "
        "second tier can load. Work it out from the block maps printed above: which blocks the "
        "pool found, which the tier held, and how many tokens each request loaded. The check "
        "compares you with the rule on many cases, then puts your function inside an engine "
        "with a tier on the real model."
    ),
    full_version=(
        "vLLM's OffloadingConnector.get_num_new_matched_tokens (vllm/distributed/kv_transfer/"
        "kv_connector/v1/offloading/scheduler.py) also returns whether the load is "
        "asynchronous (it is, by default), returns None while a lookup is still pending in a "
        "slower tier (the scheduler asks again next step), looks chunks of several blocks up "
        "at once when the tier's block is bigger than the pool's, and runs a window group's "
        "lookup from the right (chapter 09). The scheduler presents the pool's hit rounded "
        "down to a block, and when the load covers the whole prompt it computes the last "
        "token again, for the logits."
    ),
    stub=STUB,
    hint=(
        "In the printed maps, find a request whose tier held a block after one it lacked: "
        "was that block loaded? And a request whose pool found its first blocks: where did "
        "the tier's load start?"
    ),
    solution=tier_hit,
    cases=[
        Case("nothing in the tier", _case("....", 0, 64, 16, "the tier holds none of them"),
             "No block held: nothing to load."),
        Case("the tier holds every block", _case("TTTT", 0, 70, 16,
             "every full block is held: 4 blocks"), "Only full blocks are ever stored."),
        Case("the pool found the first blocks", _case(".TTTT", 16, 88, 16,
             "the pool has block 0 (the tier lost it): the tier loads blocks 1-4"),
             "The tier's load starts where the pool's hit ends."),
        Case("a block missing in the middle", _case("TT.T", 0, 64, 16,
             "blocks 0-1, then a miss: block 3 is another prefix without block 2"),
             "A block is the same prefix only if every block before it is."),
        Case("a prompt of whole blocks, every block held", _case("TTTT", 0, 64, 16,
             "all 64 tokens; the scheduler computes the last one again for its logits"),
             "The tier may supply the whole prompt (not the pool's rule)."),
        Case("300 random cases", _random, "Count the held blocks from the pool's hit on."),
        Case("real model: your lookup inside an engine with a tier", _plugged_into_the_engine,
             "Compare the tokens supplied printed above with kvlab's rule.", real_model=True,
             timeout_s=300),
    ],
)

EXERCISES = [EXERCISE]

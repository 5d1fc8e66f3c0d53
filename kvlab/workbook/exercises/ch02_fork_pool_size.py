"""Chapter 02 challenge: the smallest KV pool for n forked samples of one prompt.

What it asks: the smallest kv_cache_tokens in which SamplingParams(n=6) on one prompt runs
to its end, forked and copied on write, with nothing preempted: the prompt's full blocks
once, its partly filled last block once per sample. Checked by the arithmetic on other
prompts, then on the real model in the participant's pool beside the smallest
(`_challenge`: the tolerance and the run).
"""

from __future__ import annotations

from kvlab.kv_sizing import blocks_held, pool_tokens
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._challenge import _pool_tokens, _run, _within
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch
from kvlab.sampling import RequestOutputKind, SamplingParams


SAMPLES = dict(prompt_len=40, n=6, max_tokens=20)
# Fork by name: kvlab's default, as vLLM v1's, is child requests.
FORK_POOL = dict(block_size=16, max_model_len=64, parallel_sampling="fork")


def fork_pool_for(prompt_len, n, max_tokens, block_size):
    """The smallest pool, in tokens, that holds n forked samples of one prompt to their end."""
    # The prompt's full blocks are shared by every sample, once. Its partly filled last block
    # is shared too until each sample's first write copies it, so every sample ends with its
    # own copy of it, plus the blocks it fills itself. A sample's last token has no K/V.
    shared = prompt_len // block_size
    own = blocks_held(prompt_len, max_tokens, block_size) - shared
    return pool_tokens(shared + n * own, block_size)


FORK_POOL_STUB = '''def fork_pool_for(prompt_len, n, max_tokens, block_size):
    """Return the smallest kv_cache_tokens in which SamplingParams(n=n, max_tokens=max_tokens)
    (max_tokens >= 2) on one prompt_len-token prompt runs to its end, forked
    (parallel_sampling="fork"), with nothing preempted. The check runs 6 samples of a 40-token prompt on the real model with
    your pool: a pool too small preempts, and one more than 10% above the smallest that works
    fails."""
    raise NotImplementedError("your turn")
'''


def _fork_pool(impl, **workload) -> int:
    return _pool_tokens(impl(**workload), "the pool")


def _fork_arithmetic(impl) -> None:
    """Other prompts, sample counts and block sizes: full and partial last blocks, one sample."""
    # The last two end exactly on a block edge and one token past it.
    for L, n, T, bs in [(32, 4, 8, 16), (10, 3, 30, 8), (100, 2, 2, 32), (47, 1, 17, 16),
                        (64, 8, 64, 16), (16, 4, 17, 16), (20, 3, 14, 16)]:
        _within(_fork_pool(impl, prompt_len=L, n=n, max_tokens=T, block_size=bs),
                fork_pool_for(L, n, T, bs), f"a {L}-token prompt, n={n}, max_tokens={T}, "
                f"blocks of {bs}", "below the smallest pool that works: some sample would run "
                "out of blocks (the real-model case runs one)")


def _fork_measured(impl) -> str:
    got = _fork_pool(impl, **SAMPLES, block_size=FORK_POOL["block_size"])
    best = fork_pool_for(**SAMPLES, block_size=FORK_POOL["block_size"])
    prompt = _real_engine.prompt_ids([SAMPLES["prompt_len"]])
    sp = SamplingParams(n=SAMPLES["n"], max_tokens=SAMPLES["max_tokens"], temperature=0.9,
                        seed=7, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    with _real_engine.one_thread():
        runs = {}
        for name, pool in (("yours", got), ("smallest", best)):
            try:
                runs[name] = _run(dict(FORK_POOL, kv_cache_tokens=pool), prompt, [sp])
            except (ValueError, RuntimeError) as e:
                raise Mismatch(f"an engine with kv_cache_tokens={pool}",
                               f"{type(e).__name__}: {e}") from None
    mine = runs["yours"]
    unshared = SAMPLES["n"] * fork_pool_for(SAMPLES["prompt_len"], 1, SAMPLES["max_tokens"],
                                            FORK_POOL["block_size"])
    line = (f"yours ({got:,} tokens): {mine['preemptions']} preemptions; the smallest that "
            f"works: {best:,} tokens; without sharing {SAMPLES['n']} samples would hold "
            f"{unshared:,}")
    if mine["tokens"] != runs["smallest"]["tokens"]:
        raise Mismatch("the same samples as in the smallest pool", "different samples", line)
    if mine["preemptions"]:
        raise Mismatch("no preemption", line, "which block does every sample copy before its "
                       "first write?")
    _within(got, best, "the pool", "")
    return line


FORK_POOL_SIZE = Exercise(
    name="fork_pool_size",
    chapter="02_copy_on_write",
    title="the pool for n forked samples",
    kind="challenge",
    prompt=(
        "Size the KV pool for SamplingParams(n=6) on one 40-token prompt with 20 new tokens "
        "each, shared by fork and copy-on-write: the smallest kv_cache_tokens in which the six "
        "samples finish with nothing preempted. The check runs your pool on the real model "
        "beside the smallest one that works; a pool more than 10% larger fails too."
    ),
    full_version=(
        "vLLM v1 shares samples as child requests through the prefix cache (later in this "
        "chapter; the cache itself is chapter 05): each child also computes and holds its own "
        "copy of the prompt's last block, full or not, so its pool is a little larger. Beam "
        "search forks and frees every step, so its peak depends on the beams kept."
    ),
    stub=FORK_POOL_STUB,
    hint=(
        "Which of the prompt's blocks do the samples share to the end, and which does every "
        "sample end up holding its own copy of? Then count the blocks each sample fills itself "
        "(its last token has no K/V)."
    ),
    solution=fork_pool_for,
    imports="from kvlab.kv_sizing import blocks_held, pool_tokens",
    cases=[
        Case("seven other prompts, sample counts and block sizes, by the arithmetic",
             _fork_arithmetic, "Chapter 02's scene: full prompt blocks stay shared; each sample ends with its own "
             "partly filled block (n - 1 copies, and the original for the last writer)."),
        Case("real model: 6 samples of a 40-token prompt, in your pool and the smallest",
             _fork_measured, "Compare the preemptions printed above: chapter 02's copy-on-write takes a fresh "
             "block at a sample's first write.", real_model=True,
             timeout_s=300),
    ],
)

EXERCISES = [FORK_POOL_SIZE]

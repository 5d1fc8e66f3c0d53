"""Challenges that size the KV pool: how many tokens of KV memory a workload needs.

    01 kv_pool_size    the smallest pool that runs a burst at once, contiguous and paged
    02 fork_pool_size  the smallest pool for n parallel samples of one prompt, with fork

An operator sizes the pool before the load comes (vLLM: `gpu_memory_utilization` or
`kv_cache_memory_bytes`; kvlab: `kv_cache_tokens`). Too small, and running requests are
preempted and recomputed; too large, and memory that could hold other requests' KV sits idle.
Each check runs the participant's pool on the real model, beside the smallest pool that works,
and counts what ran at once and what was preempted.
"""

from __future__ import annotations

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, positive_int
from kvlab.sampling import RequestOutputKind, SamplingParams

# A pool more than this much above the smallest one that works leaves memory idle.
SLACK = 0.10
MAX_STEPS = 4000  # a pool too small for the workload to finish stops here, reported


def _pool_tokens(value, what: str) -> int:
    return positive_int(value, f"{what}: a number of tokens (an int >= 1)")


def _within(got: int, best: int, what: str, too_small: str) -> None:
    if got < best:
        raise Mismatch(f"{what}: at least {best:,} tokens", f"{got:,}: {too_small}")
    if got > best * (1 + SLACK):
        raise Mismatch(f"{what}: at most {int(best * (1 + SLACK)):,} tokens "
                       f"({SLACK:.0%} above the smallest pool that works, {best:,})",
                       f"{got:,}: {got - best:,} tokens of KV memory never used")


def _run(llm_kwargs: dict, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Run the requests to the end on a fresh engine, stepping by hand so that a pool too small
    to finish cannot hang the check: peak running, preemptions, the tokens."""
    engine = _real_engine.new_engine(**llm_kwargs)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    outs = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [o.token_ids for o in out.outputs]
    else:
        raise Mismatch("every request finishes", f"still running after {MAX_STEPS} steps: the "
                       "pool is too small for the requests it preempts to ever finish")
    return {"peak_running": max((r.num_running for r in engine.step_trace), default=0),
            "preemptions": engine.stats()["num_preemptions"],
            "tokens": [outs[f"r{i}"] for i in range(len(prompts))]}


# ---- 01: the pool a burst needs, contiguous and paged ------------------------------------------
# The burst's prompt lengths; every request generates OUTPUT_LEN tokens, so all of them finish
# in the same step and the pool's peak is their KV at the end. (With different output lengths
# the short ones free their blocks before the long ones need their last: the peak is then a
# simulation, not a sum.)
PROMPT_LENS = [20, 45, 33, 70, 12, 58, 27, 40, 90, 16, 51, 36]
OUTPUT_LEN = 10
LAYOUT = dict(block_size=16, max_model_len=128)


def kv_pool_for(prompt_lens, output_len, block_size, max_model_len):
    """The smallest pools, in tokens, that hold every request's KV to its end at once."""
    # Contiguous reserves a region of max_model_len for each request from its first token
    # (whole blocks). Paged holds whole blocks of what each request has computed: its prompt
    # and every new token but the last, whose K/V no step computes (nothing comes after it).
    region = -(-max_model_len // block_size) * block_size  # -(-a // b): a / b rounded up
    paged = sum(-(-(p + output_len - 1) // block_size) for p in prompt_lens) * block_size
    return {"contiguous": len(prompt_lens) * region, "paged": paged}


POOL_STUB = '''def kv_pool_for(prompt_lens, output_len, block_size, max_model_len):
    """Return {"contiguous": tokens, "paged": tokens}: for each layout, the smallest
    kv_cache_tokens in which every request runs at once, to its end, with nothing preempted.
    prompt_lens: one prompt length per request, all arriving together, each then generating
    output_len new tokens (so they all finish in the same step); block_size: tokens per block;
    max_model_len: the longest request the engine accepts. The check runs a burst of 12
    through both layouts on the real model with your pools: everyone must run at once and
    nobody be preempted, and a pool more than 10% above the smallest that works fails too."""
    raise NotImplementedError("your turn")
'''


def _pools(impl, prompt_lens, output_len, block_size, max_model_len) -> dict:
    value = impl(list(prompt_lens), output_len, block_size, max_model_len)
    if not isinstance(value, dict) or set(value) != {"contiguous", "paged"}:
        raise Mismatch('{"contiguous": tokens, "paged": tokens}', repr(value)[:80])
    return {k: _pool_tokens(v, k) for k, v in value.items()}


def _pool_arithmetic(impl) -> None:
    """Other bursts, block sizes and context lengths, so that two constants cannot pass."""
    # The last: each request's K/V ends one token past a block edge (one token of output).
    for lens, out, bs, max_len in [([10] * 4, 5, 8, 64), ([100, 3, 64], 28, 32, 256),
                                   ([17, 16, 31], 16, 16, 48), ([17, 33, 49], 1, 16, 64)]:
        got, best = _pools(impl, lens, out, bs, max_len), kv_pool_for(lens, out, bs, max_len)
        for layout in ("contiguous", "paged"):
            _within(got[layout], best[layout], f"{layout}, prompts of {lens} tokens, "
                    f"{out} new tokens each, blocks of {bs}, max_model_len {max_len}",
                    "below the smallest pool that works: some request would run out of "
                    "blocks (the real-model case runs one)")


def _pool_measured(impl) -> str:
    got = _pools(impl, PROMPT_LENS, OUTPUT_LEN, **LAYOUT)
    best = kv_pool_for(PROMPT_LENS, OUTPUT_LEN, **LAYOUT)
    prompts = _real_engine.prompt_ids(PROMPT_LENS)
    params = [SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY)] * len(prompts)
    runs = {}
    with _real_engine.one_thread():
        for layout in ("paged", "contiguous"):
            try:
                runs[layout] = _run(dict(LAYOUT, kv_layout=layout, kv_cache_tokens=got[layout],
                                         max_num_seqs=len(prompts),
                                         max_num_batched_tokens=sum(PROMPT_LENS)),
                                    prompts, params)
            except (ValueError, RuntimeError) as e:  # the engine refused the pool
                raise Mismatch(f"{layout}: an engine with kv_cache_tokens={got[layout]}",
                               f"{type(e).__name__}: {e}") from None
    lines = "; ".join(f"{layout} ({got[layout]:,} tokens): {r['peak_running']} of {len(prompts)} "
                      f"running at once, {r['preemptions']} preemptions"
                      for layout, r in runs.items())
    if runs["paged"]["tokens"] != runs["contiguous"]["tokens"]:
        raise Mismatch("the same tokens in both layouts", "different tokens", lines)
    for layout, r in runs.items():
        if r["preemptions"] or r["peak_running"] < len(prompts):
            raise Mismatch(f"{layout}: all {len(prompts)} running at once, none preempted",
                           lines, "count what each layout holds for a request at its last step")
    for layout in ("contiguous", "paged"):
        _within(got[layout], best[layout], layout, "")
    return (f"{lines}. Contiguous needs {best['contiguous'] / best['paged']:.1f}x the paged pool "
            f"for the same burst: it reserves max_model_len for requests of "
            f"{sum(PROMPT_LENS) / len(prompts) + OUTPUT_LEN:.0f} tokens on average")


KV_POOL_SIZE = Exercise(
    name="kv_pool_size",
    chapter="01_contiguous_vs_paged",
    title="the KV pool a burst needs, in each layout",
    kind="challenge",
    prompt=(
        "Size the KV pool for a burst of 12 requests of known prompt lengths, each generating "
        "10 tokens, once for the contiguous layout and once for the paged one: the smallest "
        "kv_cache_tokens in which all of them "
        "run at once and none is preempted. The check runs both layouts on the real model with "
        "your pools and fails a pool that is too small (preemption, or someone waits) or more "
        "than 10% too large (memory no request uses)."
    ),
    full_version=(
        "A real server does not know its requests' output lengths: vLLM sizes the pool from the "
        "memory left after the weights (gpu_memory_utilization or kv_cache_memory_bytes) and "
        "lets the scheduler preempt when it runs out (chapter 03). Prefix caching (chapter 05) "
        "and fork (chapter 02) let requests share blocks, so the same pool holds more."
    ),
    stub=POOL_STUB,
    hint=(
        "Contiguous: what does a request reserve at its first token? Paged: whole blocks of "
        "what the request has computed at its last step. Does any step compute the K/V of the "
        "last new token?"
    ),
    solution=kv_pool_for,
    cases=[
        Case("four other bursts, by the arithmetic", _pool_arithmetic,
             "Count whole blocks per request, then tokens: blocks x block_size."),
        Case("real model: 12 requests, both layouts, with your pools", _pool_measured,
             "Compare the running and preempted counts printed above.", real_model=True,
             timeout_s=300),
    ],
)


# ---- 02: the pool for n parallel samples, with fork ---------------------------------------------
SAMPLES = dict(prompt_len=40, n=6, max_tokens=20)
FORK_POOL = dict(block_size=16, max_model_len=64)


def fork_pool_for(prompt_len, n, max_tokens, block_size):
    """The smallest pool, in tokens, that holds n forked samples of one prompt to their end."""
    # The prompt's full blocks are shared by every sample, once. Its partly filled last block
    # is shared too until each sample's first write copies it, so every sample ends with its
    # own copy of it, plus the blocks it fills itself. A sample's last token has no K/V.
    if max_tokens == 1:  # the one token comes from the prefill: no sample writes, none copies
        return -(-prompt_len // block_size) * block_size  # -(-a // b): a / b rounded up
    shared = prompt_len // block_size
    own = -(-(prompt_len + max_tokens - 1) // block_size) - shared
    return (shared + n * own) * block_size


FORK_POOL_STUB = '''def fork_pool_for(prompt_len, n, max_tokens, block_size):
    """Return the smallest kv_cache_tokens in which SamplingParams(n=n, max_tokens=max_tokens)
    on one prompt_len-token prompt runs to its end, forked (kvlab's default), with nothing
    preempted. The check runs 6 samples of a 40-token prompt on the real model with your pool:
    a pool too small preempts, and one more than 10% above the smallest that works fails."""
    raise NotImplementedError("your turn")
'''


def _fork_pool(impl, **workload) -> int:
    return _pool_tokens(impl(**workload), "the pool")


def _fork_arithmetic(impl) -> None:
    """Other prompts, sample counts and block sizes: full and partial last blocks, one sample."""
    # The last two end exactly on a block edge and one token past it.
    for L, n, T, bs in [(32, 4, 8, 16), (10, 3, 30, 8), (100, 2, 1, 32), (47, 1, 17, 16),
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
        "(its last token has no K/V). And if max_tokens is 1, does any sample write at all?"
    ),
    solution=fork_pool_for,
    cases=[
        Case("seven other prompts, sample counts and block sizes, by the arithmetic",
             _fork_arithmetic, "Full prompt blocks once; the partial one once per sample."),
        Case("real model: 6 samples of a 40-token prompt, in your pool and the smallest",
             _fork_measured, "Compare the preemptions printed above.", real_model=True,
             timeout_s=300),
    ],
)

EXERCISES_01 = [KV_POOL_SIZE]
EXERCISES_02 = [FORK_POOL_SIZE]

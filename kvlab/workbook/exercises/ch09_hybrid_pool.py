"""Chapter 09 challenge: the KV pool a burst needs on the windowed model.

What it asks: the fewest bytes (kv_cache_memory_bytes) in which a burst of equal requests starts
together (every one let in at the first step) and runs to its end with nothing preempted, on the packaged model with a window on every other
layer. Too few bytes and requests wait or are preempted; too many and memory sits idle. The
full-attention group holds every block to the end; the window group holds the whole prompt right
after the prefill, then only its window. Checked by the arithmetic on other bursts, then on the
real model: the participant's bytes, and the fewest bytes that work, found by a search on the
same engine.
"""

from __future__ import annotations

from kvlab.kv_cache_interface import cdiv
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._challenge import _run
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, positive_int
from kvlab.sampling import RequestOutputKind, SamplingParams

BURST = dict(num_requests=8, prompt_len=44, output_len=60, block_size=8, sliding_window=32)
SLACK = 0.25  # a pool more than this much above the fewest bytes that work leaves memory idle


def choose_hybrid_pool(num_requests, prompt_len, output_len, block_size, sliding_window,
                       block_bytes):
    """The fewest bytes in which the burst starts together and ends with nothing preempted."""
    # At its end a request holds, in the full-attention group, whole blocks of its prompt and
    # every new token but the last (chapter 01); in the window group, the blocks its window
    # spans, which need not start on a block's edge: one block more than the window fills.
    at_end = (cdiv(prompt_len + output_len - 1, block_size)
              + cdiv(sliding_window, block_size) + 1)
    # Right after the prefill both groups hold the whole prompt, and the next step's token
    # (scheduled before the prefill's result is read: async scheduling) before the window
    # group gives anything back.
    after_prefill = 2 * cdiv(prompt_len + 1, block_size)
    # The requests run in step, so their peaks come together; block 0, the null block, is
    # never handed out.
    return (num_requests * max(at_end, after_prefill) + 1) * block_bytes


STUB = '''def choose_hybrid_pool(num_requests, prompt_len, output_len, block_size, sliding_window,
                       block_bytes):
    """Return kv_cache_memory_bytes (an int) for a burst of num_requests requests arriving
    together, each its own prompt_len-token prompt (nothing shared) then output_len new tokens,
    on this chapter's windowed model (a window of sliding_window tokens on every other layer:
    two KV cache groups, blocks of block_size tokens). block_bytes: the bytes of one block id (a
    page in every layer of one group); the pool is your bytes in whole blocks, block 0 (the null
    block) among them. The check runs the burst on the real model in your bytes: every request
    must be let in at the first step and run to its end with nothing preempted, and your bytes
    may be at most 25% above the fewest that do, found by a search on the same engine."""
    raise NotImplementedError("your turn")
'''


def _block_bytes(block_size: int) -> int:
    """One block id of the windowed packaged model: a page (K and V of block_size tokens, 3 KV
    heads of 64 float32 values) in each of a group's 15 layers."""
    return 15 * 2 * block_size * 3 * 64 * 4


def _choice(impl, **workload) -> int:
    return positive_int(impl(**workload, block_bytes=_block_bytes(workload["block_size"])),
                        "kv_cache_memory_bytes (an int >= 1)")


def _hybrid_arithmetic(impl) -> None:
    """Other bursts (so that a constant cannot pass): at least the bytes the reference needs,
    at most 25% more. The reference is the engine's own minimum for each (a test measures it)."""
    # (requests, prompt, output, block size, window): the output sets the peak in all but the
    # third, where the prompt is long and the output short (the peak is right after prefill).
    for n, p, o, bs, w in [(6, 21, 80, 8, 32), (4, 30, 90, 4, 24), (8, 61, 9, 8, 16),
                           (10, 13, 48, 8, 16)]:
        work = dict(num_requests=n, prompt_len=p, output_len=o, block_size=bs, sliding_window=w)
        got, best = _choice(impl, **work), choose_hybrid_pool(**work, block_bytes=_block_bytes(bs))
        where = (f"{n} requests of {p} + {o} tokens, blocks of {bs}, window {w} "
                 f"({_block_bytes(bs):,} bytes a block)")
        if got < best:
            raise Mismatch(f"at least {best:,} bytes ({where})", f"{got:,}",
                           "count each request's blocks in both groups at its peak: the full-"
                           "attention group to the end (chapter 01's p + N - 1), the window "
                           "group's plateau (this chapter's figure), and both groups right after "
                           "the prefill; then block 0")
        if got > best * (1 + SLACK):
            raise Mismatch(f"at most {int(best * (1 + SLACK)):,} bytes, {SLACK:.0%} above the "
                           f"fewest ({best:,}; {where})", f"{got:,}",
                           "the window group does not grow with the request: count only the "
                           "blocks its window spans")


def _burst_fits(num_blocks: int, prompts, params) -> dict:
    from kvlab.bench.hybrid import overrides

    b = BURST
    return _run(dict(hf_overrides=overrides(b["sliding_window"]), block_size=b["block_size"],
                     kv_cache_memory_bytes=num_blocks * _block_bytes(b["block_size"]),
                     max_model_len=b["prompt_len"] + b["output_len"],
                     max_num_seqs=b["num_requests"],
                     max_num_batched_tokens=b["num_requests"] * b["prompt_len"],
                     enable_prefix_caching=False), prompts, params)


def _hybrid_measured(impl) -> str:
    b = BURST
    got = _choice(impl, **b)
    block_bytes = _block_bytes(b["block_size"])
    prompts = _real_engine.prompt_ids([b["prompt_len"]] * b["num_requests"])
    params = [SamplingParams(max_tokens=b["output_len"], temperature=0, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY)] * len(prompts)

    def ok(run):  # every request let in at the first step, none preempted
        return run["preemptions"] == 0 and run["first_running"] == b["num_requests"]

    with _real_engine.one_thread():
        try:
            mine = _burst_fits(got // block_bytes, prompts, params)
        except (ValueError, RuntimeError) as e:  # the engine refused the pool
            raise Mismatch(f"an engine with kv_cache_memory_bytes={got:,}",
                           f"{type(e).__name__}: {e}") from None
        verdict = (f"yours, {got:,} bytes ({got // block_bytes} blocks): {mine['first_running']} "
                   f"of {b['num_requests']} started together, {mine['preemptions']} preemptions")
        if not ok(mine):
            raise Mismatch(f"all {b['num_requests']} started together, none preempted", verdict,
                           "too few blocks: count both groups at each request's peak")
        # The fewest blocks that work, searched below yours on the same engine.
        lo, hi = 2, got // block_bytes
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                fits = ok(_burst_fits(mid, prompts, params))
            except (ValueError, RuntimeError):
                fits = False
            lo, hi = (lo, mid) if fits else (mid + 1, hi)
    fewest = lo * block_bytes
    verdict += f"; the fewest that work: {fewest:,} bytes ({lo} blocks)"
    if got > fewest * (1 + SLACK):
        raise Mismatch(f"at most {int(fewest * (1 + SLACK)):,} bytes ({SLACK:.0%} above the "
                       "fewest that work)", verdict,
                       "the window group stops growing: only the blocks its window spans")
    return verdict + f"; yours is {got / fewest:.2f}x the fewest"


HYBRID_POOL = Exercise(
    name="hybrid_pool",
    chapter="09_sliding_window",
    title="a pool for a burst on the windowed model",
    kind="challenge",
    prompt=(
        "Size the KV pool, in bytes, for a burst of requests of equal lengths (nothing shared) "
        "on this chapter's windowed model: every request must start at the first step and run to its end with nothing "
        "preempted, in as few bytes as you can. The figure on the path shows what each group holds as a request "
        "grows. The check tries other bursts, then runs yours on the real model and searches "
        "for the fewest bytes that work; up to 25% above them passes."
    ),
    full_version=(
        "vLLM sizes the pool from the memory left after the weights (gpu_memory_utilization, "
        "or kv_cache_memory_bytes) and admits what fits; the scheduler then counts a window "
        "group's blocks at admission with SlidingWindowSpec.max_admission_blocks_per_request "
        "(vllm/v1/kv_cache_interface.py): the window, the tokens in flight and one block. "
        "Requests of different lengths do not peak together: the pool they need is a "
        "simulation, not a sum (chapter 01's challenge says the same for one group)."
    ),
    stub=STUB,
    hint=(
        "Read the figure: how many blocks does the full-attention group hold at the end, and "
        "how many does the window group level off at? And right after the prompt's step, "
        "what do both groups hold? The requests run in step, so their peaks add up."
    ),
    solution=choose_hybrid_pool,
    imports="from kvlab.kv_cache_interface import cdiv",
    cases=[
        Case("four other bursts, by the arithmetic", _hybrid_arithmetic,
             "Each group's blocks at the request's peak, in whole blocks, and block 0."),
        Case(f"real model: {BURST['num_requests']} requests of {BURST['prompt_len']} + "
             f"{BURST['output_len']} tokens, window {BURST['sliding_window']}, yours against "
             "the fewest bytes that work", _hybrid_measured,
             "Compare the running count and preemptions printed above.", real_model=True,
             timeout_s=600),
    ],
)

EXERCISES = [HYBRID_POOL]

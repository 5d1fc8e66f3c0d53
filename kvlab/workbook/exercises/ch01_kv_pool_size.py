"""Chapter 01 challenge: the smallest KV pool for a burst, contiguous and paged.

What it asks: the smallest kv_cache_tokens in which a burst of 12 requests runs at once, to
its end, with nothing preempted, once per layout. Contiguous reserves max_model_len per
request; paged holds whole blocks of what each request computed. Checked by the arithmetic
on other bursts, then on the real model in both layouts with the participant's pools
(`_challenge`: the tolerance and the run).
"""

from __future__ import annotations

from kvlab.kv_sizing import blocks_held, cdiv, pool_tokens
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._challenge import _pool_tokens, _run, _within
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch
from kvlab.sampling import RequestOutputKind, SamplingParams


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
    region = pool_tokens(cdiv(max_model_len, block_size), block_size)
    paged = pool_tokens(sum(blocks_held(p, output_len, block_size) for p in prompt_lens),
                        block_size)
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
    imports="from kvlab.kv_sizing import blocks_held, cdiv, pool_tokens",
    cases=[
        Case("four other bursts, by the arithmetic", _pool_arithmetic,
             "Chapter 01's count: a paged request holds whole blocks of the tokens it has K/V "
             "for; a contiguous one reserves its whole region at admission. Tokens = blocks x "
             "block_size."),
        Case("real model: 12 requests, both layouts, with your pools", _pool_measured,
             "Compare the running and preempted counts printed above: chapter 01's count of what "
             "a request holds at its last step, in each layout.", real_model=True,
             timeout_s=300),
    ],
)

EXERCISES = [KV_POOL_SIZE]

"""Each pool-sizing challenge's reference answer, run on the real engine: at the answer the burst
runs at once with nothing preempted; one step past it (a block fewer, a seat more) the failure the
challenge names shows. So a reference that counts one rule and a check that counts another
cannot both stand (they size with kvlab/kv_sizing.py), and a workload too easy to tell the
answers apart fails here.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.sampling import RequestOutputKind, SamplingParams
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises import ch01_kv_pool_size as ch01
from kvlab.workbook.exercises import ch02_fork_pool_size as ch02
from kvlab.workbook.exercises import ch03_max_num_seqs as ch03
from kvlab.workbook.exercises import ch08_kv_precision as ch08
from kvlab.workbook.exercises import ch09_hybrid_pool as ch09
from kvlab.workbook.exercises import ch10_tier_size as ch10
from kvlab.workbook.exercises._challenge import _run


def _failed(run: dict, num_requests: int) -> bool:
    """The failures a too-small pool or a too-high limit shows: a preemption, or a request
    that could not run beside the others."""
    return run["preemptions"] > 0 or run["peak_running"] < num_requests


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_kv_pool_size_reference_fits_and_one_block_less_does_not(layout):
    best = ch01.kv_pool_for(ch01.PROMPT_LENS, ch01.OUTPUT_LEN, **ch01.LAYOUT)[layout]
    prompts = _real_engine.prompt_ids(ch01.PROMPT_LENS)
    sp = SamplingParams(max_tokens=ch01.OUTPUT_LEN, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    n = len(prompts)
    runs = {pool: _run(dict(ch01.LAYOUT, kv_layout=layout, kv_cache_tokens=pool, max_num_seqs=n,
                            max_num_batched_tokens=sum(ch01.PROMPT_LENS)), prompts, [sp] * n)
            for pool in (best, best - ch01.LAYOUT["block_size"])}
    assert not _failed(runs[best], n), runs[best]
    assert _failed(runs[best - ch01.LAYOUT["block_size"]], n)


def test_fork_pool_size_reference_fits_and_one_block_less_preempts():
    bs = ch02.FORK_POOL["block_size"]
    best = ch02.fork_pool_for(**ch02.SAMPLES, block_size=bs)
    prompt = _real_engine.prompt_ids([ch02.SAMPLES["prompt_len"]])
    sp = SamplingParams(n=ch02.SAMPLES["n"], max_tokens=ch02.SAMPLES["max_tokens"],
                        temperature=0.9, seed=7, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    fits = _run(dict(ch02.FORK_POOL, kv_cache_tokens=best), prompt, [sp])
    short = _run(dict(ch02.FORK_POOL, kv_cache_tokens=best - bs), prompt, [sp])
    assert fits["preemptions"] == 0
    assert short["preemptions"] > 0


@pytest.mark.slow  # two bursts of 16 on the real model
def test_max_num_seqs_reference_runs_unpreempted_and_one_seat_more_preempts():
    p = ch03.POOL
    best = ch03.choose_max_num_seqs(p["kv_cache_tokens"], p["block_size"],
                                    ch03.BURST["prompt_len"], ch03.BURST["output_len"])
    at, past = ch03._burst_run(best), ch03._burst_run(best + 1)
    assert at["preemptions"] == 0 and at["peak_running"] == best
    assert past["preemptions"] > 0  # admitted with its prompt's blocks, out of room later
    assert past["tokens"] == at["tokens"]  # preemption costs time, never tokens


@pytest.mark.slow  # two bursts of 16 on the real model
def test_kv_precision_reference_bytes_fit_and_one_block_less_does_not():
    from kvlab.kv_quant import get_kv_cache_dtype
    from kvlab.model import load_model

    cfg = load_model().config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    b = ch08.BURST
    # Made-up KLs that pick int8 (the sizing is what is tested here; the KLs are the check's).
    kls = {d: (0.0 if d == "auto" else 1.0) for d in ch08.CHALLENGE_DTYPES}
    kls["int8_per_token_head"] = 0.0
    bpt = {d: get_kv_cache_dtype(d).bytes_per_token(cfg.num_hidden_layers,
                                                   cfg.num_key_value_heads, head_dim,
                                                   torch.float32)
           for d in ch08.CHALLENGE_DTYPES}
    best = ch08.choose_kv_cache(b["num_requests"], b["prompt_len"], b["output_len"],
                                b["block_size"], 1e-3, kls, bpt)
    dtype, nbytes = best["kv_cache_dtype"], best["kv_cache_memory_bytes"]
    assert dtype == "int8_per_token_head"
    at = ch08._burst(dtype, nbytes)
    short = ch08._burst(dtype, nbytes - b["block_size"] * bpt[dtype])
    assert not _failed(at, b["num_requests"]), at
    assert _failed(short, b["num_requests"]), short


@pytest.mark.slow  # ten bursts on the windowed model
@pytest.mark.parametrize("work", [
    dict(ch09.BURST),
    dict(num_requests=6, prompt_len=21, output_len=80, block_size=8, sliding_window=32),
    dict(num_requests=4, prompt_len=30, output_len=90, block_size=4, sliding_window=24),
    dict(num_requests=8, prompt_len=61, output_len=9, block_size=8, sliding_window=16),
    dict(num_requests=10, prompt_len=13, output_len=48, block_size=8, sliding_window=16),
], ids=lambda w: f"{w['num_requests']}x{w['prompt_len']}+{w['output_len']}")
def test_hybrid_pool_reference_fits_and_one_block_less_does_not(work):
    """The challenge's own burst and the four its arithmetic case tries: the reference's bytes
    are the windowed engine's minimum, to the block."""
    from kvlab.bench.hybrid import overrides

    bs = work["block_size"]
    block_bytes = ch09._block_bytes(bs)
    best = ch09.choose_hybrid_pool(**work, block_bytes=block_bytes) // block_bytes
    n, p, o = work["num_requests"], work["prompt_len"], work["output_len"]
    prompts = _real_engine.prompt_ids([p] * n)
    sp = SamplingParams(max_tokens=o, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)

    def run(blocks):
        return _run(dict(hf_overrides=overrides(work["sliding_window"]), block_size=bs,
                         kv_cache_memory_bytes=blocks * block_bytes, max_model_len=p + o,
                         max_num_seqs=n, max_num_batched_tokens=n * p,
                         enable_prefix_caching=False), prompts, [sp] * n)

    def started_together(r):
        return r["preemptions"] == 0 and r["first_running"] == n

    assert started_together(run(best))
    assert not started_together(run(best - 1))


@pytest.mark.slow  # two workloads on the real model, each with a search for the smallest tier
@pytest.mark.parametrize("workload", range(len(ch10.WORKLOADS)))
def test_tier_size_reference_finds_every_hit_within_the_slack_of_the_smallest_tier(workload):
    """Chapter 10: the reference tier finds every cached token an unbounded tier finds, and is
    at most 25% above the smallest tier that does (the check's own search on the engine); on
    the first workload it is that smallest tier exactly, and one block less loses hits."""
    w = ch10.WORKLOADS[workload]
    verdict = ch10._measured(w)(ch10.choose_tier_size)
    assert "smallest tier that finds them all" in verdict
    if workload == 0:
        assert "yours is 1.00x the smallest" in verdict, verdict

"""kvlab/bench/goodput.py: a Poisson workload replayed on the virtual clock, and goodput."""

from __future__ import annotations

import pytest

from kvlab.bench.goodput import SLO, Workload, percentile, replay
from kvlab.engine import LLM
from tests.helpers import assert_no_blocks_held

SMALL = Workload(num_requests=6, rate=4.0, short_prompt=(8, 16), long_prompt=(40, 48),
                 long_share=0.3, output_len=(3, 6), seed=3)


def test_the_workload_is_fixed_by_its_seed_and_follows_its_ranges():
    a, b = SMALL.requests(49152), SMALL.requests(49152)
    assert a == b
    assert [r["arrival_s"] for r in a] == sorted(r["arrival_s"] for r in a)
    assert a[0]["arrival_s"] == 0.0
    for r in a:
        n = len(r["prompt_token_ids"])
        assert 8 <= n <= 16 or 40 <= n <= 48
        assert 3 <= r["output_len"] <= 6
    other = Workload(**{**SMALL.__dict__, "seed": 4}).requests(49152)
    assert other != a


def test_replay_gives_every_request_its_tokens_and_latencies_on_the_virtual_clock():
    llm = LLM(max_model_len=SMALL.max_len(), kv_cache_tokens=512, max_num_seqs=4)
    run = replay(llm, SMALL)
    reqs = SMALL.requests(llm.get_tokenizer().vocab_size)
    assert [r["output_tokens"] for r in run.rows] == [r["output_len"] for r in reqs]
    for row in run.rows:
        assert row["ttft_s"] > 0 and row["e2e_s"] >= row["ttft_s"]
        assert 0 < row["tpot_s"] <= row["max_gap_s"]  # the mean gap is at most the worst one
    # The last token comes at the end of the run; nothing is left behind.
    last = max(r["arrival_s"] + r["e2e_s"] for r in run.rows)
    assert last == pytest.approx(run.duration_s)
    assert_no_blocks_held(llm)
    # The same prompts through generate() give the same greedy tokens.
    from kvlab.sampling import SamplingParams

    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs],
                        [SamplingParams(max_tokens=r["output_len"], temperature=0,
                                        ignore_eos=True) for r in reqs])
    assert run.tokens == [list(o.outputs[0].token_ids) for o in outs]


def test_goodput_counts_the_requests_within_every_bound():
    from kvlab.bench.goodput import Replay

    rows = [{"ttft_s": 0.1, "tpot_s": 0.02, "max_gap_s": 0.05},
            {"ttft_s": 0.9, "tpot_s": 0.02, "max_gap_s": 0.05},
            {"ttft_s": 0.1, "tpot_s": 0.02, "max_gap_s": 0.50}]
    run = Replay(rows=rows, duration_s=2.0, preemptions=0, steps=10)
    assert run.goodput(SLO()) == 1.5  # no bound: every request is good
    assert run.goodput(SLO(ttft_s=0.5)) == 1.0
    assert run.goodput(SLO(ttft_s=0.5, max_gap_s=0.1)) == 0.5
    assert run.goodput(SLO(tpot_s=0.01)) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5

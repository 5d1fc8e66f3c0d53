"""Compiled FlexAttention on a CPU (`backend="flex", enforce_eager=False`): a run with varied
batch sizes, prompt lengths, chunks, prefix hits and preemptions compiles a bounded number of
graphs, and gives the tokens of `backend="reference"`. What the first GPU run would
otherwise discover, found here with inductor's C++ FlexAttention kernel.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM
from kvlab.bench.compiled_flex import (ENGINE, compile_counters, compiles_since, run_workload,
                                       workload)
from kvlab.config import EngineConfig

STEPS = 48
# The benchmark's engine with half its KV budget, and shorter prompts arriving more often than
# in its 200 steps, so that 48 steps already hold every kind of step.
SMALL = ENGINE | {"kv_cache_tokens": 512}


@pytest.mark.slow
def test_a_varied_run_compiles_two_graphs_and_matches_reference(loaded):
    arrivals = workload(loaded.tokenizer, STEPS, max_prompt_len=120, gaps=(1, 4))
    ref = run_workload(LLM(backend="reference", **SMALL), arrivals, STEPS)
    shapes = ref.step_shapes
    # The run is as varied as it claims: step sizes, batch sizes, chunks, hits, preemptions.
    assert len(shapes) == STEPS
    assert len({t for t, _ in shapes}) >= 10 and len({b for _, b in shapes}) >= 4
    assert max(t for t, _ in shapes) == SMALL["max_num_batched_tokens"]  # a chunked step
    assert ref.stats["prefix_cache_hits"] > 0 and ref.stats["num_preemptions"] > 0, ref.stats

    torch._dynamo.reset()  # count from nothing, whatever ran before in this process
    before = compile_counters()
    flex = run_workload(LLM(backend="flex", enforce_eager=False, **SMALL), arrivals, STEPS)
    compiled = compiles_since(before)
    assert flex.tokens == ref.tokens
    # The first step's shapes compile once; the first step with another padded length compiles
    # once more with the rows symbolic (dynamo's automatic dynamic shapes); nothing after that.
    assert compiled["graphs"] == 2, compiled
    assert len(compiled["recompile_reasons"]) == 1, compiled
    assert "size mismatch" in compiled["recompile_reasons"][0], compiled
    assert compiled["graphs"] < compiled["recompile_limit"]

    # A second engine with the same pool compiles nothing and gives the same tokens.
    before = compile_counters()
    again = run_workload(LLM(backend="flex", enforce_eager=False, **SMALL), arrivals, STEPS)
    assert compiles_since(before)["graphs"] == 0
    assert again.tokens == ref.tokens

    # One with a larger pool compiles one graph (pool-sized shapes stay static; the rows are
    # already symbolic). It preempts less, so by its last step each request has as many tokens
    # or more: the same ones, as far as both went.
    before = compile_counters()
    bigger = run_workload(LLM(backend="flex", enforce_eager=False, **(SMALL | {
        "kv_cache_tokens": 1024})), arrivals, STEPS)
    assert compiles_since(before)["graphs"] == 1
    for rid, tokens in ref.tokens.items():
        n = min(len(tokens), len(bigger.tokens[rid]))
        assert bigger.tokens[rid][:n] == tokens[:n], rid


def test_enforce_eager_is_a_bool_or_none():
    assert EngineConfig(enforce_eager=None).enforce_eager is None
    with pytest.raises(TypeError, match="enforce_eager"):
        EngineConfig(enforce_eager="no")

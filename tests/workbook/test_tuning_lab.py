"""Chapter 07's tuning lab: its settings are refused before any engine is built when they are not
the lab's, its command line is one kvlab serve (and vllm serve) takes, its workload and SLO scale
with the machine's decode step, and on the real model the defaults fail for the reason the
chapter names while the reference passes."""

from __future__ import annotations

import shlex

import pytest

from kvlab.serve import cli
from kvlab.workbook import exercises
from kvlab.workbook.exercises import ch07_tuning_lab as lab
from kvlab.workbook.exercises._common import Mismatch


@pytest.mark.parametrize("bad", [None, [], {"max_num_seqs": 0}, {"max_num_seqs": True},
                                 {"max_num_batched_tokens": 1.5},
                                 {"long_prefill_token_threshold": -1}, {"block_size": 12},
                                 {"kv_cache_dtype": "fp8_e5m2"}, {"chunk": 64}])
def test_settings_outside_the_lab_are_refused_in_words(bad):
    with pytest.raises(Mismatch):
        lab.settings(bad)


def test_the_command_line_is_one_kvlab_serve_parses_to_the_same_settings():
    knobs = {"max_num_seqs": 8, "max_num_batched_tokens": 192, "block_size": 8,
             "kv_cache_dtype": "int8_per_token_head", "long_prefill_token_threshold": 64}
    line = lab.vllm_serve_command(knobs)
    assert line.startswith("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct ")
    args = cli.parser().parse_args(["serve", *shlex.split(line)[3:]])
    for key, value in knobs.items():
        assert getattr(args, key) == value
    assert args.kv_cache_memory_bytes == lab.KV_CACHE_MEMORY_BYTES
    assert args.dtype == "float32"  # the memory was sized at float32
    # Left out, a setting is spelled out at kvlab's default (vLLM's differ by GPU).
    args = cli.parser().parse_args(["serve", *shlex.split(lab.vllm_serve_command({}))[3:]])
    assert (args.max_num_batched_tokens, args.block_size, args.kv_cache_dtype,
            args.long_prefill_token_threshold) == (2048, 16, "auto", 0)


def test_the_clock_prices_int8_decode_steps_higher_and_prompt_tokens_the_same():
    auto, int8 = lab.step_cost({}), lab.step_cost({"kv_cache_dtype": "int8_per_token_head"})
    assert auto == lab.LAB_COST
    assert int8(1, 1) == pytest.approx(lab.INT8_DECODE_FACTOR * auto(1, 1))
    assert int8(129, 1) - int8(1, 1) == pytest.approx(auto(129, 1) - auto(1, 1))
    # The reference's budget, by the same model, fits the gap bound with a few decodes in it.
    ref = lab.my_tuning()["max_num_batched_tokens"]
    assert auto(ref, 4) < lab.MAX_GAP_S < auto(160, 4)


@pytest.mark.slow  # nine runs of the workload on the real model
def test_defaults_fail_for_their_stalls_a_tiny_budget_for_ttft_and_the_reference_passes():
    ref = exercises.check("tuning_lab", lab.my_tuning)
    assert ref, str(ref)
    defaults = exercises.check("tuning_lab", lambda: {})
    assert not defaults and not defaults.not_done
    assert "stalled" in str(defaults) and "chapter 04" in str(defaults)
    tiny = exercises.check("tuning_lab", lambda: {"max_num_batched_tokens": 32})
    assert not tiny and "first tokens came late" in str(tiny)

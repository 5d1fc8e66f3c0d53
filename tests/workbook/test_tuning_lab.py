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


def test_the_workload_and_the_slo_scale_with_the_decode_step():
    slow, fast = lab.workload(0.2), lab.workload(0.05)
    a, b = slow.requests(49152), fast.requests(49152)
    assert [len(r["prompt_token_ids"]) for r in a] == [len(r["prompt_token_ids"]) for r in b]
    assert a[-1]["arrival_s"] == pytest.approx(4 * b[-1]["arrival_s"])
    assert lab.slo(0.2).ttft_s == pytest.approx(4 * lab.slo(0.05).ttft_s)


@pytest.mark.slow  # five runs of the workload on the real model, and three step-cost measurements
def test_defaults_fail_for_their_stalls_and_the_reference_passes():
    ref = exercises.check("tuning_lab", lab.my_tuning)
    assert ref, str(ref)
    defaults = exercises.check("tuning_lab", lambda: {})
    assert not defaults and not defaults.not_done
    assert "stalled" in str(defaults) and "chapter 04" in str(defaults)

"""`python -m kvlab.bench kv-dtype` at a tiny size: the rows' density is what the pool's bytes
say, "auto" agrees with itself exactly, and the quantized rows' differences are measured."""

from __future__ import annotations

import pytest
import torch

from kvlab.bench.kv_dtype import kv_dtype_table, kv_step_time, load_texts, report


def test_the_committed_texts_are_a_few_paragraphs():
    texts = load_texts()
    assert 3 <= len(texts) <= 10 and all(len(t.split()) >= 30 for t in texts)


@pytest.fixture(scope="module")
def rows():
    texts = [t[:300] for t in load_texts()[:2]]
    return kv_dtype_table(("auto", "int8_per_token_head", "int4_per_token_head"),
                          memory_bytes=8 * 2**20, request_len=64, num_prompts=2, prompt_len=12,
                          max_tokens=4, texts=texts, batch=2, context=32, repeats=1,
                          progress=False)


def test_rows_measure_density_against_the_same_bytes(rows):
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "int8_per_token_head",
                                                   "int4_per_token_head"]
    for r in rows:
        block_bytes = r["bytes_per_token"] * 16
        assert r["num_blocks"] == 8 * 2**20 // block_bytes
        # 64 tokens: 4 blocks of 16, from every block but block 0 (the null block).
        assert r["requests_fit"] == (r["num_blocks"] - 1) // 4
    assert rows[0]["requests_fit"] < rows[1]["requests_fit"] < rows[2]["requests_fit"]


def test_auto_is_its_own_reference_and_the_others_are_measured(rows):
    auto = rows[0]
    assert auto["greedy_agreement"] == 1.0 and auto["first_divergence"] == [None, None]
    assert auto["mean_kl"] == 0.0 and auto["loglik_delta"] == 0.0 and auto["kv_io_vs_auto"] == 1
    for r in rows[1:]:
        assert r["mean_kl"] > 0  # a lossy cache changes the distributions: measured
        assert 0.0 <= r["greedy_agreement"] <= 1.0
        assert r["loglik_per_token"] < 0 and r["kv_write_ms"] > 0 and r["kv_read_ms"] > 0
    assert rows[2]["mean_kl"] > rows[1]["mean_kl"]  # 4 bits lose more than 8
    text = report(rows)
    assert "int4_per_token_head" in text and "requests of 64 tokens" in text


def test_step_time_times_both_the_write_and_the_read():
    t = kv_step_time("int8_per_token_head", 2, 3, 64, torch.float32, batch=2, context=32,
                     block_size=16, repeats=1, inner=2)
    assert set(t) == {"write_ms", "read_ms"} and t["write_ms"] > 0 and t["read_ms"] > 0


def test_capacity_by_dtype_holds_more_of_the_burst_in_the_same_bytes():
    from kvlab.bench.kv_dtype import capacity_by_dtype

    rows = capacity_by_dtype(("auto", "int4_per_token_head"), memory_bytes=4 * 2**20,
                             concurrency=4, input_len=16, output_len=4)
    auto, int4 = rows
    # 4 MiB: 5 blocks of 16 at auto (46,080 bytes a token), 40 at int4: 2 and 20 two-block
    # requests at once; auto must preempt or queue, int4 runs the whole burst at once.
    assert [r["num_blocks"] for r in rows] == [4 * 2**20 // (46080 * 16), 4 * 2**20 // (6480 * 16)]
    assert auto["fit_at_once"] < 4 <= int4["fit_at_once"]
    assert int4["preemptions"] == 0 and int4["tok_s"] > 0 and auto["tok_s"] > 0


def test_weights_dtype_table_sets_each_dtype_beside_its_ceiling_and_transformers():
    from kvlab.bench.weights_dtype import report, weights_dtype_table

    result = weights_dtype_table(batches=(1, 2), context=16, steps=2, num_prompts=1,
                                 prompt_len=8, max_tokens=3)
    assert [(r["dtype"], r["batch"]) for r in result["rows"]] == [
        ("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)]
    for r in result["rows"]:
        assert r["step_ms"] > 0 and 0 < r["fraction_of_ceiling"] and r["bound"] in (
            "memory", "compute")
    f32, bf16 = result["agreement"]
    # float32 is the dtype every other test holds kvlab to transformers in: identical here too.
    assert f32["first_divergence_vs_transformers"] == [None]
    assert len(bf16["first_divergence_vs_kvlab_float32"]) == 1
    assert isinstance(result["native_bf16"], bool) and result["native_why"]
    assert "bfloat16" in report(result)

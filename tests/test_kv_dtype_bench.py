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
        assert r["requests_fit"] == r["num_blocks"] // 4  # 64 tokens: 4 blocks of 16
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

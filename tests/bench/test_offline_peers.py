"""The in-process peers (transformers `generate` and `generate_batch` beside kvlab) and the
machine-ceiling arithmetic."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.bench.offline_peers import decode_ceiling, summarize, transformers_generate_batch


def test_generate_batch_peer_gives_kvlab_tokens(loaded, text_ids):
    prompts = [text_ids[:20], text_ids[5:40]]
    theirs = transformers_generate_batch(loaded.hf_model, prompts, 6)
    ours = LLM(max_model_len=128, kv_cache_tokens=1024).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [list(t) for t in theirs] == [o.outputs[0].token_ids for o in ours]


def test_decode_ceiling_arithmetic(loaded):
    rates = {"matmul_flops": 1e11, "bandwidth_bytes": 1e10}
    one = decode_ceiling(1, 100, rates)
    many = decode_ceiling(64, 100, rates)
    # Batch 1 reads every weight for one token: memory-bound; batch 64 is compute-bound here.
    assert one["bound"] == "memory" and many["bound"] == "compute"
    params = sum(p.numel() for p in loaded.hf_model.parameters())
    assert one["step_ms"] >= 1000 * params * 4 / 1e10 - 0.01
    assert many["tok_s"] > one["tok_s"]


def test_the_verdict_counts_every_repeat_and_gives_its_spread():
    """Three rounds: kvlab ahead of generate in all, of generate_batch in two of them only; the
    median's ratio alone would hide the round it lost."""
    times = {"kvlab": [2.0, 4.0, 2.5], "transformers generate": [3.0, 5.0, 4.0],
             "transformers generate_batch": [3.0, 3.0, 3.0]}
    out = summarize(times, useful=100)
    assert out["repeats"] == 3
    assert out["rows"]["kvlab"] == {"useful_tok_s": 40.0, "useful_tok_s_spread": [25.0, 50.0],
                                    "spread_s": [2.0, 4.0]}
    assert out["kvlab_over_generate"] == round(40.0 / 25.0, 2)
    assert out["kvlab_over_generate_batch"] == round(40.0 / 33.3, 2)
    assert out["ratio_spread"] == {"transformers generate": [1.25, 1.6],
                                   "transformers generate_batch": [0.75, 1.5]}
    assert out["kvlab_ahead"] == {"transformers generate": "3/3",
                                  "transformers generate_batch": "2/3"}


@pytest.mark.slow
def test_compare_peers_short_warmup_times_the_checked_run(monkeypatch):
    """The notebook's shortcut: a two-token warm-up per contender, then one run, both checked
    and timed (one timing per row); the full warm-up is a whole untimed run first."""
    from kvlab.bench import offline_peers

    calls = []
    real = offline_peers.transformers_generate_batch

    def counted(hf_model, prompts, max_tokens):
        calls.append((len(prompts), max_tokens))
        return real(hf_model, prompts, max_tokens)

    monkeypatch.setattr(offline_peers, "transformers_generate_batch", counted)
    out = offline_peers.compare_peers(num_requests=2, input_lens=(16, 24), output_lens=(2, 4), repeats=1,
                              warmup="short")
    assert calls == [(1, 2), (2, 4)]  # the warm-up (one request, two tokens), then the timed run
    assert out["identical_to_kvlab"] == {"transformers generate": "2/2",
                                         "transformers generate_batch": "2/2"}
    for row in out["rows"].values():
        low, high = row["spread_s"]
        assert low == high > 0 and row["useful_tok_s"] > 0
    assert out["repeats"] == 1
    assert all(low == high for low, high in out["ratio_spread"].values())
    calls.clear()
    offline_peers.compare_peers(num_requests=2, input_lens=(16, 24), output_lens=(2, 4), repeats=1)
    assert calls == [(2, 4), (2, 4)]  # a whole untimed run, then the timed one
    with pytest.raises(ValueError, match="repeats"):
        offline_peers.compare_peers(repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        offline_peers.compare_peers(warmup="none")


def test_the_ceiling_is_at_the_fastest_matmul_measured(monkeypatch, loaded):
    """The honest ceiling: the arithmetic limit at the fastest kernel measured (oneDNN's packed
    one on a CPU), never torch.mm's slower rate, whose fraction is only reported beside."""
    from kvlab.bench import offline_peers

    rates = {"matmul_flops": 1e10, "peak_matmul_flops": 4e10, "bandwidth_bytes": 1e12}
    monkeypatch.setattr(offline_peers, "machine_rates", lambda **_: rates)
    got = offline_peers.ceiling_fraction(batch=2, input_len=8, output_len=4)
    context = 8 + 4 // 2
    assert got["ceiling"] == decode_ceiling(2, context, dict(rates, matmul_flops=4e10))
    assert got["matmul_gflops"] == 40.0 and got["torch_mm_gflops"] == 10.0
    # A higher ceiling leaves kvlab a smaller share of it.
    assert got["fraction_of_ceiling"] < got["fraction_of_torch_mm_ceiling"]

"""kvlab serve against transformers serve (kvlab.bench.online_peers): the statistics and the
table on synthetic timings, the reasons a server could not run, and a tiny real run."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab.workbook import viz  # noqa: E402
from kvlab.bench import online_peers as sp  # noqa: E402
from kvlab.bench.stream_client import StreamResult  # noqa: E402


def result(ttft, itls, tokens, error=None, text="x"):
    return StreamResult(ttft=ttft, itls=list(itls), completion_tokens=tokens, error=error,
                        text=text)


def row(server, c, tok_s, ttft, itl=10.0):
    return {"server": server, "concurrency": c, "requests": 8, "errors": 0, "first_error": None,
            "output_tokens": 64, "wall_s": 1.0, "output_tok_s": tok_s, "ttft_median_ms": ttft,
            "ttft_p90_ms": ttft * 1.5, "itl_median_ms": itl, "itl_p90_ms": itl * 2,
            "tokens_per_request": [8, 8]}


def test_summarise_medians_p90_and_throughput_over_the_successful_requests():
    ok = [result(t / 10, [t / 100, 2 * t / 100], 8) for t in range(1, 11)]  # TTFT 0.1 .. 1.0 s
    failed = result(None, [], 0, error="500: boom")
    r = sp.summarise("kvlab serve", 4, [*ok, failed], wall_s=2.0)
    assert (r["requests"], r["errors"], r["first_error"]) == (11, 1, "500: boom")
    assert r["ttft_median_ms"] == 550.0  # between 0.5 and 0.6 s
    assert r["ttft_p90_ms"] == 910.0  # rank 8.1 of 0..9: 0.9 + 0.1 * (1.0 - 0.9)
    # ITLs pooled over requests: 0.01..0.10 and 0.02..0.20 (20 gaps); the median sits between
    # the 10th and 11th smallest (0.07 and 0.08).
    assert r["itl_median_ms"] == 75.0
    assert r["itl_p90_ms"] == pytest.approx(162.0)  # rank 17.1: 0.16 + 0.1 * (0.18 - 0.16)
    assert (r["output_tokens"], r["output_tok_s"]) == (80, 40.0)
    assert r["tokens_per_request"] == [8, 8]


def test_summarise_with_nothing_successful_reports_none_not_zero():
    r = sp.summarise("transformers serve", 1, [result(None, [], 0, error="422: x")], wall_s=1.0)
    assert r["ttft_median_ms"] is None and r["itl_p90_ms"] is None
    assert r["output_tok_s"] == 0.0 and r["tokens_per_request"] is None


def test_table_orders_by_concurrency_then_server_and_prints_dashes_for_missing():
    rows = [row("transformers serve", 8, 100.0, 900.0), row("kvlab serve", 8, 150.0, 500.0),
            row("kvlab serve", 1, 30.0, 120.0)]
    rows[0]["itl_median_ms"] = None
    lines = sp.format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["conc", "server", "req"]
    body = lines[2:5]
    assert [line.split()[0] for line in body] == ["1", "8", "8"]
    assert "kvlab serve" in body[1] and "transformers serve" in body[2]
    assert body[1].split()[5] == "150.0" and body[2].split()[8] == "-"


def test_targets_met_not_met_and_not_comparable():
    rows = [row("kvlab serve", 1, 30, 100), row("transformers serve", 1, 20, 120),
            row("kvlab serve", 8, 150, 400), row("transformers serve", 8, 100, 800),
            row("kvlab serve", 16, 200, 700), row("transformers serve", 16, 120, 1500)]
    t = sp.targets(rows)
    assert t == {"throughput_ratio": {"8": 1.5, "16": 1.67}, "ttft_ratio": 0.833, "met": True}
    slower_first_token = [dict(r, ttft_median_ms=130) if r["server"] == "kvlab serve"
                          and r["concurrency"] == 1 else r for r in rows]
    assert sp.targets(slower_first_token)["met"] is False
    behind_at_16 = [dict(r, output_tok_s=100) if r["server"] == "kvlab serve"
                    and r["concurrency"] == 16 else r for r in rows]
    assert sp.targets(behind_at_16)["met"] is False
    only_ours = [r for r in rows if r["server"] == "kvlab serve"]
    assert sp.targets(only_ours) == {"throughput_ratio": {}, "ttft_ratio": None, "met": None}


def test_same_texts_counts_equal_outputs_and_never_a_failed_one():
    a = {1: ["x", "y", None], 8: ["p"]}
    b = {1: ["x", "z", None], 16: ["q"]}
    assert sp.same_texts(a, b) == {"1": "1/3"}


def test_prompts_are_distinct_from_their_first_words_and_the_same_on_each_call():
    ps = sp.make_text_prompts(16, words=24, tag="Run 8, request")
    assert len(set(ps)) == 16 and ps == sp.make_text_prompts(16, words=24, tag="Run 8, request")
    assert len({" ".join(p.split()[:4]) for p in ps}) == 16  # no shared first block
    assert all(len(p.split()) == 24 + 4 for p in ps)
    assert not set(ps) & set(sp.make_text_prompts(16, words=24, tag="Run 1, request"))


def test_loadable_folder_names_the_architecture_and_links_the_weights(tmp_path):
    src = tmp_path / "cache"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": None}))
    (src / "model.safetensors").write_bytes(b"weights")
    out = sp.loadable_folder(src, tmp_path / "copy")
    assert out == tmp_path / "copy"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").read_bytes() == b"weights"
    named = tmp_path / "named"
    named.mkdir()
    (named / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert sp.loadable_folder(named, tmp_path / "unused") == named
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(sp.ServerUnavailable, match="model_type 'gpt2'"):
        sp.loadable_folder(src, tmp_path / "copy2")


def test_cpu_kv_blocks_gives_transformers_kvlabs_kv_budget(tmp_path):
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K and V x 4 bytes = 46,080 bytes a token;
    # 512 MiB (kvlab's CPU default) / (256 tokens a block x 46,080) = 45.5 -> 45 whole blocks.
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_key_value_heads": 3, "hidden_size": 576,
         "num_attention_heads": 9}))
    assert sp.cpu_kv_blocks(tmp_path, 512 * 2**20) == 45
    assert sp.cpu_kv_blocks(tmp_path, 1) == 1  # never zero blocks
    spec = sp.transformers_spec(8000, tmp_path, "cpu", "float32", 45)
    assert spec.argv[spec.argv.index("--cb-num-blocks") + 1] == "45"
    assert "--cb-num-blocks" not in sp.transformers_spec(8000, tmp_path, "cuda", "bfloat16").argv
    assert json.loads(spec.extra["generation_config"])["eos_token_id"] == -1


def test_a_server_that_exits_is_reported_with_its_status_and_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no module named fastapi'); sys.exit(3)"]
    server = sp.ServerProcess(sp.ServerSpec("transformers serve", sp.free_port(), argv, "m"),
                              tmp_path)
    with pytest.raises(sp.ServerUnavailable) as err:
        server.start(timeout_s=60)
    assert "transformers serve exited with status 3 before it served" in str(err.value)
    assert "no module named fastapi" in str(err.value)


def test_missing_serving_extra_is_the_reason_given_and_nothing_is_started(monkeypatch):
    reason = sp.serving_missing()
    assert reason is None  # the notebooks extra installs transformers[serving]
    monkeypatch.setattr(sp, "serving_missing", lambda: "transformers serve needs X")
    monkeypatch.setattr(sp, "measure_server", lambda *a, **k: pytest.fail("started a server"))
    out = sp.compare_servers(servers=("transformers serve",), progress=lambda *a: None)
    assert out["rows"] == [] and out["targets"]["met"] is None
    assert out["unavailable"] == {"transformers serve": "transformers serve needs X"}
    assert sp.report(out) == "transformers serve could not run here: transformers serve needs X"


def test_plot_serve_peers_draws_each_value_with_its_p90_whisker():
    rows = [row("kvlab serve", 1, 30.0, 120.0), row("transformers serve", 1, 20.0, 200.0),
            row("kvlab serve", 8, 150.0, 500.0), row("transformers serve", 8, 90.0, 900.0)]
    fig = viz.plot_serve_peers(rows)
    tput, ttft, itl = fig.axes
    assert sorted(p.get_height() for p in tput.patches) == [20.0, 30.0, 90.0, 150.0]
    assert sorted(p.get_height() for p in ttft.patches) == [120.0, 200.0, 500.0, 900.0]
    assert [t.get_text() for t in tput.get_xticklabels()] == ["1", "8"]
    # each TTFT whisker ends at the p90 (1.5x the median in these rows)
    tops = sorted(max(seg[:, 1]) for coll in ttft.collections for seg in coll.get_segments())
    assert tops == [180.0, 300.0, 750.0, 1350.0]
    assert [t.get_text() for t in tput.get_legend().get_texts()] == ["kvlab serve",
                                                                     "transformers serve"]
    plt.close(fig)


@pytest.mark.slow
def test_tiny_real_run_of_both_servers():
    """Both servers on the packaged model's folder, 2 requests at concurrency 1 and 2, 8 tokens
    each (under a minute here). If transformers serve cannot start, the reason is reported and
    kvlab serve is still measured; with it installed, it must run."""
    out = sp.compare_servers(concurrencies=(1, 2), max_tokens=8, words=24, num_requests=2,
                             progress=lambda *a: None)
    ours = [r for r in out["rows"] if r["server"] == "kvlab serve"]
    assert [r["concurrency"] for r in ours] == [1, 2]
    if sp.serving_missing() is not None:  # no transformers[serving]: the reason is reported
        assert out["unavailable"]["transformers serve"].strip()
        assert "transformers serve could not run here:" in sp.report(out)
    else:  # installed (make setup installs it): it must run, a crash at launch is a failure
        assert out["unavailable"] == {}, out["unavailable"]
        assert len(out["rows"]) == 4
        assert set(out["same_text"]) == {"1", "2"}
    for r in out["rows"]:
        assert r["errors"] == 0, r["first_error"]
        # transformers' KV cache is capped at kvlab's budget (cpu_kv_blocks); uncapped it takes
        # 60% of the free RAM (a full run on a 23 GB machine peaked at 12.8 GB)
        assert r["server_peak_rss_mib"] is None or r["server_peak_rss_mib"] < 4096
        assert r["tokens_per_request"] == [8, 8]  # EOS ignored on both sides: equal lengths
        assert r["ttft_median_ms"] > 0 and r["itl_median_ms"] > 0 and r["output_tok_s"] > 0
    assert out["targets"]["ttft_ratio"] is not None or sp.serving_missing() is not None

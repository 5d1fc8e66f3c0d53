"""`kvlab serve` with a KV connector (chapter 10): vLLM 0.33.0's flags `--kv-offloading-size`,
`--kv-offloading-backend` and `--kv-transfer-config`, checked before the model loads; a server
started from them answering the `openai` client with the offline `LLM`'s greedy text; and
/metrics carrying vLLM's `vllm:external_prefix_cache_*` and `vllm:kv_offload_*` counters, equal
to the engine's own `kv_connector_stats()`.
"""

from __future__ import annotations

import urllib.request

import pytest
from tests.helpers import assert_no_blocks_held, parse_metrics, wait_idle

from kvlab import LLM, SamplingParams
from kvlab.serve import BackgroundServer

openai = pytest.importorskip("openai")

# A 16-block pool (256 tokens) and a 0.02 GiB tier (29 blocks of this model's 720 KiB): the
# pool forgets a prompt within four others, the tier keeps every prompt below.
KNOBS = {"max_model_len": 128, "kv_cache_tokens": 256, "kv_offloading_size": 0.02}
ARGV = ["serve", "--max-model-len", "128", "--kv-cache-tokens", "256",
        "--kv-offloading-size", "0.02", "--enable-prompt-tokens-details"]
PROMPT_LEN = 70  # 4 full blocks and a partial one
GREEDY = {"max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def served():
    """The server `kvlab serve ARGV` starts: `main` runs as on the command line, up to the
    point where it would serve; the engine and options it built are served here instead, on a
    thread, so the test can read the engine's own counters."""
    from kvlab.serve import api_server, cli

    started = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api_server, "serve",
                   lambda llm, host, port, **kw: started.update(llm=llm, app_kwargs=kw))
        cli.main(ARGV)
    llm = started["llm"]
    server = BackgroundServer(llm, **started["app_kwargs"])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield server, llm, client, client.models.list().data[0].id
    server.stop()


def metrics_text(server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def metric(values: dict, name: str, **labels) -> float:
    """The one series of `name` with these labels (kvlab serves one model, engine "0")."""
    (value,) = [v for k, v in values.items() if k.split("{")[0] == name
                and all(f'{key}="{val}"' in k for key, val in labels.items())]
    return value


def test_offloading_flags_map_onto_llm_knobs():
    """vLLM's names and meanings (vllm/config/cache.py, vllm/config/kv_transfer.py): a size in
    GiB, the backend, and the connector as JSON, with vLLM's number suffixes."""
    from kvlab.config import EngineConfig
    from kvlab.serve.cli import checked_engine_kwargs, engine_kwargs, parser

    defaults = engine_kwargs(parser().parse_args(["serve"]))
    assert (defaults["kv_offloading_size"], defaults["kv_offloading_backend"],
            defaults["kv_transfer_config"]) == (None, "native", None)
    assert EngineConfig(**defaults).resolved_kv_transfer_config is None

    kwargs = checked_engine_kwargs(parser().parse_args(
        "serve --kv-offloading-size 0.5 --kv-offloading-backend native".split()))
    assert (kwargs["kv_offloading_size"], kwargs["kv_offloading_backend"]) == (0.5, "native")
    transfer = EngineConfig(**kwargs).resolved_kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.kv_connector_extra_config["cpu_bytes_to_use"] == 1 << 29

    # --kv-transfer-config: JSON, numbers with vLLM's suffixes (80m decimal, 2M binary).
    for text, nbytes in (("80m", 80_000_000), ("2M", 2 << 20), ("123", 123)):
        args = parser().parse_args([
            "serve", "--kv-transfer-config",
            '{"kv_connector": "OffloadingConnector", "kv_load_failure_policy": "recompute", '
            f'"kv_connector_extra_config": {{"cpu_bytes_to_use": {text}, "note": "80m"}}}}'])
        transfer = EngineConfig(**checked_engine_kwargs(args)).resolved_kv_transfer_config
        assert transfer.kv_connector_extra_config == {"cpu_bytes_to_use": nbytes,
                                                      "note": "80m"}  # strings untouched
        assert transfer.kv_load_failure_policy == "recompute"
    args = parser().parse_args([
        "serve", "--kv-transfer-config",
        '{"kv_connector": "ExampleConnector", "kv_role": "kv_producer", '
        '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kvlab-shared"}}'])
    transfer = EngineConfig(**checked_engine_kwargs(args)).resolved_kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("ExampleConnector", "kv_producer")


# (argv after "serve", what stderr must say): each refused with argparse's exit 2.
BAD_FLAGS = [
    (["--kv-offloading-size", "0"], "argument --kv-offloading-size: a size in GiB, > 0"),
    (["--kv-offloading-size", "-1"], "argument --kv-offloading-size: a size in GiB, > 0"),
    (["--kv-offloading-size", "inf"], "argument --kv-offloading-size: a size in GiB, > 0"),
    (["--kv-offloading-size", "lots"], "argument --kv-offloading-size: a size in GiB"),
    (["--kv-offloading-backend", "mooncake"], "argument --kv-offloading-backend: invalid "
                                              "choice: 'mooncake'"),
    (["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"],
     "--kv-offloading-backend='lmcache' needs LMCache's server"),
    (["--kv-transfer-config", "{nope"], "argument --kv-transfer-config: not JSON"),
    (["--kv-transfer-config", "[1, 2]"], "argument --kv-transfer-config: must be a JSON object"),
    (["--kv-transfer-config", '{"kv_connector_extra_config": {"cpu_bytes_to_use": 1.5G}}'],
     "argument --kv-transfer-config: Decimals are not allowed with binary suffixes"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'],
     "--kv-transfer-config: kv_connector='NixlConnector': kvlab has"),
    (["--kv-transfer-config", '{"kv_connector": "ExampleConnector"}'],
     "--kv-transfer-config: ExampleConnector needs kv_connector_extra_config"
     "['shared_storage_path']"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'],
     "--kv-transfer-config: OffloadingConnector needs kv_connector_extra_config"
     "['cpu_bytes_to_use'] > 0"),
    (["--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_all", '
      '"kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}}'],
     "--kv-transfer-config: kv_role='kv_all': must be one of"),
    (["--kv-transfer-config", '{"kv_buffer_device": "cuda"}'],
     "--kv-transfer-config: unknown fields ['kv_buffer_device']"),
    (["--kv-offloading-size", "1", "--kv-transfer-config",
      '{"kv_connector": "ExampleConnector", '
      '"kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}}'],
     "--kv-offloading-size and --kv-transfer-config's ExampleConnector both name a connector"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_connector_flags_are_refused_before_the_model_loads(flags, message, capsys,
                                                                monkeypatch):
    import kvlab.engine
    from kvlab.serve.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded for a command line that is refused")

    monkeypatch.setattr(kvlab.engine, "LLM", no_model)
    with pytest.raises(SystemExit) as info:
        main(["serve", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_what_only_the_model_can_refuse_is_a_clean_error_too(capsys):
    """A KV connector with a quantized KV cache is refused once the model is known (the engine's
    check_connector_config): an argparse-style error, in the flags' words, no traceback."""
    from kvlab.serve.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--max-model-len", "64", "--kv-cache-tokens", "128",
              "--kv-offloading-size", "0.01", "--kv-cache-dtype", "fp8"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvlab: error: --kv-cache-dtype='fp8' with a KV connector" in err, err


def test_served_text_equals_offline_and_metrics_equal_the_engines_stats(served):
    """Three prompts, four others that push them out of the 16-block pool, the three again:
    the second time their full blocks come back from the tier (external hits), the text is the
    offline engine's, and /metrics says what the engine counted."""
    from kvlab.bench import BENCH_TEXT

    server, llm, client, name = served
    text_ids = llm.get_tokenizer()(BENCH_TEXT * 12)["input_ids"]  # conftest's text_ids
    prompts = [text_ids[i * PROMPT_LEN:(i + 1) * PROMPT_LEN] for i in range(7)]
    workload = prompts + prompts[:3]
    got, cached = [], []
    for ids in workload:
        r = client.completions.create(model=name, prompt=ids, **GREEDY)
        got.append(r.choices[0].text)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    offline = LLM(**KNOBS)
    want = [offline.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY))[0]
            .outputs[0].text for ids in workload]
    assert got == want
    assert got[-3:] == got[:3]

    stats = wait_idle(llm)
    assert_no_blocks_held(llm)
    # Each re-asked prompt: its 4 full blocks from the tier, none from the pool (vLLM's
    # cached_tokens counts the connector's tokens as its num_cached_tokens does).
    assert stats["prefix_cache_hits"] == 0
    assert stats["external_prefix_cache_hits"] == 3 * 64
    assert cached == [0] * 7 + [64] * 3
    offline_stats = offline.stats()
    for key in ("external_prefix_cache_queries", "external_prefix_cache_hits",
                "kv_offload_load_bytes", "kv_offload_store_bytes"):
        assert stats[key] == offline_stats[key], key

    text = metrics_text(server)
    values = parse_metrics(text)
    assert metric(values, "vllm:external_prefix_cache_hits_total") == \
        stats["external_prefix_cache_hits"] > 0
    assert metric(values, "vllm:external_prefix_cache_queries_total") == \
        stats["external_prefix_cache_queries"] == len(workload) * PROMPT_LEN
    assert metric(values, "kvlab:external_prefix_cache_preempted_hits_total") == 0
    assert metric(values, "kvlab:kv_load_failures_total") == stats["kv_load_failures"] == 0
    for key in ("load_bytes", "load_time", "store_bytes", "store_time", "allocation_failure"):
        assert metric(values, f"vllm:kv_offload_{key}_total") == \
            pytest.approx(stats[f"kv_offload_{key}"]), key
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers, K and V, block size, kv heads, head dim, fp32
    assert stats["kv_offload_load_bytes"] == 3 * 4 * block_bytes
    assert stats["kv_offload_store_bytes"] == 7 * 4 * block_bytes  # each full block, once
    assert metric(values, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == \
        stats["kv_offload_load_bytes"]
    assert metric(values, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == \
        stats["kv_offload_store_bytes"]
    assert metric(values, "kvlab:kv_offload_tier_blocks") == stats["kv_offload_tier_blocks"] == 29
    assert metric(values, "kvlab:kv_offload_tier_blocks_used") == 28
    # vLLM's types and help texts.
    for name_, help_ in (
            ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
             "cross-instance cache sharing, in terms of number of cached tokens."),
            ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU."),
            ("vllm:kv_offload_allocation_failure",
             "Number of KV offload store allocation attempts that failed.")):
        assert f"# HELP {name_}_total {help_}" in text
        assert f"# TYPE {name_}_total counter" in text
    labels = next(k for k in values if k.startswith("vllm:external_prefix_cache_hits_total"))
    assert f'model_name="{name}"' in labels and 'engine="0"' in labels


def test_a_step_that_only_loads_is_no_iteration(served):
    """A step that only moved the connector's blocks ran no token: vLLM observes no iteration
    for it (IterationStats only for a step with outputs), so iteration_tokens_total does not
    count a 0."""
    from kvlab.scheduler import SchedulerOutput
    from kvlab.serve.prometheus import ServerMetrics

    _, llm, _, _ = served
    m = ServerMetrics(llm, "x")
    m.observe_step(SchedulerOutput(kv_connector_metadata=object()))
    m.observe_step(None)
    out = SchedulerOutput()
    out.total_num_scheduled_tokens = 5
    m.observe_step(out)
    values = parse_metrics(m.exposition().decode())
    assert metric(values, "vllm:iteration_tokens_total_count") == 1
    assert metric(values, "vllm:iteration_tokens_total_sum") == 5

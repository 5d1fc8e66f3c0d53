"""`/metrics` of `kvlab serve`: vLLM's metric names for what kvlab has, through prometheus_client.

Names, types, help texts and bucket boundaries follow vLLM 0.33.0's `vllm/v1/metrics/loggers.py`
and `vllm/v1/metrics/buckets.py`, with its labels `model_name` and `engine` ("0": one engine),
so a vLLM dashboard, and `python -m kvlab.bench reproduce --base-url`, read both servers the
same way. Counters that the engine already keeps (prefix-cache queries and hits, preemptions)
and gauges (running, waiting, KV usage) are read from `LLM.stats()` at scrape time; the
histograms are observed as requests finish and as the block pool reports evictions.

Where kvlab differs: vLLM observes TTFT and each inter-token gap as its engine steps; kvlab
observes a request's whole list when it finishes, so an aborted request adds none. kvlab-only
values keep the `kvlab:` prefix (the re-admitted preempted requests' prefix-cache counters and
the pool's block counts, which vLLM reports only as the usage fraction).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vllm/v1/metrics/buckets.py: TIME_TO_FIRST_TOKEN_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS,
# KV_CACHE_RESIDENCY_BUCKETS.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
KV_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20,
                        30, 60, 120, 300, 600, 1200, 1800)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format


class _EngineState:
    """A custom collector: the engine's own counters and gauges, read when scraped."""

    def __init__(self, llm, labels: dict[str, str]) -> None:
        self.llm, self.labels = llm, labels

    def collect(self):
        s = self.llm.stats()
        names, values = list(self.labels), list(self.labels.values())

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=names)  # exposed as NAME_total
            m.add_metric(values, value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        # vLLM's help texts (vllm/v1/metrics/loggers.py).
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      s["prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      s["prefix_cache_hits"])
        yield counter("vllm:num_preemptions",
                      "Cumulative number of preemption from the engine.", s["num_preemptions"])
        yield gauge("vllm:num_requests_running",
                    "Number of requests in model execution batches.", s["num_running"])
        yield gauge("vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.", s["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s["num_used_blocks"] / s["num_blocks"] if s["num_blocks"] else 0.0)
        # vLLM's info gauge (log_metrics_info, "cache_config"): the config as labels, value 1.
        cfg = self.llm.llm_engine.config
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=[*names, "block_size", "enable_prefix_caching",
                                         "num_gpu_blocks", "prefix_caching_hash_algo"])
        info.add_metric([*values, str(cfg.block_size), str(cfg.enable_prefix_caching),
                         str(cfg.num_blocks), str(cfg.prefix_caching_hash_algo)], 1)
        yield info
        # vLLM exposes no scheduler config; kvlab does, so a client can report the token budget
        # it measured under (vLLM's --max-num-batched-tokens is known only to whoever started it).
        sched = GaugeMetricFamily("kvlab:scheduler_config_info", "kvlab's scheduler knobs",
                                  labels=[*names, "max_num_batched_tokens", "max_num_seqs",
                                          "enable_chunked_prefill"])
        sched.add_metric([*values, str(cfg.max_num_batched_tokens), str(cfg.max_num_seqs),
                          str(cfg.enable_chunked_prefill)], 1)
        yield sched
        # kvlab's own: vLLM counts re-admitted preempted requests apart (PrefixCacheStats) but
        # does not export them; finding their own blocks again would flatter the hit rate.
        yield counter("kvlab:prefix_cache_preempted_queries",
                      "Prompt tokens looked up in the prefix cache by re-admitted preempted "
                      "requests", s["prefix_cache_preempted_queries"])
        yield counter("kvlab:prefix_cache_preempted_hits",
                      "Prompt tokens found in the prefix cache by re-admitted preempted requests",
                      s["prefix_cache_preempted_hits"])
        yield gauge("kvlab:num_used_blocks", "KV blocks in use", s["num_used_blocks"])
        yield gauge("kvlab:num_blocks", "KV blocks in the pool", s["num_blocks"])


class ServerMetrics:
    """One registry per server (never prometheus_client's global one: two servers in one
    notebook must not share counters)."""

    def __init__(self, llm, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": "0"}
        self.registry.register(_EngineState(llm, labels))

        def counter(name, doc):
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        # prometheus_client adds the _total suffix to counters, as vLLM's exposition has.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.kv_block_lifetime = histogram(
            "vllm:kv_block_lifetime_seconds",
            "Histogram of KV cache block lifetime from allocation to eviction. Sampled metrics "
            "(controlled by --kv-cache-metrics-sample).", KV_RESIDENCY_BUCKETS)
        self.kv_block_idle = histogram(
            "vllm:kv_block_idle_before_evict_seconds",
            "Histogram of idle time before KV cache block eviction. Sampled metrics "
            "(controlled by --kv-cache-metrics-sample).", KV_RESIDENCY_BUCKETS)
        self.kv_block_reuse_gap = histogram(
            "vllm:kv_block_reuse_gap_seconds",
            "Histogram of time gaps between consecutive KV cache block accesses. Only the most "
            "recent accesses are recorded (ring buffer). Sampled metrics (controlled by "
            "--kv-cache-metrics-sample).", KV_RESIDENCY_BUCKETS)

    def observe_output(self, out, first: bool) -> None:
        """One RequestOutput reached the server (`first`: the request's first one)."""
        self.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
        if first:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        if out.finished and out.metrics is not None:
            if out.metrics.ttft is not None:
                self.ttft.observe(out.metrics.ttft)
            for gap in out.metrics.itl:
                self.itl.observe(gap)

    def observe_evictions(self, evictions) -> None:
        for e in evictions:
            self.kv_block_lifetime.observe(e.lifetime)
            self.kv_block_idle.observe(e.idle)
            for gap in e.reuse_gaps:
                self.kv_block_reuse_gap.observe(gap)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

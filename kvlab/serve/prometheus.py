"""`/metrics` of `kvlab serve`: vLLM's metric names for what kvlab has, through prometheus_client.

Names, types, help texts and bucket boundaries follow vLLM 0.33.0's `vllm/v1/metrics/loggers.py`
and `vllm/v1/metrics/buckets.py`, with its labels `model_name` and `engine` ("0": one engine),
so a vLLM dashboard, and `python -m kvlab.bench reproduce --base-url`, read both servers the
same way. Counters that the engine already keeps (prefix-cache queries and hits, preemptions)
and gauges (running, waiting, KV usage) are read from `LLM.stats()` at scrape time; the
histograms are observed as requests finish and as the block pool reports evictions.

The per-request families are vLLM's (`vllm/v1/metrics/stats.py`, update_from_finished_request),
observed once per finished sample (vLLM's child request; `request_params_n` once per request):
`vllm:request_success` (label finished_reason, every reason's series present from the start),
`e2e_request_latency_seconds` (arrival to finish), `request_queue_time_seconds` (queued, as
the worker adds it between two steps, to first scheduled), `request_prefill_time_seconds` (first
scheduled to first token), `request_decode_time_seconds` (first to last token),
`request_inference_time_seconds` (first scheduled to last token),
`request_time_per_output_token_seconds` (decode time over the tokens after the first),
`request_prompt_tokens`, `request_generation_tokens`, `request_params_max_tokens` and
`request_params_n`; and `iteration_tokens_total`, per engine step. Arrival is when the HTTP
request came in (`kvlab.serve.serving`), so TTFT and e2e include the wait for the engine.
`vllm:admission_rejections` (label reason) counts the requests `--max-num-queued-reqs` refused
with a 503; such a request never reaches the engine, so it is in no other family.

Where kvlab differs: vLLM observes TTFT and each inter-token gap as its engine steps; kvlab
observes a request's whole list when it finishes, so an aborted request adds none (vLLM does not
count a request its client aborted in the per-request families either). vLLM's
`iteration_tokens_total` counts a prompt in the step that completes it, plus each sampled token;
kvlab's counts the tokens each step's forward ran (a chunk of a prompt where it ran). kvlab-only
values keep the `kvlab:` prefix (the re-admitted preempted requests' prefix-cache counters and
the pool's block counts, which vLLM reports only as the usage fraction).

Chapter 10's KV connectors (`--kv-offloading-size`, `--kv-transfer-config`) add vLLM's
`vllm:external_prefix_cache_queries` and `_hits` (on every server, as vLLM's, at 0 without a
connector) and, with the offloading connector, its `vllm:kv_offload_*` counters: see
`_EngineState._connector_families`.
"""

from __future__ import annotations

import time

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
# vllm/v1/metrics/buckets.py: REQUEST_LATENCY_BUCKETS (the e2e, queue, prefill, decode and
# inference times), ITERATION_TOKENS_BUCKETS, REQUEST_PARAMS_N_BUCKETS.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's FinishReason strings (vllm/v1/engine/__init__.py); kvlab never finishes by repetition,
# but the series is there at 0 as in vLLM's exposition.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# vLLM's ADMISSION_REASONS (vllm/v1/metrics/loggers.py): the limits its API server refuses a
# request by. kvlab has the first (`--max-num-queued-reqs`); the second's series stays at 0, there
# as in vLLM's exposition.
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's request_tokens buckets, capped at
    max_model_len (vllm/v1/metrics/buckets.py)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def _since(start: float | None, end: float | None) -> float:
    """An interval; 0 for a phase the request never reached (an error before its first token)."""
    return end - start if start is not None and end is not None else 0.0


class _EngineState:
    """A custom collector: the engine's own counters and gauges, read when scraped."""

    def __init__(self, llm, labels: dict[str, str]) -> None:
        self.llm, self.labels = llm, labels
        transfer = llm.llm_engine.config.resolved_kv_transfer_config
        self.kv_connector = transfer.kv_connector if transfer is not None else None

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
        yield from self._connector_families(s, counter, gauge)

    def _connector_families(self, s: dict, counter, gauge):
        """Chapter 10: the KV connector's families, from `LLMEngine.kv_connector_stats()`.

        vllm:external_prefix_cache_* are vLLM's PrometheusStatLogger counters
        (vllm/v1/metrics/loggers.py), which it registers on every server, a connector or not,
        with a series per engine from the start: at 0 here too when no connector runs. Like
        vLLM's connector PrefixCacheStats they count first admissions only (a request's prompt
        tokens past the pool's hit, and those the connector supplied); re-admitted preempted
        requests are counted apart, kvlab-only, as for the pool's own counters.

        vllm:kv_offload_* are the OffloadingConnector's own families (OffloadPromMetrics,
        vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py), there only when it
        runs. The five mirrored here are counters in vLLM too (its OffloadingCounterMetadata),
        fed with each transfer's bytes and seconds; kvlab's connector keeps only the running
        totals, which a counter reads the same. vLLM creates a series at the first transfer,
        kvlab's are at 0 from the start. Not mirrored: the per-transfer size histograms
        (vllm:kv_offload_load_size, vllm:kv_offload_store_size: kvlab records no transfer's
        own size), the lookup-delay histograms and vllm:kv_offload_config_info.
        vLLM 0.33.0 also still feeds its deprecated vllm:kv_offload_total_bytes and
        vllm:kv_offload_total_time (label transfer_type, CPU_to_GPU a load, GPU_to_CPU a store)
        for its CPU tier, which the native backend runs: mirrored, from the same totals."""
        yield counter("vllm:external_prefix_cache_queries",
                      "External prefix cache queries from KV connector cross-instance cache "
                      "sharing, in terms of number of queried tokens.",
                      s["external_prefix_cache_queries"])
        yield counter("vllm:external_prefix_cache_hits",
                      "External prefix cache hits from KV connector cross-instance cache "
                      "sharing, in terms of number of cached tokens.",
                      s["external_prefix_cache_hits"])
        yield counter("kvlab:external_prefix_cache_preempted_queries",
                      "Prompt tokens past the pool's hit looked up in the KV connector by "
                      "re-admitted preempted requests",
                      s["external_prefix_cache_preempted_queries"])
        yield counter("kvlab:external_prefix_cache_preempted_hits",
                      "Prompt tokens the KV connector supplied to re-admitted preempted requests",
                      s["external_prefix_cache_preempted_hits"])
        if self.kv_connector is None:
            return
        # vLLM logs a failed load and ends the request (finish_reason "error") or recomputes,
        # by kv_load_failure_policy; it exports no count of them.
        yield counter("kvlab:kv_load_failures",
                      "KV connector loads that failed (the request then failed or recomputed, "
                      "by kv_load_failure_policy)", s["kv_load_failures"])
        if self.kv_connector != "OffloadingConnector":
            return
        for key, doc in (
                ("load_bytes", "Total bytes loaded from offload storage to GPU."),
                ("load_time", "Total load time from offload storage to GPU, in seconds."),
                ("store_bytes", "Total bytes stored from GPU to offload storage."),
                ("store_time", "Total store time from GPU to offload storage, in seconds."),
                ("allocation_failure",
                 "Number of KV offload store allocation attempts that failed.")):
            yield counter(f"vllm:kv_offload_{key}", doc, s[f"kv_offload_{key}"])
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, key in (
                ("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector",
                 "bytes"),
                ("vllm:kv_offload_total_time", "Total time measured by all KV offloading "
                 "operations", "time")):
            family = CounterMetricFamily(name, doc, labels=[*names, "transfer_type"])
            family.add_metric([*values, "CPU_to_GPU"], s[f"kv_offload_load_{key}"])
            family.add_metric([*values, "GPU_to_CPU"], s[f"kv_offload_store_{key}"])
            yield family
        # kvlab's own: the tier's size and fill, in blocks (vLLM reports neither).
        yield gauge("kvlab:kv_offload_tier_blocks", "Blocks the KV offloading tier holds at most",
                    s["kv_offload_tier_blocks"])
        yield gauge("kvlab:kv_offload_tier_blocks_used", "Blocks in the KV offloading tier",
                    s["kv_offload_tier_blocks_used"])


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
        self._per_request_families(labels, llm.llm_engine.config.max_model_len)
        # vLLM's frontend admission counter: counted in the API server, not per engine, so its
        # labels are model_name and reason (no `engine`), as vLLM's.
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"], registry=self.registry)
        self.admission_rejections = {
            reason: rejections.labels(model_name=model_name, reason=reason)
            for reason in ADMISSION_REASONS}

    def _per_request_families(self, labels: dict, max_model_len: int) -> None:
        """vLLM's per-request and per-step families: names, help texts and buckets of
        vllm/v1/metrics/loggers.py (PrometheusStatLogger)."""
        names = list(labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets,
                             registry=self.registry).labels(**labels)

        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=self.registry)
        self.request_success = {reason: success.labels(**labels, finished_reason=reason)
                                for reason in FINISHED_REASONS}
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.request_params_n = histogram("vllm:request_params_n",
                                          "Histogram of the n request parameter.",
                                          REQUEST_PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            tokens)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        latency = {
            "e2e": ("vllm:e2e_request_latency_seconds",
                    "Histogram of e2e request latency in seconds."),
            "queue": ("vllm:request_queue_time_seconds",
                      "Histogram of time spent in WAITING phase for request."),
            "inference": ("vllm:request_inference_time_seconds",
                          "Histogram of time spent in RUNNING phase for request."),
            "prefill": ("vllm:request_prefill_time_seconds",
                        "Histogram of time spent in PREFILL phase for request."),
            "decode": ("vllm:request_decode_time_seconds",
                       "Histogram of time spent in DECODE phase for request."),
        }
        self.request_latency = {key: histogram(name, doc, REQUEST_LATENCY_BUCKETS)
                                for key, (name, doc) in latency.items()}

    def observe_output(self, out, first: bool) -> None:
        """One RequestOutput reached the server (`first`: the request's first one)."""
        self.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
        if first:
            self.prompt_tokens.inc(len(out.prompt_token_ids))

    def observe_step(self, scheduler_output) -> None:
        """One engine step ran the model: the tokens it ran."""
        # A step that only moved a KV connector's blocks (every request waiting for its load)
        # ran no token: vLLM observes an iteration only when its step had outputs
        # (IterationStats, vllm/v1/engine/async_llm.py), so it is not observed here either.
        if scheduler_output is not None and scheduler_output.total_num_scheduled_tokens:
            self.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)

    def observe_finished(self, samples: list, queued: float, stamps,
                         finished_reason: str | None = None) -> None:
        """A request ended: each of its samples (the engine's Requests) as vLLM's
        FinishedRequestStats, from its RequestMetrics' stamps (`time.perf_counter()`, arrival
        the HTTP request's), `queued` (when the worker added it) and `stamps.scheduled(sample)`
        (when its first step was decided). `finished_reason` overrides the samples' own
        ("error" when the engine failed them)."""
        now = time.perf_counter()
        for sample in samples:
            m = sample.metrics
            reason = finished_reason or sample.finish_reason or "abort"
            self.request_success[reason if reason in self.request_success else "error"].inc()
            if m.first_token_time is not None:
                self.ttft.observe(m.ttft)
            for gap in m.itl:
                self.itl.observe(gap)
            last = m.token_times[-1] if m.token_times else None
            scheduled, first = stamps.scheduled(sample), m.first_token_time
            num_generated = len(sample.output_token_ids)
            decode = _since(first, last)
            latency = self.request_latency
            latency["e2e"].observe((m.finished_time or now) - m.arrival_time)
            latency["queue"].observe(max(0.0, _since(queued, scheduled)))
            latency["prefill"].observe(_since(scheduled, first))
            latency["decode"].observe(decode)
            latency["inference"].observe(_since(scheduled, last))
            # vLLM's mean time per output token leaves out the first (the prefill's) token.
            self.request_time_per_output_token.observe(
                decode / (num_generated - 1) if num_generated > 1 else 0.0)
            self.request_prompt_tokens.observe(sample.num_prompt_tokens)
            self.request_generation_tokens.observe(num_generated)
            if sample.sampling_params.max_tokens:
                self.request_params_max_tokens.observe(sample.sampling_params.max_tokens)
        if samples:
            self.request_params_n.observe(samples[0].sampling_params.n)

    def record_admission_rejection(self, reason: str) -> None:
        """A request refused before it entered the engine (`reason`: one of ADMISSION_REASONS)."""
        self.admission_rejections[reason].inc()

    def observe_evictions(self, evictions) -> None:
        for e in evictions:
            self.kv_block_lifetime.observe(e.lifetime)
            self.kv_block_idle.observe(e.idle)
            for gap in e.reuse_gaps:
                self.kv_block_reuse_gap.observe(gap)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

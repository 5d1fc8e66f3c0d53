"""The one table of figures the workbook cites from elsewhere: source, where in it, hardware.

Every number a chapter's prose gives that no cell of the chapter printed is one of these (a test
holds the notebooks to it), and the cells that set this machine's measurements beside another's
read them from here, so a figure is typed once. `show(*keys)` prints the rows a chapter uses.

The public sources come first: the papers, then vLLM 0.33.0's own code. The three articles the
workbook follows ([KV-Anatomy], [Paged-Sim], [Remeasure]) have no public address; they are named
by title in each chapter's sources, with their hardware here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    key: str
    value: float | tuple[float, float]  # a figure, or a (low, high) range the source reports
    unit: str
    source: str  # a paper, a vLLM file, or one of the three articles by its short name
    where: str  # the table, figure or experiment in that source
    hardware: str
    setup: str = ""  # the workload's parameters, as the source gives them

    def text(self) -> str:
        if isinstance(self.value, tuple):
            low, high = self.value
            return f"{low:g}-{high:g} {self.unit}"
        return f"{self.value:,g} {self.unit}"


_PAGED = "Kwon et al., PagedAttention, SOSP 2023 (arXiv 2309.06180)"
_ORCA = "Yu et al., Orca, OSDI 2022"
_SARATHI = "Agrawal et al., Sarathi-Serve, OSDI 2024 (arXiv 2403.02310)"
_KIVI = "Liu et al., KIVI, ICML 2024 (arXiv 2402.02750)"
_GEMMA3 = "Gemma Team, Gemma 3 Technical Report, 2025 (arXiv 2503.19786)"
_ARGS = "vLLM 0.33.0, vllm/engine/arg_utils.py (EngineArgs.get_batch_defaults)"
_A1 = "[KV-Anatomy]"
_A2 = "[Paged-Sim]"
_A3 = "[Remeasure]"
_A1_HW = "one 8 GB-class GPU, Qwen3-1.7B, vLLM 0.31.0"
_A3_HW = "one 8 GB Ada laptop GPU, Qwen3-Reranker-0.6B bf16, vLLM 0.31.0"
_A3_LOOP = "input 256, output 128, 2c requests at concurrency c, first batch a warm-up, median of 3"
_A3_INSERT = "one 900-token decode, five ~3,700-token insertions"
_A3_PREFIX = "a ~3,200-token prefix"
_A3_SALT = "a 3,000-word document, five requests: salt a, a, b, b, none"
_A1_LOAD = "input 512, output 128"
_A1_PREFIX = "a 3,000-token shared prefix, 32-token tails"


def _remeasure(key, value, unit, where, setup=_A3_LOOP) -> Figure:
    return Figure(key, value, unit, _A3, where, _A3_HW, setup)


def _anatomy(key, value, unit, where, setup) -> Figure:
    return Figure(key, value, unit, _A1, where, _A1_HW, setup)


FIGURES: tuple[Figure, ...] = (
    # ---- the papers
    Figure("gemma3.local_window", 1024, "tokens", _GEMMA3,
           "section 2: the span of its local (sliding-window) layers",
           "a model's design, no measurement", "5 local layers to each global layer"),
    Figure("gemma3.context", 131072, "tokens", _GEMMA3,
           "section 2: the context length, 128K tokens (the 1B model: 32K)",
           "a model's design, no measurement"),
    Figure("paged.kv_used_by_tokens", (20.4, 38.2), "%", _PAGED,
           "Figure 2: KV memory holding actual token states in existing systems",
           "NVIDIA A100, 13B model", "13B model on an A100: about 65% of memory weights, 30% KV"),
    Figure("paged.parallel_saving.alpaca", (6.1, 9.8), "%", _PAGED,
           "§6.3, parallel sampling, KV memory saved by sharing", "NVIDIA A100",
           "Alpaca trace, OPT-13B, 2, 4 and 6 parallel samples"),
    Figure("paged.parallel_saving.sharegpt", (16.2, 30.5), "%", _PAGED,
           "§6.3, parallel sampling, KV memory saved by sharing", "NVIDIA A100",
           "ShareGPT trace, OPT-13B, 2, 4 and 6 parallel samples"),
    Figure("paged.beam_saving.alpaca", (37.6, 55.2), "%", _PAGED,
           "§6.3, beam search, KV memory saved by sharing", "NVIDIA A100", "Alpaca trace"),
    Figure("paged.beam_saving.sharegpt", (44.3, 66.3), "%", _PAGED,
           "§6.3, beam search, KV memory saved by sharing", "NVIDIA A100", "ShareGPT trace"),
    # The traces' mean lengths, which chapter 02 runs its like-for-like comparison at.
    Figure("paged.alpaca.mean_input", 19.31, "tokens", _PAGED,
           "Figure 11: input and output lengths of the Alpaca dataset (means)", "no hardware: the dataset itself"),
    Figure("paged.alpaca.mean_output", 58.45, "tokens", _PAGED,
           "Figure 11: input and output lengths of the Alpaca dataset (means)", "no hardware: the dataset itself"),
    Figure("paged.sharegpt.mean_input", 161.31, "tokens", _PAGED,
           "Figure 11: input and output lengths of the ShareGPT dataset (means)",
           "no hardware: the dataset itself"),
    Figure("paged.sharegpt.mean_output", 337.99, "tokens", _PAGED,
           "Figure 11: input and output lengths of the ShareGPT dataset (means)",
           "no hardware: the dataset itself"),
    Figure("orca.throughput_gain", 36.9, "x", _ORCA,
           "abstract and evaluation: requests/s against FasterTransformer at equal latency",
           "16 NVIDIA A100, GPT-3 175B class", "at 190 ms median per-token latency"),
    Figure("sarathi.p99_gap_mixed", 0.68, "s", _SARATHI,
           "generation stall: P99 gap between two tokens, prefills mixed in unchunked",
           "2 NVIDIA A100, Yi-34B", "token budget 1,024"),
    Figure("sarathi.p99_gap_chunked", 0.14, "s", _SARATHI,
           "the same, with chunked prefills and decodes first", "2 NVIDIA A100, Yi-34B",
           "token budget 1,024"),
    Figure("sarathi.capacity_gain", (2.6, 3.7), "x", _SARATHI,
           "serving capacity under tail-latency limits against vLLM",
           "Mistral-7B on 1 NVIDIA A100 (2.6x); Yi-34B on 2 A100 (up to 3.7x)"),
    # ---- vLLM 0.33.0's defaults (by entry point and GPU memory)
    Figure("kivi.batch_gain", 4, "x", _KIVI, "abstract: up to this much larger batch size",
           "the paper's GPU runs of Llama, Falcon and Mistral models",
           "2-bit K per channel and V per token, a recent window kept in full precision"),
    Figure("kivi.throughput_gain", (2.35, 3.47), "x", _KIVI,
           "abstract: throughput on real LLM inference workloads",
           "the paper's GPU runs of Llama, Falcon and Mistral models",
           "2-bit K per channel and V per token, a recent window kept in full precision"),
    Figure("vllm.batched_tokens.large_gpu", 16384, "tokens", _ARGS,
           "max_num_batched_tokens: LLM class (the API server 8,192 under 160 GiB)",
           "70 GiB and more, not an A100 (H100, H200); 160 GiB and more: 16,384 for both",
           "max_num_seqs 1,024"),
    Figure("vllm.batched_tokens.small_gpu", 8192, "tokens", _ARGS,
           "max_num_batched_tokens: LLM class (the API server 2,048)",
           "under 70 GiB, and any A100", "max_num_seqs 256"),
    Figure("vllm.batched_tokens.cpu", 4096, "tokens", _ARGS,
           "max_num_batched_tokens: LLM class (the API server 2,048)", "the CPU backend", ""),
    Figure("vllm.gpu_memory_utilization", 0.92, "", "vLLM 0.33.0, vllm/config/cache.py",
           "CacheConfig.gpu_memory_utilization's default", "any GPU", ""),
    Figure("vllm.docs.cache_salt_length", 43, "characters",
           "vLLM 0.33.0, vllm/entrypoints/openai/completion/protocol.py",
           "cache_salt's field description: random, protected, e.g. 43 characters "
           "base64-encoded (256 bit)", "any", ""),
    # ---- [Paged-Sim]: the allocator simulation
    Figure("paged_sim.contiguous", 19, "requests", _A2, "contiguous manager, admitted at once",
           "pure Python, no GPU",
           "10,000 slots, max_len 512, blocks of 16, 100 requests of lengths uniform in 10-512"),
    Figure("paged_sim.paged", 65, "requests", _A2, "paged manager, admitted at once (about 3.4x)",
           "pure Python, no GPU",
           "10,000 slots, max_len 512, blocks of 16, 100 requests of lengths uniform in 10-512"),
    Figure("paged_sim.block_size_sweet_spot", (16, 32), "tokens per block", _A2,
           "block-size trade-off: small blocks cost table entries and accesses, large ones "
           "waste their last block; the usual sweet spot", "pure Python, no GPU",
           "100 requests of lengths uniform in 10-512, blocks of 4 to 128"),
    # ---- [Remeasure]: the concurrency table (a closed loop)
    _remeasure("remeasure.kv_tokens", 40208, "tokens", "KV capacity of its server",
               "4.3 GiB of KV, 114,688 bytes per token"),
    _remeasure("remeasure.seqs1.c1.tok_s", 174.4, "tok/s", "concurrency table, max_num_seqs 1"),
    _remeasure("remeasure.seqs1.c16.tok_s", 174.6, "tok/s", "concurrency table, max_num_seqs 1"),
    _remeasure("remeasure.seqs1.c16.ttft_ms", 11008, "ms",
               "concurrency table, max_num_seqs 1 (every request queues behind about 15 others)"),
    _remeasure("remeasure.default.c1.tok_s", 174.2, "tok/s", "concurrency table, default server"),
    _remeasure("remeasure.default.c4.tok_s", 593.8, "tok/s", "concurrency table, default server"),
    _remeasure("remeasure.default.c16.tok_s", 1683.1, "tok/s",
               "concurrency table, default server (9.7x its c=1)"),
    _remeasure("remeasure.default.c1.itl_ms", 5.6, "ms", "concurrency table, ITL median"),
    _remeasure("remeasure.default.c16.itl_ms", 8.2, "ms", "concurrency table, ITL median"),
    _remeasure("remeasure.default.c16.ttft_ms", 131.0, "ms", "concurrency table, TTFT median"),
    _remeasure("remeasure.default.c16.itl_p99_ms", 9.4, "ms", "concurrency table, ITL p99"),
    # ---- [Remeasure]: chunked prefill
    _remeasure("remeasure.budget512.c16.tok_s", 1682.7, "tok/s",
               "budget 512 at concurrency 16 (the default's 1,683.1 beside it)"),
    _remeasure("remeasure.budget512.c16.ttft_ms", 86.3, "ms",
               "budget 512 at concurrency 16, TTFT median"),
    _remeasure("remeasure.budget512.c16.itl_p99_ms", 22.9, "ms",
               "budget 512 at concurrency 16, ITL p99"),
    _remeasure("remeasure.chunk.max_gap_ms", (35.6, 197.6), "ms",
               "insertion table: max gap at budget 512, 2,048 (109.8) and 4,096 unchunked",
               _A3_INSERT + ", prefill ~18,000 tok/s"),
    _remeasure("remeasure.chunk.inserted_ttft_ms", (214.1, 232.0), "ms",
               "insertion table: inserted TTFT median at 512 (232.0), 2,048 (216.2), 4,096 "
               "(214.1)", _A3_INSERT),
    # ---- [Remeasure]: prefix caching and cache_salt (two separate runs)
    _remeasure("remeasure.prefix.cold_ms", 174.7, "ms", "prefix experiment: first request",
               _A3_PREFIX + ", caching on"),
    _remeasure("remeasure.prefix.warm_ms", 18.9, "ms",
               "prefix experiment: later requests, median (18.0-19.9), 9.2x",
               _A3_PREFIX + ", caching on"),
    _remeasure("remeasure.prefix.off_ms", (173.8, 173.9), "ms",
               "prefix experiment, caching off: later 173.8, first 173.9", _A3_PREFIX),
    _remeasure("remeasure.salt.miss_ms", 173.9, "ms",
               "salt experiment: a miss (salt a first, and no salt)", _A3_SALT),
    _remeasure("remeasure.salt.hit_ms", 17.9, "ms", "salt experiment: a hit (salt a again)",
               _A3_SALT + "; cached tokens 3,184 or 3,200 (whole blocks)"),
    # ---- [KV-Anatomy]
    _anatomy("kv_anatomy.kv_tokens", 22048, "tokens", "KV capacity (22,048-27,504 by start)",
             "about 34 requests of 512 + 128 tokens"),
    _anatomy("kv_anatomy.c32.tok_s", 831, "tok/s", "capacity table, concurrency 32", _A1_LOAD),
    _anatomy("kv_anatomy.c64.tok_s", 787, "tok/s", "capacity table, concurrency 64", _A1_LOAD),
    _anatomy("kv_anatomy.c32.ttft_ms", 666, "ms", "capacity table, TTFT median", _A1_LOAD),
    _anatomy("kv_anatomy.c64.ttft_s", 5.7, "s", "capacity table, TTFT median (8.6x c=32's)",
             _A1_LOAD),
    _anatomy("kv_anatomy.long.c32.ttft_s", 12.5, "s",
             "past capacity: TTFT median with 7 preemptions", "input 2,048 at concurrency 32"),
    _anatomy("kv_anatomy.chunk.max_gap_ms", (69, 445), "ms",
             "insertion table: max gap at budget 512, 2,048 (227, the default) and unchunked",
             "one 300-token decode, three 3,500-token prompts inserted"),
    _anatomy("kv_anatomy.chunk.ttft_slower", (3, 5), "%",
             "insertion table: the inserted prompt's TTFT with small chunks, against unchunked",
             "one 300-token decode, three 3,500-token prompts inserted"),
    _anatomy("kv_anatomy.prefix.cold_ms", 394, "ms", "prefix table: first request, on",
             _A1_PREFIX),
    _anatomy("kv_anatomy.prefix.warm_ms", 28, "ms", "prefix table: later requests, on",
             _A1_PREFIX),
    _anatomy("kv_anatomy.prefix.off_ms", (393, 395), "ms",
             "prefix table, caching off: first 395, later 393", _A1_PREFIX),
    # The articles give this figure without saying which of their runs it comes from.
    Figure("articles.no_prefix_cost", 1.2, "% of throughput", "[KV-Anatomy] or [Remeasure]",
           "caching on with nothing shared (TTFT median about 8% higher)",
           "an 8 GB GPU, vLLM 0.31.0", "input 2,048, concurrency 32"),
)

BY_KEY = {f.key: f for f in FIGURES}
assert len(BY_KEY) == len(FIGURES), "a key given twice"


def value(key: str):
    """The figure's value (a number, or a (low, high) range)."""
    try:
        return BY_KEY[key].value
    except KeyError:
        raise KeyError(f"no cited figure {key!r}; kvlab.workbook.cited.FIGURES lists them") from None


def show(*keys: str) -> None:
    """Print the rows `keys` name: the figure, its source and where in it, the hardware."""
    for key in keys:
        f = BY_KEY[key]
        setup = f"; {f.setup}" if f.setup else ""
        print(f"{f.text():>16}  {f.source}, {f.where} ({f.hardware}{setup})")

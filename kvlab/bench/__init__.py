"""Benchmarks: kvlab against its peers, side by side in one run, reported as ratios.

    python -m kvlab.bench reproduce [NAME ...]  # the chapters' experiments, JSON and CSV
    python -m kvlab.bench speed            # kvlab vs transformers generate, batch 1 and 16
    python -m kvlab.bench cow              # KV memory saved by block sharing (chapter 02)
    python -m kvlab.bench sched            # continuous batching and chunked prefill targets
    python -m kvlab.bench prefix           # prefix caching and cache_salt targets
    python -m kvlab.bench peers            # transformers generate / generate_batch, the ceiling
    python -m kvlab.bench compiled-flex    # compiled FlexAttention: graphs, tokens, time vs auto
    python -m kvlab.bench kv-dtype         # KV density by precision: bytes, fit, accuracy, cost
    python -m kvlab.bench roofline         # decode batch sweep against this machine's roofline
    python -m kvlab.bench serve-peers      # kvlab serve vs transformers serve (TTFT, ITL, tok/s)
    python -m kvlab.bench client           # stream to any OpenAI-compatible server

Protocol (as the articles the chapters reproduce): one warm-up run excluded, then `repeats` runs; the median and
the spread (min-max) are reported. Both sides generate exactly `max_tokens` tokens (EOS ignored)
greedily from the same prompts on the same weights, and both outputs are checked to be equal, so
the comparison is of the same work.
"""

from kvlab.bench.common import BENCH_TEXT, make_prompts, time_runs, transformers_generate
from kvlab.bench.cow import cow_run, cow_savings, mean_shape_savings
from kvlab.bench.generate_speed import speed

__all__ = ["BENCH_TEXT", "make_prompts", "time_runs", "transformers_generate", "speed",
           "cow_run", "cow_savings", "mean_shape_savings"]

"""Pure functions that return matplotlib figures or text. Widgets (widgets.py) only call these.

Nothing here touches an engine's state: callers pass in numbers or snapshots, so every figure can
be drawn in a test without a browser. Each chapter's figures sit where that chapter would look:

- `axes`: what they all share (byte sizes, request colours, log axes in plain numbers);
- `memory_plots`: chapters 00-02 (KV bytes, the pool as a grid, the allocator simulation, shared blocks);
- `scheduling_plots`: chapters 03-04 (requests over steps, concurrency, capacity, prefill stalls);
- `prefix_plots`: chapters 05-06 (hash chains, cold and warm TTFT, the free queue, the timing attack);
- `bench_plots`: chapter 07 and the benchmarks (peers, the roofline sweep, the API run);
- `precision_plots`: chapter 08 (bytes and accuracy per `kv_cache_dtype`);
- `hybrid_plots`: chapter 09 (blocks per KV cache group, capacity at the same bytes);
- `offload_plots`: chapter 10 (a tier's hits by size, load against recompute, the P/D pair);
- `snapshot`: the engine explorer's picture of one snapshot.

kvlab/workbook/chapters.py names each chapter's modules.

`kvlab.workbook.viz.plot_gantt` and the rest are importable from here, as the chapters call them.
"""

from kvlab.workbook.viz.axes import GIB, format_bytes, log_axis
from kvlab.workbook.viz.bench_plots import plot_api_run, plot_peers, plot_roofline_sweep, plot_serve_peers
from kvlab.workbook.viz.snapshot import (COPY_EDGE, DECODE_COLOUR, MAX_EVENTS_DRAWN, PREFILL_COLOUR,
                                SHARED_COLOUR, draw_snapshot, format_queues)
from kvlab.workbook.viz.hybrid_plots import format_capacity, plot_blocks_per_group
from kvlab.workbook.viz.offload_plots import (format_pair, plot_load_vs_recompute,
                                              plot_pair_timeline, plot_tier_sweep)
from kvlab.workbook.viz.memory_plots import (block_size_summary, draw_memory_map, format_block_tables,
                              plot_block_size_tradeoff, plot_blocks_per_step, plot_cow_savings,
                              plot_kv_memory, plot_no_cache, plot_parallel_sampling, plot_sim)
from kvlab.workbook.viz.prefix_plots import (draw_free_queue, format_hash_chain, free_queue_snapshot,
                              plot_cold_warm_ttft, plot_prefix_hits, plot_ttft_attack)
from kvlab.workbook.viz.scheduling_plots import (plot_capacity, plot_concurrency, plot_gantt, plot_gap_vs_budget,
                                  plot_stall)

__all__ = [
    "format_capacity", "plot_blocks_per_group",
    "format_pair", "plot_load_vs_recompute", "plot_pair_timeline", "plot_tier_sweep",
    "GIB", "format_bytes", "log_axis",
    "plot_api_run", "plot_peers", "plot_roofline_sweep", "plot_serve_peers",
    "COPY_EDGE", "DECODE_COLOUR", "MAX_EVENTS_DRAWN", "PREFILL_COLOUR", "SHARED_COLOUR",
    "draw_snapshot", "format_queues",
    "block_size_summary", "draw_memory_map", "format_block_tables", "plot_block_size_tradeoff",
    "plot_blocks_per_step", "plot_cow_savings", "plot_kv_memory", "plot_no_cache",
    "plot_parallel_sampling", "plot_sim",
    "draw_free_queue", "format_hash_chain", "free_queue_snapshot", "plot_cold_warm_ttft",
    "plot_prefix_hits", "plot_ttft_attack",
    "plot_capacity", "plot_concurrency", "plot_gantt", "plot_gap_vs_budget", "plot_stall",
]

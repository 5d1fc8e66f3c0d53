"""Sliders: thin ipywidgets layers over `viz` functions.

Each slider's work is a plain function (in viz.py) that tests call without a browser; a widget
here only wires a slider to it.
"""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt

from kvlab import viz


def block_size_slider(lengths: list[int], value: int = 16):
    """Move the block size; see internal waste against block-table size (notebook 01)."""

    def draw(block_size: int):
        print(viz.block_size_summary(lengths, block_size))
        fig = viz.plot_block_size_tradeoff(lengths, block_size)
        plt.show()
        plt.close(fig)

    slider = widgets.IntSlider(value=value, min=1, max=128, step=1, description="block_size",
                               continuous_update=False)
    return widgets.interactive(draw, block_size=slider)


def cow_slider(prompt_ids: list[int], max_tokens: int = 16, value: int = 4):
    """Move n (parallel sampling) or the beam width; see blocks in use with and without sharing
    on the real model (notebook 02). Each move runs both engines: a few seconds on a CPU."""
    from kvlab.bench import cow_run

    def draw(kind: str, k: int):
        runs = {f"{label}": cow_run(kind, k, prompt_ids, max_tokens, share)
                for label, share in (("shared", True), ("unshared", False))}
        saved = 1 - runs["shared"]["peak_blocks"] / runs["unshared"]["peak_blocks"]
        print(f"{kind}, k={k}: peak {runs['shared']['peak_blocks']} blocks shared vs "
              f"{runs['unshared']['peak_blocks']} unshared: {saved:.0%} saved, "
              f"{runs['shared']['cow_copies']} copy-on-write copies")
        fig = viz.plot_blocks_per_step({k_: r["blocks_per_step"] for k_, r in runs.items()})
        plt.show()
        plt.close(fig)

    kind = widgets.Dropdown(options=["sampling", "beam"], value="beam", description="kind")
    k = widgets.IntSlider(value=value, min=1, max=8, description="n / width",
                          continuous_update=False)
    return widgets.interactive(draw, kind=kind, k=k)


def chunk_size_slider(long_len: int = 1024, value: int = 128):
    """Move the step's token budget; see the decoding request's gaps while a long prompt is
    prefilled in chunks of that size (notebook 04). Each move runs the real model."""
    from kvlab.bench.scheduling import chunked_prefill_stall

    def draw(budget: int):
        run = chunked_prefill_stall(budget, long_len)
        print(f"budget {budget}: {run.chunks} prefill steps, worst decode gap "
              f"{1000 * run.max_gap:.0f} ms, inserted prompt TTFT {1000 * run.inserted_ttft:.0f} ms")
        fig = viz.plot_stall([run])
        plt.show()
        plt.close(fig)

    slider = widgets.IntSlider(value=value, min=16, max=1024, step=16,
                               description="budget", continuous_update=False)
    return widgets.interactive(draw, budget=slider)


def hash_chain_slider(prompts: dict[str, list[int]], value: int = 4):
    """Move the block size; see which block keys two prompts share (notebook 05)."""

    def draw(block_size: int):
        print(viz.format_hash_chain(prompts, block_size))

    slider = widgets.IntSlider(value=value, min=1, max=16, description="block_size",
                               continuous_update=False)
    return widgets.interactive(draw, block_size=slider)

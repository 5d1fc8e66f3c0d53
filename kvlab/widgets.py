"""Sliders and the engine explorer: thin ipywidgets layers over `viz` and `explorer`.

Each slider's work is a plain function (in viz.py) that tests call without a browser; a widget
here only wires a slider to it. The explorer's picture is a pure function of an engine snapshot
(explorer.py); its widget only wires buttons to an `EngineExplorer`.

A widget's output lives in the widget's state, which a saved notebook does not keep (the
workbook strips it so that GitHub renders the file). So every widget here also shows a static
picture of its starting value as an ordinary cell output: GitHub and nbviewer show that.
"""

from __future__ import annotations

import functools
import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import clear_output, display

from kvlab import viz
from kvlab.explorer import EngineExplorer
from kvlab.viz import draw_snapshot, format_queues

STATIC_NOTE = "(static picture, saved with the notebook; the widget below redraws it live)"


def show_static(caption: str, fig=None, text: str | None = None) -> None:
    """Show a caption, text and a figure as ordinary cell outputs (not inside a widget), so a
    saved notebook keeps them; the figure is closed afterwards (no second copy at cell end)."""
    print(f"{caption} {STATIC_NOTE}")
    if text is not None:
        print(text)
    if fig is not None:
        display(fig)
        plt.close(fig)


def block_size_slider(lengths: list[int], value: int = 16):
    """Move the block size; see internal waste against block-table size (notebook 01)."""

    def draw(block_size: int):
        print(viz.block_size_summary(lengths, block_size))
        fig = viz.plot_block_size_tradeoff(lengths, block_size)
        plt.show()
        plt.close(fig)

    show_static(f"block_size={value}:", viz.plot_block_size_tradeoff(lengths, value),
                viz.block_size_summary(lengths, value))
    slider = widgets.IntSlider(value=value, min=1, max=128, step=1, description="block_size",
                               continuous_update=False)
    return widgets.interactive(draw, block_size=slider)


def cow_slider(prompt_ids: list[int], max_tokens: int = 16, value: int = 4):
    """Move n (parallel sampling) or the beam width; see blocks in use with and without sharing
    on the real model (notebook 02). Each move runs both engines: a few seconds on a CPU."""
    from kvlab.bench import cow_run

    @functools.lru_cache(maxsize=None)  # deterministic runs: the static picture's is reused
    def runs_for(kind: str, k: int):
        return {label: cow_run(kind, k, prompt_ids, max_tokens, share)
                for label, share in (("shared", True), ("unshared", False))}

    def render(kind: str, k: int):
        runs = runs_for(kind, k)
        saved = 1 - runs["shared"]["peak_blocks"] / runs["unshared"]["peak_blocks"]
        text = (f"{kind}, k={k}: peak {runs['shared']['peak_blocks']} blocks shared vs "
                f"{runs['unshared']['peak_blocks']} unshared: {saved:.0%} saved, "
                f"{runs['shared']['cow_copies']} copy-on-write copies")
        return text, viz.plot_blocks_per_step({k_: r["blocks_per_step"] for k_, r in runs.items()})

    def draw(kind: str, k: int):
        text, fig = render(kind, k)
        print(text)
        plt.show()
        plt.close(fig)

    text, fig = render("beam", value)
    show_static(f"beam, k={value}:", fig, text)
    kind = widgets.Dropdown(options=["sampling", "beam"], value="beam", description="kind")
    k = widgets.IntSlider(value=value, min=1, max=8, description="n / width",
                          continuous_update=False)
    return widgets.interactive(draw, kind=kind, k=k)


def chunk_size_slider(long_len: int = 1024, value: int = 128):
    """Move the step's token budget; see the decoding request's gaps while a long prompt is
    prefilled in chunks of that size (notebook 04). Each move runs the real model."""
    from kvlab.bench.scheduling import chunked_prefill_stall

    # A timing: measured afresh on each move. The latest run is kept (one), so the static
    # picture and the slider's first drawing are the same measurement, taken once.
    run_for = functools.lru_cache(maxsize=1)(lambda budget: chunked_prefill_stall(budget, long_len))

    def render(budget: int):
        run = run_for(budget)
        text = (f"budget {budget}: {run.chunks} prefill steps, worst decode gap "
                f"{1000 * run.max_gap:.0f} ms, inserted prompt TTFT "
                f"{1000 * run.inserted_ttft:.0f} ms")
        return text, viz.plot_stall([run])

    def draw(budget: int):
        text, fig = render(budget)
        print(text)
        plt.show()
        plt.close(fig)

    text, fig = render(value)
    show_static(f"budget={value}:", fig, text)
    slider = widgets.IntSlider(value=value, min=16, max=1024, step=16,
                               description="budget", continuous_update=False)
    return widgets.interactive(draw, budget=slider)


def hash_chain_slider(prompts: dict[str, list[int]], value: int = 4):
    """Move the block size; see which block keys two prompts share (notebook 05)."""

    def draw(block_size: int):
        print(viz.format_hash_chain(prompts, block_size))

    show_static(f"block_size={value}:", text=viz.format_hash_chain(prompts, value))
    slider = widgets.IntSlider(value=value, min=1, max=16, description="block_size",
                               continuous_update=False)
    return widgets.interactive(draw, block_size=slider)


def engine_explorer(llm_or_engine, *, prompt: str = "Paged attention keeps the KV cache in",
                    shared_prefix: str = "", cache_salt: str = "", max_tokens: int = 8):
    """Buttons over an `EngineExplorer` (notebooks 01-05): Step, Run to end, Reset, and Add
    request (a prompt, an optional shared prefix and salt). Each press redraws the pool, the
    block tables, the queues, the last step's token budget and its events.

    `llm_or_engine`: an `LLM`, an `LLMEngine`, or an `EngineExplorer` already stepped (so the
    saved static picture shows something worth seeing). Returns the widget box; its
    `.explorer` is the driver, for reading the engine's state from another cell.
    """
    ex = (llm_or_engine if isinstance(llm_or_engine, EngineExplorer)
          else EngineExplorer(llm_or_engine, max_tokens=max_tokens))
    show_static(f"Engine after step {ex.snap.step}:", draw_snapshot(ex.snap))

    queues = widgets.HTML()
    queues.add_class("kvlab-explorer-queues")
    picture = widgets.Output()
    picture.add_class("kvlab-explorer-picture")
    message = widgets.HTML()

    def redraw(snap) -> None:
        queues.value = f"<pre>{html.escape(format_queues(snap))}</pre>"
        with picture:
            clear_output(wait=True)
            fig = draw_snapshot(snap)
            display(fig)
            plt.close(fig)

    text_prompt = widgets.Text(value=prompt, description="prompt")
    text_prefix = widgets.Text(value=shared_prefix, description="shared prefix",
                               placeholder="prepended to the prompt")
    text_salt = widgets.Text(value=cache_salt, description="cache_salt", placeholder="none")

    def action(name: str, call):
        button = widgets.Button(description=name)

        def on_click(_):
            message.value = ""
            try:
                redraw(call())
            except Exception as e:  # bad input, say: shown, not lost in the browser console
                message.value = f"<b>{html.escape(name)} failed:</b> {html.escape(repr(e))}"

        button.on_click(on_click)
        return button

    buttons = [
        action("Step", ex.step),
        action("Run to end", ex.run_to_end),
        action("Reset", ex.reset),
        action("Add request", lambda: ex.add_request(
            text_prompt.value, text_prefix.value or None, text_salt.value or None)),
    ]
    redraw(ex.snap)
    box = widgets.VBox([widgets.HBox(buttons), widgets.HBox([text_prompt, text_prefix, text_salt]),
                        message, queues, picture])
    box.add_class("kvlab-explorer")
    box.explorer = ex
    return box

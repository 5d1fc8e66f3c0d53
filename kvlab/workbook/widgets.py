"""Sliders and the engine explorer: thin ipywidgets layers over `viz` and `explorer`.

Each slider's work is a plain function (in kvlab/workbook/viz/) that tests call without a browser; a widget
here only wires a slider to it. The explorer's picture is a pure function of an engine snapshot
(`viz.draw_snapshot` of `explorer.snapshot`); its widget only wires buttons to an
`EngineExplorer`.

A widget's own output lives in the widget's state, which a saved notebook does not keep (the
workbook strips it so that GitHub renders the file). So no widget here draws inside itself: each
shows its text and picture as ordinary cell outputs (`LiveOutput`) and its controls redraw
those outputs in place through IPython display ids. One picture on screen, live in a running
notebook, and the one GitHub and nbviewer show in a saved one.
"""

from __future__ import annotations

import functools
import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from kvlab.workbook import viz
from kvlab.workbook.explorer import EngineExplorer
from kvlab.workbook.viz import draw_snapshot, format_queues

LIVE_NOTE = "(redrawn in place by the controls below; a saved notebook keeps the last drawing)"


class _Text:
    """Text that displays as itself (plain, for nbval, GitHub and a plain script's print) and as
    a classed <pre> in a browser (tests/workbook/test_browser.py finds it by the class)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f'<pre class="kvlab-live-text">{html.escape(self.text)}</pre>'


class LiveOutput:
    """A widget's text and figure as ordinary cell outputs, redrawn in place by its callbacks.

    `display(..., display_id=True)` returns a handle whose `update` replaces that output
    wherever it is, also from a button's or slider's callback (checked in JupyterLab by
    tests/workbook/test_browser.py). Both outputs are made here, while the cell runs: one first shown
    from a callback would belong to no cell. Outside IPython (a plain script) there is no
    handle: each new text is printed. Each figure is closed once shown (no second copy at cell
    end).
    """

    def __init__(self, caption: str, text: str | None = None, fig=None) -> None:
        print(f"{caption} {LIVE_NOTE}")
        self.handles: dict[str, object] = {}
        try:
            for name, obj in _parts(text, fig):
                self.handles[name] = display(obj, display_id=True)
        finally:
            if fig is not None:
                plt.close(fig)

    def update(self, text: str | None = None, fig=None) -> None:
        try:
            parts = _parts(text, fig)
            for name, _ in parts:
                if name not in self.handles:
                    raise ValueError(f"this LiveOutput was made without a {name}")
            for name, obj in parts:
                handle = self.handles[name]
                if handle is not None:
                    handle.update(obj)
                elif name == "text":
                    print(text)
        finally:
            if fig is not None:
                plt.close(fig)


def _parts(text: str | None, fig) -> list[tuple[str, object]]:
    """(name, what to display) for the parts given."""
    parts = []
    if text is not None:
        parts.append(("text", _Text(text)))
    if fig is not None:
        parts.append(("fig", fig))
    return parts


def _reported(message: widgets.HTML, what: str, call) -> None:
    """Run a widget's callback; a failure is shown in `message`, not lost in the browser's
    console, and the widget stays usable."""
    message.value = ""
    try:
        call()
    except Exception as e:  # bad input, say
        message.value = f"<b>{html.escape(what)} failed:</b> {html.escape(repr(e))}"


def _controls(redraw, **controls):
    """The controls in a box; every change of a value calls `redraw` with all their values.

    Not a `widgets.interactive`: that runs its function inside its own Output widget, which
    captures every message of the call, the display updates too (they would never reach the
    LiveOutput).
    """
    message = widgets.HTML()

    def on_change(_) -> None:
        _reported(message, "redraw",
                  lambda: redraw(**{name: c.value for name, c in controls.items()}))

    for control in controls.values():
        control.observe(on_change, names="value")
    box = widgets.VBox([*controls.values(), message])
    box.add_class("kvlab-controls")
    return box


def block_size_slider(lengths: list[int], value: int = 16):
    """Move the block size; see internal waste against block-table size (notebook 01)."""

    def render(block_size: int):
        return (viz.block_size_summary(lengths, block_size),
                viz.plot_block_size_tradeoff(lengths, block_size))

    live = LiveOutput("Block size against waste and table size", *render(value))
    slider = widgets.IntSlider(value=value, min=1, max=128, step=1, description="block_size",
                               continuous_update=False)
    return _controls(lambda block_size: live.update(*render(block_size)), block_size=slider)


def cow_slider(prompt_ids: list[int], max_tokens: int = 16, value: int = 4):
    """Move n (parallel sampling) or the beam width; see blocks in use with and without sharing
    on the real model (notebook 02). Each move runs both engines: a few seconds on a CPU."""
    from kvlab.bench import cow_run

    @functools.lru_cache(maxsize=None)  # deterministic runs: the first drawing's runs are reused
    def runs_for(kind: str, k: int):
        return {label: cow_run(kind, k, prompt_ids, max_tokens, share)
                for label, share in (("shared", True), ("unshared", False))}

    def render(kind: str, k: int):
        runs = runs_for(kind, k)
        saved = 1 - runs["shared"]["peak_blocks"] / runs["unshared"]["peak_blocks"]
        text = (f"{kind}, k={k}: peak {runs['shared']['peak_blocks']} blocks shared vs "
                f"{runs['unshared']['peak_blocks']} unshared: {saved:.0%} saved, "
                f"{runs['shared']['cow_copies']} copy-on-write copies")
        what = f"beam width {k}" if kind == "beam" else f"n={k}"
        title = f"{what}, {len(prompt_ids)}-token prompt, {max_tokens} new tokens"
        return text, viz.plot_blocks_per_step({k_: r["blocks_per_step"] for k_, r in runs.items()},
                                              title=title)

    live = LiveOutput("Blocks in use, shared and unshared", *render("beam", value))
    kind = widgets.Dropdown(options=["sampling", "beam"], value="beam", description="kind")
    k = widgets.IntSlider(value=value, min=1, max=8, description="n / width",
                          continuous_update=False)
    return _controls(lambda kind, k: live.update(*render(kind, k)), kind=kind, k=k)


def chunk_size_slider(long_len: int = 1024, value: int = 128):
    """Move the step's token budget; see the decoding request's gaps while a long prompt is
    prefilled in chunks of that size (notebook 04). Each move runs the real model."""
    from kvlab.bench.scheduling import chunked_prefill_stall

    def render(budget: int):
        run = chunked_prefill_stall(budget, long_len)  # a timing: measured afresh on each move
        text = (f"budget {budget}: {run.chunks} prefill steps, worst decode gap "
                f"{1000 * run.max_gap:.0f} ms, inserted prompt TTFT "
                f"{1000 * run.inserted_ttft:.0f} ms")
        return text, viz.plot_stall([run])

    live = LiveOutput("A decode's gaps while a long prompt is prefilled", *render(value))
    slider = widgets.IntSlider(value=value, min=16, max=1024, step=16,
                               description="budget", continuous_update=False)
    return _controls(lambda budget: live.update(*render(budget)), budget=slider)


def hash_chain_slider(prompts: dict[str, list[int]], value: int = 4):
    """Move the block size; see which block keys two prompts share (notebook 05)."""

    def render(block_size: int) -> str:
        return f"block_size={block_size}:\n" + viz.format_hash_chain(prompts, block_size)

    live = LiveOutput("Block keys of each prompt", render(value))
    slider = widgets.IntSlider(value=value, min=1, max=16, description="block_size",
                               continuous_update=False)
    return _controls(lambda block_size: live.update(render(block_size)), block_size=slider)


def engine_explorer(llm_or_engine, *, prompt: str = "Paged attention keeps the KV cache in",
                    shared_prefix: str = "", cache_salt: str = "", max_tokens: int = 8):
    """Buttons over an `EngineExplorer` (notebooks 01-05): Step, Run to end, Reset, and Add
    request (a prompt, an optional shared prefix and salt). Each press redraws the pool, the
    block tables, the queues, the last step's token budget and its events.

    `llm_or_engine`: an `LLM`, an `LLMEngine`, or an `EngineExplorer` already stepped (so the
    first picture, the one a saved notebook keeps, shows something worth seeing). Returns the
    widget box; its `.explorer` is the driver, for reading the engine's state from another cell.
    """
    ex = (llm_or_engine if isinstance(llm_or_engine, EngineExplorer)
          else EngineExplorer(llm_or_engine, max_tokens=max_tokens))
    live = LiveOutput("The engine explorer", fig=draw_snapshot(ex.snap))

    queues = widgets.HTML()
    queues.add_class("kvlab-explorer-queues")
    message = widgets.HTML()

    def redraw(snap, picture: bool = True) -> None:
        queues.value = f"<pre>{html.escape(format_queues(snap))}</pre>"
        if picture:
            live.update(fig=draw_snapshot(snap))

    text_prompt = widgets.Text(value=prompt, description="prompt")
    text_prefix = widgets.Text(value=shared_prefix, description="shared prefix",
                               placeholder="prepended to the prompt")
    text_salt = widgets.Text(value=cache_salt, description="cache_salt", placeholder="none")

    def action(name: str, call):
        button = widgets.Button(description=name)

        def on_click(_):
            _reported(message, name, lambda: redraw(call()))

        button.on_click(on_click)
        return button

    buttons = [
        action("Step", ex.step),
        action("Run to end", ex.run_to_end),
        action("Reset", ex.reset),
        action("Add request", lambda: ex.add_request(
            text_prompt.value, text_prefix.value or None, text_salt.value or None)),
    ]
    redraw(ex.snap, picture=False)  # the LiveOutput above already shows this snapshot
    box = widgets.VBox([widgets.HBox(buttons), widgets.HBox([text_prompt, text_prefix, text_salt]),
                        message, queues])
    box.add_class("kvlab-explorer")
    box.explorer = ex
    return box

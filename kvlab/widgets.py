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

"""Chapter 00's first measurement: generation without a KV cache and with one, on the same
transformers model, gives the same tokens; without the cache every token recomputes the whole
sequence, with it a decode computes one position."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab.bench.no_cache import with_and_without_cache  # noqa: E402
from kvlab.workbook.viz import plot_no_cache  # noqa: E402


def test_the_cache_changes_the_work_never_the_tokens(loaded):
    prompt = loaded.tokenizer("The KV cache grows with every token because").input_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the rename notice stays out of notebooks
        runs = with_and_without_cache(loaded, prompt, 16)
    plain, cached = runs["no cache"], runs["KV cache"]
    assert plain["tokens"] == cached["tokens"] and len(plain["tokens"]) == 16
    n = len(prompt)
    assert plain["positions"] == [n + i for i in range(16)]  # everything, every time
    assert cached["positions"] == [n] + [1] * 15  # the prefill, then one position each
    assert plain["positions_computed"] == sum(plain["positions"])
    for run in runs.values():
        assert len(run["seconds"]) == 16 and run["growth"] > 0
    fig = plot_no_cache(runs, n)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(label.startswith("no cache") for label in labels)
    assert any(label.startswith("KV cache") for label in labels)
    plt.close(fig)


def test_too_few_tokens_to_compare_two_groups_of_eight_is_refused(loaded):
    with pytest.raises(ValueError, match="at least 16"):
        with_and_without_cache(loaded, [1, 2, 3], 8)

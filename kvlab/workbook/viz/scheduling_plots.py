"""Chapters 03-04: requests over steps, the concurrency and capacity sweeps, and the gaps a
long prefill opens in a decode."""

from __future__ import annotations

import matplotlib.pyplot as plt

from kvlab.workbook.viz.axes import _colour, _log2_axes, log_axis


def plot_gantt(traces: dict[str, list], title: str = "requests over steps"):
    """One row per request, one bar for each run of consecutive steps it ran in (a request
    that ran from step 3 to step 9 is one bar, 3 to 10; a preempted request's bar breaks where
    it waited); one panel per run.

    `traces` maps a run's name to its StepRecords (e.g. `BatchResult.steps`).
    """
    fig, axes = plt.subplots(len(traces), 1, figsize=(7.5, 1.6 + 1.5 * len(traces)), sharex=True)
    axes = [axes] if len(traces) == 1 else list(axes)
    for ax, (name, steps) in zip(axes, traces.items()):
        first = steps[0].step if steps else 0
        rows: dict[str, list[int]] = {}
        for rec in steps:
            for rid in rec.request_ids:
                rows.setdefault(rid, []).append(rec.step - first)
        for y, (rid, xs) in enumerate(rows.items()):
            # Full-width bars, merged: a request's run reads as one bar, with no seam per step.
            ax.broken_barh(_runs(xs), (y - 0.4, 0.8), color=_colour(y))
        ax.set_yticks(range(len(rows)), list(rows), fontsize=9.5)
        ax.tick_params(axis="x", labelsize=9.5)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {len(steps)} steps", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("engine step", fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _runs(xs: list[int]) -> list[tuple[int, int]]:
    """Consecutive step offsets merged into (start, length) bars: [0, 1, 2, 5, 6] -> [(0, 3),
    (5, 2)]."""
    bars: list[tuple[int, int]] = []
    for x in sorted(xs):
        if bars and bars[-1][0] + bars[-1][1] == x:
            bars[-1] = (bars[-1][0], bars[-1][1] + 1)
        else:
            bars.append((x, 1))
    return bars


def plot_concurrency(rows: list[dict], key: str = "server"):
    """Throughput and TTFT median against concurrency, one line per `key` value. A series
    measured at fewer levels than the others is dashed, and its legend names its levels (a line
    between two of its points is not a measurement at the levels in between). Whiskers: the
    range of tok/s over repeated runs, where there were several."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4.0))  # room below for the legends
    names = list(dict.fromkeys(r[key] for r in rows))
    levels = {n: [r["concurrency"] for r in rows if r[key] == n] for n in names}
    every = set().union(*levels.values())
    for name in names:
        pts = [r for r in rows if r[key] == name]
        cs = levels[name]
        sparse = set(cs) < every
        label = name + (f" (measured at {', '.join(map(str, cs))} only)" if sparse else "")
        style = {"ls": "--" if sparse else "-", "marker": "o", "label": label}
        spread = [[r["tok_s"] - r["tok_s_spread"][0] for r in pts],
                  [r["tok_s_spread"][1] - r["tok_s"] for r in pts]]
        if any(v > 0 for side in spread for v in side):
            style["label"] = label + ", whiskers: range of the repeats"
            ax1.errorbar(cs, [r["tok_s"] for r in pts], yerr=spread, capsize=3, **style)
        else:
            ax1.plot(cs, [r["tok_s"] for r in pts], **style)
        ax2.plot(cs, [r["ttft_median_ms"] for r in pts], **{**style, "label": label})
    # Below each panel, not on it: at a readable size the legend spans most of a panel's width,
    # and a series rising to the top right runs under it wherever it sits inside.
    _concurrency_axes(fig, ax1, ax2, legend={"loc": "upper center", "bbox_to_anchor": (0.5, -0.2),
                                             "frameon": False})
    return fig


def _concurrency_axes(fig, ax1, ax2, knee: int | None = None, legend: dict | None = None) -> None:
    """Shared styling: throughput left, TTFT right, concurrency on a log2 axis; `legend` places
    both panels' legends (matplotlib's legend keywords)."""
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "TTFT median (ms)")):
        if knee is not None:
            ax.axvline(knee, color="k", ls="--", lw=1,
                       label=f"knee: KV tokens / tokens per request = {knee} requests")
        _log2_axes(ax, "concurrency", ylabel, legend=legend, legend_size=9)
    fig.tight_layout()


def plot_capacity(sweep: dict, control: dict | None = None):
    """The KV-capacity knee: throughput flattens and TTFT climbs past KV tokens / request.

    control: one row of the same sweep run with KV for every request (no knee in reach), drawn
    as a hollow marker at its concurrency, so the KV budget's effect is read off the figure."""
    rows = sweep["rows"]
    cs = [r["concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4.3))  # room below for the legends
    budget = f"KV budget {sweep['kv_tokens']:,} tokens"
    # One colour for the budgeted series in both panels: it is one run, read twice.
    ax1.plot(cs, [r["tok_s"] for r in rows], "o-", color="tab:blue", label=budget)
    ax2.plot(cs, [r["ttft_median_ms"] for r in rows], "o-", color="tab:blue", label=budget)
    if control is not None:
        for ax, key in ((ax1, "tok_s"), (ax2, "ttft_median_ms")):
            ax.plot([control["concurrency"]], [control[key]], "o", mfc="none", ms=9, mew=1.5,
                    color="tab:blue", label="control: KV for every request")
            ax.margins(y=0.15)  # the hollow marker is often the highest point: not on the frame
    for c, r in zip(cs, rows):
        if r["preemptions"]:
            # Above and left of its point, tied to it by a short line: the line rises to it
            # from the left, so the label clears the line and stays on the axes at the last
            # point, and the tie keeps it from reading as the knee's label.
            ax2.annotate(f"{r['preemptions']:g} preempted", (c, r["ttft_median_ms"]), fontsize=9,
                         textcoords="offset points", xytext=(-10, 14), ha="right", va="bottom",
                         arrowprops={"arrowstyle": "-", "lw": 0.8, "color": "0.3",
                                     "shrinkA": 0, "shrinkB": 4})
    # Below each panel, not on it: the lines rise and fall across the whole width and the
    # knee's dashed line crosses the middle, so no corner of the axes is reliably empty.
    _concurrency_axes(fig, ax1, ax2, knee=sweep["predicted_knee"],
                      legend={"loc": "upper center", "bbox_to_anchor": (0.5, -0.2),
                              "frameon": False})
    return fig


def plot_stall(runs: list):
    """The decoding request's inter-token gaps over time, one line per budget (StallRuns)."""
    fig, ax = plt.subplots(figsize=(8.6, 3.4))
    for i, run in enumerate(runs):
        t = run.decode_times
        label = "no chunking" if run.budget is None else f"budget {run.budget}"
        gaps = [1000 * (b - a) for a, b in zip(t, t[1:])]
        if not gaps:
            continue
        # A gap lasts from one token to the next: draw it as a flat step over that interval
        # (a line from dot to dot would draw one long gap as a ramp that starts a token early).
        ax.plot(t, gaps + gaps[-1:], drawstyle="steps-post", lw=1.2, color=_colour(i),
                label=f"{label}: max gap {1000 * run.max_gap:.0f} ms")
        ax.plot(t[1:], gaps, "o", ms=3, color=_colour(i))  # a dot where each token arrived
    if runs:
        # One line for every run: the prompt arrives after the same number of decode tokens in
        # each, so their arrival times differ by a few milliseconds (one line per run, in each
        # run's colour, drew three nearly overlapping lines).
        arrivals = sorted(run.insert_time for run in runs)
        ax.axvline(arrivals[len(arrivals) // 2], color="k", ls=":", lw=1,
                   label="long prompt arrives")
    ax.set_xlabel("seconds since the decoding request arrived")
    ax.set_ylabel("gap since the previous token (ms)")
    ax.set_title("One decoding request's gaps between tokens while a long prompt is prefilled",
                 fontsize=10)
    log_axis(ax.yaxis)
    # Beside the axes: the steps fill the whole frame, and "best" can only pick the emptiest
    # corner, which still touched the unchunked run's points.
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_gap_vs_budget(runs: list, prefill_tokens_per_s: float, decode_step_s: float, fit=None):
    """Measured worst gap against the budget, with the prediction budget / prefill rate +
    one decode step, and the least-squares line through the chunked points."""
    chunked = [r for r in runs if r.budget is not None]
    xs = [r.budget for r in chunked]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))  # room below for the legend
    ax.plot(xs, [1000 * r.max_gap for r in chunked], "o", label="measured max gap")
    grid = [0, max(xs)]
    ax.plot(grid, [1000 * (x / prefill_tokens_per_s + decode_step_s) for x in grid], "k--", lw=1,
            label=f"predicted: budget / {prefill_tokens_per_s:.0f} tok/s + one decode step")
    if fit is not None:
        a, b, r2 = fit
        ax.plot(grid, [1000 * (a + b * x) for x in grid], color="tab:orange", lw=1,
                label=f"fit: {1000 * a:.0f} ms + {1000 * b:.2f} ms/token x budget, R² {r2:.3f}")
    for r in runs:
        if r.budget is None:
            ax.axhline(1000 * r.max_gap, color="tab:red", lw=1,
                       label=f"no chunking: {1000 * r.max_gap:.0f} ms")
    ax.set_xlabel("max_num_batched_tokens (tokens per step)")
    ax.set_ylabel("worst decode gap (ms)")
    ax.set_title("Worst decode gap against the token budget", fontsize=10)
    # Below the axes: at a readable size, inside it would cover the unchunked run's line or
    # the points, whichever corner it took.
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig

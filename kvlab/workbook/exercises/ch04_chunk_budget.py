"""Chapter 04 challenge: the token budget for a worst-gap target.

What it asks: the max_num_batched_tokens that keeps a decode's worst gap between two tokens
under a target while a long prompt arrives, and the long prompt's TTFT as short as that
allows. The participant's function gets what chapter 04's table gives: worst gaps measured at
a few budgets on this machine. Checked on other machines' tables first, then on the real
model: this machine's table is measured, and a 1,024-token prompt runs into a decode with the
participant's budget and with the best one, side by side.
"""

from __future__ import annotations

from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, Skip, cdiv

LONG_LEN = 1024  # the inserted prompt, as in chapter 04's table
MIN_BUDGET = 16
MAX_BUDGET = 4096
TABLE_BUDGETS = (64, 128, 256, 512)  # what the check measures and gives the function
TARGET_BUDGET = 384  # the real-model target is the measured line's gap at this budget
GAP_SLACK = 1.05  # a budget's gap on the measured line may exceed the target by this much
EXTRA_CHUNKS = 1  # the tolerance: at most one prefill step more than the best budget's


def choose_chunk_budget(measured, max_gap_s):
    """The largest token budget whose worst decode gap, on the measured line, stays under
    max_gap_s."""
    # Chapter 04's fit: the worst gap grows along a line in the budget, a fixed cost per step
    # plus a cost per token. Fit that line to the measurements (least squares: one noisy
    # point moves it less than it moves a neighbour-to-neighbour interpolation).
    budgets = sorted(measured)
    mean_b = sum(budgets) / len(budgets)
    mean_g = sum(measured[b] for b in budgets) / len(budgets)
    slope = (sum((b - mean_b) * (measured[b] - mean_g) for b in budgets)
             / sum((b - mean_b) ** 2 for b in budgets))
    intercept = mean_g - slope * mean_b
    # The largest budget on the line under the target: the fewest chunks, and each chunk's
    # step pays the fixed cost again, so the long prompt's TTFT is the shortest the target
    # allows. Where even the smallest budget misses, take it: the least harm.
    return min(4096, max(16, int((max_gap_s - intercept) / slope)))


CHUNK_STUB = """def choose_chunk_budget(measured, max_gap_s):
    \"\"\"Return max_num_batched_tokens, an int from 16 to 4096, for a server where a request
    decodes while a 1,024-token prompt arrives: the decode's worst gap between two tokens must
    stay under max_gap_s, and the long prompt's TTFT must be as short as that allows. If no
    budget can meet max_gap_s, return 16.
    measured: {budget: worst gap in seconds} for chunked budgets only (no unchunked row),
    measured on this machine as in the table above (the least disturbed of three runs per
    budget), e.g. {64: 0.15, 128: 0.24, 256: 0.42}. The best budget is judged by what this
    table says of budgets between and beyond the ones it measured.\"\"\"
    raise NotImplementedError("your turn")
"""


def _line(measured: dict) -> tuple[float, float]:
    """The least-squares line through the measurements, (intercept, slope): chapter 04's own
    fit of its table (the reference solution repeats it, since it must paste on its own)."""
    from kvlab.bench.scheduling import fit_line

    intercept, slope, _ = fit_line(list(measured), list(measured.values()))
    return intercept, slope


def prefill_steps(budget: int, long_len: int = LONG_LEN) -> int:
    """Steps a long prompt's prefill takes beside one decode: each step the decode's token
    goes first and the prompt takes the rest of the budget."""
    return cdiv(long_len, max(1, budget - 1))


def _budget(impl, measured, target) -> int:
    value = impl(dict(measured), target)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Mismatch("an int", repr(value))
    if not MIN_BUDGET <= value <= MAX_BUDGET:
        raise Mismatch(f"a budget from {MIN_BUDGET} to {MAX_BUDGET} tokens", str(value))
    return value


def _table(intercept_ms, slope_ms, budgets, wobble=()):
    """A made-up machine's table: the line, with a measured point's noise where given."""
    wobble = dict(wobble)
    return {b: round((intercept_ms + slope_ms * b) * (1 + wobble.get(b, 0.0)) / 1000, 4)
            for b in budgets}


# Other machines: a fast one, a slow one whose fixed cost is large, a table whose target lies
# beyond its largest budget (read the line, not the table), one with a noisy point, and a
# target below what the smallest budget gives (no budget meets it), and one above what the
# largest allowed gives (the cap).
OTHER_MACHINES = [
    ("a fast machine", _table(12, 0.20, (64, 128, 256, 512)), 0.080),
    ("a slow machine with a large fixed cost per step", _table(90, 1.6, (64, 128, 256)), 0.400),
    ("a target beyond the largest budget measured", _table(40, 0.9, (32, 64, 128)), 0.250),
    ("a table with one noisy point", _table(50, 1.4, (64, 128, 256, 512), {128: 0.04}), 0.520),
    ("a target no budget can meet", _table(110, 1.2, (64, 128, 256)), 0.100),
    ("a target every budget meets", _table(20, 0.05, (64, 128, 256)), 0.500),
]


def _other_machines(impl) -> None:
    """Other machines' tables (a constant, or the largest budget in the table under the
    target, cannot pass): judged by the line through the table, as chapter 04's fit."""
    for name, measured, target in OTHER_MACHINES:
        got = _budget(impl, measured, target)
        best = choose_chunk_budget(measured, target)
        intercept, slope = _line(measured)
        on_line = intercept + slope * got
        table = ", ".join(f"{b}: {1000 * g:.0f} ms" for b, g in measured.items())
        if intercept + slope * MIN_BUDGET > target:
            if got != MIN_BUDGET:
                raise Mismatch(f"{MIN_BUDGET} on {name} ({table}; target {1000 * target:.0f} ms)",
                               f"{got}: about {1000 * on_line:.0f} ms a gap",
                               "chapter 04's fit: a step with any chunk pays a fixed cost "
                               "(the intercept) that no budget removes; here it is over the "
                               "target, so the least harm is the smallest budget")
            continue
        if on_line > target * GAP_SLACK:
            raise Mismatch(f"at most about {best} tokens on {name} ({table}; target "
                           f"{1000 * target:.0f} ms)",
                           f"{got}: about {1000 * on_line:.0f} ms a gap on the line through "
                           f"the table", "chapter 04's fit: the worst gap grows along a line "
                           "in the budget, intercept plus slope x budget")
        if prefill_steps(got) > prefill_steps(best) + EXTRA_CHUNKS:
            raise Mismatch(f"close to {best} tokens on {name} ({table}; target "
                           f"{1000 * target:.0f} ms): the long prompt in "
                           f"{prefill_steps(best)} steps, or {prefill_steps(best) + 1}",
                           f"{got}: {prefill_steps(got)} steps",
                           "chapter 04's table: every extra step of the long prompt pays the "
                           "fixed cost again, so its TTFT grows as the budget shrinks; the "
                           "largest budget under the target is the best")


def _chunk_measured(impl) -> str:
    from kvlab.bench import scheduling

    def least_disturbed(budget):  # anything else on the machine only adds time to a gap
        return min(scheduling.chunked_prefill_trials(budget, LONG_LEN, repeats=3),
                   key=lambda r: r.max_gap)

    table = {b: least_disturbed(b) for b in TABLE_BUDGETS}
    measured = {b: r.max_gap for b, r in table.items()}
    intercept, slope = _line(measured)
    if slope <= 0:
        raise Skip("the machine was busy: the measured gaps did not grow with the budget; "
                   "close other programs and run it again")
    target = round(intercept + slope * (TARGET_BUDGET + 0.5), 3)
    best_budget = choose_chunk_budget(measured, target)
    chosen = _budget(impl, measured, target)
    best = least_disturbed(best_budget)
    mine = best if chosen == best_budget else table.get(chosen) or least_disturbed(chosen)
    shown = ", ".join(f"{b}: {1000 * g:.0f} ms" for b, g in measured.items())
    verdict = (f"table {shown}; target {1000 * target:.0f} ms; yours (budget {chosen}): worst "
               f"gap {1000 * mine.max_gap:.0f} ms, TTFT {1000 * mine.inserted_ttft:.0f} ms in "
               f"{mine.chunks} steps; best ({best_budget}): {1000 * best.max_gap:.0f} ms, "
               f"{1000 * best.inserted_ttft:.0f} ms in {best.chunks} steps")
    # Judged beside the best, measured the same way: a machine slower now than when the table
    # was measured moves both gaps, not the verdict.
    bound = 1.10 * max(target, best.max_gap)
    if mine.max_gap > bound:
        if chosen <= best_budget:
            raise Skip(f"a budget of {chosen} (at most the best's {best_budget}) measured a "
                       f"worst gap of {1000 * mine.max_gap:.0f} ms, over {1000 * bound:.0f} "
                       f"ms: the machine was busy; close other programs and run it again")
        raise Mismatch(f"a worst gap under {1000 * bound:.0f} ms (the target or the best "
                       f"budget's gap, +10%)", verdict,
                       "chapter 04's fit: the worst gap grows along a line in the budget; "
                       "read the budget off that line, not off the prediction")
    # The TTFT is judged by its cause, the steps the prompt takes (each pays the fixed cost
    # again): two runs of one budget on a shared CPU differ by 20% and more in time.
    if mine.chunks > best.chunks + EXTRA_CHUNKS:
        raise Mismatch(f"the prompt in at most {best.chunks + EXTRA_CHUNKS} steps (the best "
                       f"budget's {best.chunks}, or one more)", verdict,
                       "chapter 04's table: the smaller the budget, the more steps and the "
                       "later the long prompt's first token")
    return verdict + " (least disturbed of three runs each)"


CHUNK_BUDGET = Exercise(
    name="chunk_budget",
    chapter="04_chunked_prefill",
    title="the token budget for a gap target",
    kind="challenge",
    prompt=(
        "Choose max_num_batched_tokens for a server where decodes must never wait longer than "
        "a target between two tokens, while long prompts still start as soon as that allows. "
        "Your function gets a table like the one above, measured on this machine, and the "
        "target; a budget under the target and within one prefill step of the best is "
        "accepted. The check then runs a 1,024-token prompt into a decode with your budget and "
        "the best one, side by side."
    ),
    full_version=(
        "vLLM 0.33.0 picks its default budget by the GPU and by LLM class or API server "
        "(EngineArgs.get_batch_defaults in vllm/engine/arg_utils.py). A server has many "
        "decodes per step (chapter 03), so a step's decode part grows with the batch, and the "
        "worst gap with it. vLLM's long_prefill_token_threshold (vllm/config/scheduler.py; 0, "
        "off, by default) caps one long prompt's share of a step, so that several prompts are "
        "chunked side by side instead of one taking the whole budget."
    ),
    stub=CHUNK_STUB,
    hint=(
        "Try your function on the table above: {r.budget: r.max_gap for r in runs if r.budget}. "
        "What shape did the fit find the gaps make against the budget? Which budget under the "
        "target gives the long prompt the fewest steps?"
    ),
    solution=choose_chunk_budget,
    cases=[
        Case("six other machines' tables, judged by the line through each",
             _other_machines, "The worst gap is a line in the budget (chapter 04's fit): read "
             "the largest budget under the target off the line through the table."),
        Case("real model: a 1,024-token prompt into a decode, your budget beside the best",
             _chunk_measured, "Compare the worst gaps and steps printed above.",
             real_model=True, timeout_s=420),
    ],
)

EXERCISES = [CHUNK_BUDGET]

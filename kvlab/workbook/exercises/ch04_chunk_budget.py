"""Chapter 04 challenge: the token budget for a worst-gap target.

What it asks: the max_num_batched_tokens that keeps a decode's worst gap between two tokens
under a target while a long prompt arrives, and the long prompt's TTFT as short as that
allows. Checked by the chapter's model of a step on other machines, then on the real model:
this machine's prefill rate and decode step are measured, and a 512-token prompt runs into
a decode with the participant's budget and the best one.
"""

from __future__ import annotations

from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, Skip


CHUNK_LONG_LEN = 512  # the inserted prompt (chapter 04 uses 1,024; half keeps the check short)
CHUNK_REF_BUDGET = 256  # the target below is set so that the reference rule gives this budget
MIN_BUDGET = 16


def choose_chunk_budget(prefill_tokens_per_s, decode_step_s, max_gap_s):
    """The largest token budget whose worst decode gap stays under max_gap_s."""
    # The decode's worst gap is one step that carries the decode (one token of the budget) and
    # a chunk of the rest: about decode_step_s + (budget - 1) / rate, chapter 04's prediction.
    # The largest budget under the target cuts the prompt into the fewest chunks: the long
    # prompt's TTFT is then the shortest the target allows, since each extra step pays the
    # decode step again. Never below 16 tokens: the prompt would take hundreds of steps.
    return max(16, int((max_gap_s - decode_step_s) * prefill_tokens_per_s) + 1)


CHUNK_STUB = """def choose_chunk_budget(prefill_tokens_per_s, decode_step_s, max_gap_s):
    \"\"\"Return max_num_batched_tokens (an int >= 16) for a server where one request decodes
    while a long prompt arrives: the decode's worst gap between two tokens must stay under
    max_gap_s, and the long prompt's TTFT must be as short as that allows.
    prefill_tokens_per_s: this machine's prefill rate on fresh prompts (as measured above);
    decode_step_s: how long a step with only the decode takes. The check measures both here,
    then runs a 512-token prompt into a decode with your budget and with the best one.\"\"\"
    raise NotImplementedError("your turn")
"""


def _budget(impl, rate, decode_step, target) -> int:
    value = impl(rate, decode_step, target)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Mismatch("an int", repr(value))
    if value < MIN_BUDGET:
        raise Mismatch(f"a budget of at least {MIN_BUDGET} tokens", f"{value}: the long prompt "
                       f"would take over {CHUNK_LONG_LEN // MIN_BUDGET} steps")
    return value


def _chunk_arithmetic(impl) -> None:
    """Other machines and targets (a constant cannot pass): under the target by the chapter's
    model of a step, and not so far under it that the prompt needs many more chunks."""
    # The last: a target so close to the decode step that no chunk fits; the smallest budget.
    for rate, step, target in [(500.0, 0.10, 0.6), (20000.0, 0.004, 0.05), (1500.0, 0.03, 0.3),
                               (500.0, 0.10, 0.12)]:
        got = _budget(impl, rate, step, target)
        best = choose_chunk_budget(rate, step, target)
        predicted = step + (got - 1) / rate
        if got > best * 1.05:
            raise Mismatch(f"at most about {best} tokens at {rate:.0f} tok/s, a {1000 * step:.0f} "
                           f"ms decode step and a {1000 * target:.0f} ms target",
                           f"{got}: a step would take about {1000 * predicted:.0f} ms",
                           "by the chapter's prediction, decode_step_s + (budget - 1) / rate")
        if got < best * 0.6:
            raise Mismatch(f"close to {best} tokens at {rate:.0f} tok/s, a {1000 * step:.0f} ms "
                           f"decode step and a {1000 * target:.0f} ms target",
                           f"{got}: more chunks than the target needs, each paying a step")


def _chunk_measured(impl) -> str:
    from kvlab.bench import scheduling

    rate = scheduling.prefill_rate((128, 256, 512))["tokens_per_s"]

    def trials(budget):  # the least disturbed of three runs: a busy core only adds time
        return min(scheduling.chunked_prefill_trials(budget, CHUNK_LONG_LEN, repeats=3),
                   key=lambda r: r.max_gap)

    ref = trials(CHUNK_REF_BUDGET)
    decode_step = min(b - a for a, b in zip(ref.decode_times, ref.decode_times[1:]))
    # Half a token above, so that the reference rule's int() lands on the budget itself.
    target = decode_step + (CHUNK_REF_BUDGET - 0.5) / rate
    chosen = _budget(impl, rate, decode_step, target)
    mine = ref if chosen == CHUNK_REF_BUDGET else trials(chosen)
    mine_step = min(b - a for a, b in zip(mine.decode_times, mine.decode_times[1:]))
    if max(mine_step, decode_step) > 1.5 * min(mine_step, decode_step):
        raise Skip(f"this machine's speed changed during the check (a step with only the "
                   f"decode took {1000 * decode_step:.0f} ms in the best budget's runs and "
                   f"{1000 * mine_step:.0f} ms in yours): close other programs, run it again")
    margin = 1.15  # a timing on a shared CPU: the stated margin for the worst gap
    verdict = (f"target {1000 * target:.0f} ms (rate {rate:.0f} tok/s, decode step "
               f"{1000 * decode_step:.0f} ms); yours (budget {chosen}): worst gap "
               f"{1000 * mine.max_gap:.0f} ms, TTFT {1000 * mine.inserted_ttft:.0f} ms in "
               f"{mine.chunks} chunks; best ({CHUNK_REF_BUDGET}): {1000 * ref.max_gap:.0f} ms, "
               f"{1000 * ref.inserted_ttft:.0f} ms in {ref.chunks} chunks")
    # The bound is the target, or what the best budget measured if this machine (busy, or
    # slower than its own rate said) could not meet it: yours is judged beside the best.
    bound = margin * max(target, ref.max_gap)
    if mine.max_gap > bound:
        if chosen <= CHUNK_REF_BUDGET:
            # No larger a chunk than the best budget's: by the chapter's prediction its step
            # fits the target, so a gap over it was this machine's, not the budget's.
            raise Skip(f"a budget of {chosen} (at most the best's {CHUNK_REF_BUDGET}) measured "
                       f"a worst gap of {1000 * mine.max_gap:.0f} ms, over the bound of "
                       f"{1000 * bound:.0f} ms: the machine was busy; close other programs "
                       f"and run it again")
        raise Mismatch(f"a worst gap under {1000 * bound:.0f} ms (the target or the best "
                       f"budget's gap, +{margin - 1:.0%})", verdict,
                       "the chapter's prediction: decode step + (budget - 1) / rate, and a late "
                       "chunk can cost a little more than that (chapter 04's fit)")
    # The TTFT is judged by its cause, the number of steps the prompt takes, each paying the
    # decode step again: the same count as the best budget's is the same TTFT up to the timer
    # (two runs of one budget on a shared CPU differ by 20% and more).
    if mine.chunks > ref.chunks:
        raise Mismatch(f"the prompt in {ref.chunks} chunks, as with the best budget (a longer "
                       f"TTFT with each extra chunk)", verdict,
                       "more chunks than the target needs: every step pays the decode step")
    return verdict + " (least disturbed of three runs each, side by side)"


CHUNK_BUDGET = Exercise(
    name="chunk_budget",
    chapter="04_chunked_prefill",
    title="the token budget for a gap target",
    kind="challenge",
    prompt=(
        "Choose max_num_batched_tokens for a server where decodes must never wait longer than "
        "a target between two tokens, while long prompts still start as soon as that allows. "
        "Too large a budget and the step with a chunk breaks the target; too small and the "
        "prompt needs more steps, each paying for the decode again. The check measures this "
        "machine's prefill rate and decode step, gives them to your function with a target, "
        "and runs a 512-token prompt into a decode with your budget and the best one."
    ),
    full_version=(
        "vLLM 0.33.0 picks its default budget by the GPU and by LLM class or API server "
        "(EngineArgs.get_batch_defaults in vllm/engine/arg_utils.py). A server has many "
        "decodes per step (chapter 03), so a step's decode part grows with the batch, and the "
        "worst gap with it. vLLM's long_prefill_token_threshold (vllm/config/scheduler.py; 0, off, by "
        "default) caps one long prompt's share of a step, so that several prompts are chunked "
        "side by side instead of one taking the whole budget."
    ),
    stub=CHUNK_STUB,
    hint=(
        "From the prediction above: a step whose budget B holds the decode's one token and a "
        "chunk of B - 1 prompt tokens takes about decode_step_s + (B - 1) / rate. Which B is "
        "best: any under max_gap_s, or the largest?"
    ),
    solution=choose_chunk_budget,
    cases=[
        Case("four other machines and targets, by the chapter's model of a step",
             _chunk_arithmetic, "Predicted worst gap: decode_step_s + (budget - 1) / rate; the "
             "largest budget whose prediction stays under the target."),
        Case("real model: a 512-token prompt into a decode, your budget beside the best",
             _chunk_measured, "Compare the worst gaps and TTFTs printed above.",
             real_model=True, timeout_s=300),
    ],
)

EXERCISES = [CHUNK_BUDGET]

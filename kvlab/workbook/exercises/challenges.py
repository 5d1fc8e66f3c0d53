"""Challenges: the participant makes a decision, and the check measures it on the real model.

An exercise of `kind == "challenge"` asks for a choice, not a mechanism: a setting, or a small
function that returns one. Its check runs the participant's choice and kvlab's reference choice
side by side on the real model, in one run, and says how close the participant came to the best
and why. A do-nothing answer (the stub) is "not done yet"; a choice that breaks the workload
fails with what it cost.

    03 max_num_seqs   the concurrency limit that keeps a burst unpreempted at full speed
    04 chunk_budget   the token budget that keeps a decode's worst gap under a target
    05 rag_layout     the order of a RAG prompt's parts that the prefix cache reuses most
    06 salt_scheme    the salt a server attaches, so that a stolen salt string opens nothing

The chapters 01 and 02 challenges size the KV pool: `challenges_pool`.
"""

from __future__ import annotations

import time

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, Skip, positive_int
from kvlab.sampling import RequestOutputKind, SamplingParams

# ---- 03: max_num_seqs for a KV budget ------------------------------------------------------------
BURST = dict(num_requests=16, prompt_len=24, output_len=8)
POOL = dict(kv_cache_tokens=256, block_size=16, max_model_len=64)


def choose_max_num_seqs(kv_cache_tokens, block_size, prompt_len, output_len):
    """The largest number of requests whose whole KV fits in the pool at once."""
    # A request ends holding prompt + output tokens, in whole blocks; the pool holds
    # kv_cache_tokens // block_size blocks. Past that many running requests, someone must be
    # preempted before it finishes ([KV-Anatomy]: concurrency near KV tokens / request length).
    blocks_per_request = -(-(prompt_len + output_len) // block_size)
    return max(1, (kv_cache_tokens // block_size) // blocks_per_request)


MAX_NUM_SEQS_STUB = '''def choose_max_num_seqs(kv_cache_tokens, block_size, prompt_len, output_len):
    """Return max_num_seqs (an int >= 1) for a burst of requests, each a prompt_len-token prompt
    and output_len new tokens, in a pool of kv_cache_tokens tokens (blocks of block_size). The
    check runs 16 such requests at once: nothing may be preempted, and the throughput must be
    within 20% of the best choice's, measured side by side."""
    raise NotImplementedError("your turn")
'''


def _burst_run(max_num_seqs: int) -> dict:
    """The burst through a fresh engine: tokens/s (wall), preemptions, peak running."""
    from kvlab.engine import LLM

    prompts = _real_engine.prompt_ids([BURST["prompt_len"]] * BURST["num_requests"])
    sp = SamplingParams(max_tokens=BURST["output_len"], temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    with _real_engine.one_thread():
        llm = LLM(**POOL, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=BURST["prompt_len"] * BURST["num_requests"])
        llm.generate({"prompt_token_ids": prompts[0]}, sp)  # warm-up
        first = llm.llm_engine.num_steps
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        seconds = time.perf_counter() - t0
    trace = [r for r in llm.llm_engine.step_trace if r.step > first]
    return {"tok_s": BURST["num_requests"] * BURST["output_len"] / seconds,
            "preemptions": llm.stats()["num_preemptions"],
            "peak_running": max(r.num_running for r in trace),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def _choice(impl, **workload) -> int:
    return positive_int(impl(**workload))


def _max_num_seqs_arithmetic(impl) -> None:
    """Other pools and lengths (so that a constant cannot pass): no more running requests than
    the pool holds to the end, no fewer than 80% of them, and never below one."""
    # The last pool holds less than one whole request: still one seat (it runs, preempted).
    for kv, bs, p, o in [(1024, 16, 48, 16), (2048, 16, 100, 30), (512, 8, 30, 11),
                         (4096, 32, 500, 12), (128, 16, 100, 60)]:
        got = _choice(impl, kv_cache_tokens=kv, block_size=bs, prompt_len=p, output_len=o)
        best = choose_max_num_seqs(kv, bs, p, o)
        if not 0.8 * best <= got <= best:
            raise Mismatch(f"between {-(-8 * best // 10)} and {best} for a {kv}-token pool, "
                           f"blocks of {bs}, requests of {p} + {o} tokens",
                           f"{got}: " + ("some would be preempted before they finish"
                                         if got > best else "KV room left for more requests"))


def _max_num_seqs_measured(impl) -> None:
    chosen = _choice(impl, kv_cache_tokens=POOL["kv_cache_tokens"],
                     block_size=POOL["block_size"], prompt_len=BURST["prompt_len"],
                     output_len=BURST["output_len"])
    best = choose_max_num_seqs(POOL["kv_cache_tokens"], POOL["block_size"],
                               BURST["prompt_len"], BURST["output_len"])
    ref = _burst_run(best)
    # The same choice as the best is the same run; another is timed beside it and, if it looks
    # slow, both once more, keeping each one's faster run (a busy core only adds time).
    mine = ref if chosen == best else _burst_run(chosen)
    if chosen != best and mine["tok_s"] < 0.8 * ref["tok_s"] and mine["preemptions"] == 0:
        again_ref, again_mine = _burst_run(best), _burst_run(chosen)
        ref["tok_s"] = max(ref["tok_s"], again_ref["tok_s"])
        mine["tok_s"] = max(mine["tok_s"], again_mine["tok_s"])
    if mine["tokens"] != ref["tokens"]:
        raise Mismatch("the same tokens as the best choice's run", "different tokens")
    verdict = (f"yours (max_num_seqs={chosen}): {mine['tok_s']:.1f} tok/s, "
               f"{mine['preemptions']} preemptions, {mine['peak_running']} running at most; "
               f"best ({best}): {ref['tok_s']:.1f} tok/s, {ref['preemptions']} preemptions")
    if mine["preemptions"] > 0:
        raise Mismatch("no preemption", verdict, "more running requests than the pool holds "
                       "to the end: each preempted one is recomputed, work that yields no token")
    if mine["tok_s"] < 0.8 * ref["tok_s"]:
        raise Mismatch("throughput within 20% of the best choice's", verdict,
                       "seats left empty while the pool still had room: a smaller batch per "
                       "step, the same weights read for fewer tokens")
    return (f"{verdict} (one run each, side by side, on a shared CPU: compare them, not the "
            f"absolute tok/s); {mine['tok_s'] / ref['tok_s']:.0%} of the best's throughput")


MAX_NUM_SEQS = Exercise(
    name="max_num_seqs",
    chapter="03_continuous_batching",
    title="max_num_seqs for a KV budget",
    kind="challenge",
    prompt=(
        "Choose the concurrency limit for a burst of equal requests in a small pool. Too high "
        "and running requests are preempted and recomputed; too low and seats sit empty while "
        "the pool has room. The check measures your choice and the best one side by side on "
        "the real model: preemptions, and throughput within 20%."
    ),
    full_version=(
        "A real burst rarely has one length, and the output length is not known in advance: "
        "[KV-Anatomy] sets the limit near KV tokens / mean request length, and a server keeps "
        "some preemption (chapter 03) rather than reserve every request's longest output. "
        "kvlab and vLLM also refuse to admit a prompt whose whole length does not fit "
        "(scheduler_reserve_full_isl, chapter 04)."
    ),
    stub=MAX_NUM_SEQS_STUB,
    hint=(
        "A request ends holding prompt_len + output_len tokens, in whole blocks: "
        "ceil((prompt_len + output_len) / block_size). How many such requests fit in "
        "kv_cache_tokens // block_size blocks?"
    ),
    solution=choose_max_num_seqs,
    cases=[
        Case("five other pools and request lengths, by the arithmetic", _max_num_seqs_arithmetic,
             "Count blocks, not tokens: a request's last block is whole even when half full."),
        Case("real model: 16 requests of 24 + 8 tokens in a 256-token pool, yours beside the "
             "best", _max_num_seqs_measured, "Compare the preemptions and tok/s printed above.",
             real_model=True, timeout_s=600),
    ],
)


# ---- 04: the token budget for a worst-gap target ------------------------------------------------
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


# ---- 05: the layout of a RAG prompt ---------------------------------------------------------------
def rag_prompt(system, document, question):
    """The prompt's token ids: what every request shares first, what varies last."""
    # The prefix cache matches from the first token and stops at the first block that differs:
    # the system prompt (shared by every request), then the document (shared by the questions
    # about it), then the question (each request's own).
    return list(system) + list(document) + list(question)


RAG_STUB = '''def rag_prompt(system, document, question):
    """Return one request's prompt, a list of token ids, made of the three parts (each a list
    of token ids): every token of each, once, in the order you choose. The check sends
    questions about documents under one system prompt to an engine with prefix caching and
    counts the prompt tokens served from the cache."""
    raise NotImplementedError("your turn")
'''


SYSTEM_TEXT = ("You are a careful assistant for a library. Answer from the document below, "
               "quote it where you can, and say so when the document does not say.")
DOCUMENTS = (
    "The city library opens at nine on weekdays and at ten on Saturdays. It is closed on "
    "Sundays and public holidays. Members may borrow up to twelve books for three weeks, and "
    "renew each loan twice online unless another member has reserved the book. Late returns "
    "cost twenty cents a day per book, capped at the price of the book.",
    "The reading room on the second floor is reserved for quiet study. Laptops are welcome, "
    "phone calls are not. Lockers near the entrance take a one euro coin, returned when the "
    "locker is opened again. Group study rooms can be booked for two hours at a time, up to a "
    "week ahead, at the front desk or on the library's website.",
)
QUESTIONS = ("When does it open on Saturday?", "How long is a loan?", "What does a locker cost?")


def _rag_parts():
    from kvlab.model import load_model

    tok = load_model().tokenizer
    encode = lambda text: tok(text).input_ids  # noqa: E731
    return encode(SYSTEM_TEXT), [encode(d) for d in DOCUMENTS], [encode(q) for q in QUESTIONS]


def _rag_prompts(impl) -> list[list[int]]:
    system, docs, questions = _rag_parts()
    prompts = []
    for d in docs:
        for q in questions:
            p = impl(list(system), list(d), list(q))
            if not isinstance(p, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise Mismatch("a list of token ids", repr(p)[:80])
            if sorted(p) != sorted(system + d + q):
                raise Mismatch("every token of the system prompt, the document and the question, "
                               "each once", f"{len(p)} tokens, not the three parts' "
                               f"{len(system) + len(d) + len(q)}")
            prompts.append(list(p))
    return prompts


def _rag_parts_kept(impl) -> None:
    _rag_prompts(impl)


def _rag_cached(prompts: list[list[int]]) -> tuple[int, int]:
    """Cached prompt tokens and prompt tokens in all, requests sent one after another."""
    from kvlab.engine import LLM

    sp = SamplingParams(max_tokens=1, temperature=0,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    with _real_engine.one_thread():
        llm = LLM(block_size=16, kv_cache_tokens=4096, max_model_len=512,
                  enable_prefix_caching=True)
        cached = sum(llm.generate({"prompt_token_ids": p}, sp)[0].num_cached_tokens
                     for p in prompts)
    return cached, sum(len(p) for p in prompts)


def _rag_measured(impl) -> None:
    mine, total = _rag_cached(_rag_prompts(impl))
    best, _ = _rag_cached(_rag_prompts(rag_prompt))
    verdict = (f"{mine:,} of {total:,} prompt tokens from the cache ({mine / total:.0%}); the "
               f"best layout: {best:,} ({best / total:.0%})")
    if mine < best:
        raise Mismatch("as many cached tokens as the best layout", verdict,
                       "the cache matches from the first token and stops at the first block "
                       "that differs: whatever varies between requests ends the reuse there")
    return verdict + ": the shared parts first, the question last"


RAG_LAYOUT = Exercise(
    name="rag_layout",
    chapter="05_prefix_caching",
    title="the layout of a RAG prompt",
    kind="challenge",
    prompt=(
        "A RAG service sends each question with a system prompt and the document it is about. "
        "Choose the order of the three parts in the prompt so that the prefix cache serves the "
        "most prompt tokens. The check sends three questions about each of two documents, with "
        "your layout and the best one, and counts the cached tokens of each."
    ),
    full_version=(
        "In a real service the parts also carry chat-template tokens, and anything that varies "
        "early (a timestamp in the system prompt, documents retrieved in another order) ends "
        "the match at its block. Only requests with the same cache_salt share (chapter 06)."
    ),
    stub=RAG_STUB,
    hint=(
        "The cache matches from the first token and stops at the first block that differs. "
        "Which part is the same in every request, which in some, which in one?"
    ),
    solution=rag_prompt,
    cases=[
        Case("every token of the three parts, once", _rag_parts_kept,
             "Concatenate the three lists; do not drop or repeat a part."),
        Case("real model: cached prompt tokens, yours against the best layout", _rag_measured,
             "Put first what every request shares.", real_model=True, timeout_s=300),
    ],
)

# ---- 06: who chooses the salt --------------------------------------------------------------------
def cache_salt_for(tenant, requested_salt):
    """The salt the server attaches to a request from the authenticated `tenant`."""
    # Derived from who sent the request, which the client cannot forge (its API key said it),
    # never from what the request body says: a salt string read in a log or a client bundle
    # then opens nothing. (A scheme may also mix the requested salt in after the tenant, to
    # split a tenant's own cache further; the check measures the property, not the form.)
    return tenant


SALT_STUB = '''def cache_salt_for(tenant, requested_salt):
    """Return the cache_salt (a str) your server attaches to a request. tenant: who sent it,
    as the server authenticated it (from the API key; the client cannot forge it).
    requested_salt: the "cache_salt" the request's body carries, or None; the client chose it,
    and an attacker may have read another tenant's salt string and sent it. The check sends
    documents as two tenants on the real model and counts the cached tokens each one gets."""
    raise NotImplementedError("your turn")
'''


def _salt_value(impl, tenant, requested):
    value = impl(tenant, requested)
    if not isinstance(value, str) or not value:
        raise Mismatch("a non-empty str", repr(value))
    return value


def _salt_returns_strings(impl) -> None:
    for tenant, requested in [("tenant-a", None), ("tenant-a", "x"), ("tenant-b", "tenant-a")]:
        _salt_value(impl, tenant, requested)


def _salt_measured(impl) -> None:
    from kvlab.engine import LLM

    docs = _real_engine.prompt_ids([64, 64, 64, 64], offset=3)
    sp = SamplingParams(max_tokens=1, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    with _real_engine.one_thread():
        llm = LLM(block_size=16, kv_cache_tokens=2048, max_model_len=128,
                  enable_prefix_caching=True)

        def send(doc, tenant, requested):
            prompt = {"prompt_token_ids": doc, "cache_salt": _salt_value(impl, tenant, requested)}
            return llm.generate(prompt, sp)[0].num_cached_tokens

        rows = []
        # (what happens, the victim's request, the attacker's request, whether it may hit)
        scenes = [("tenant A sends a document again", ("tenant-a", "a-secret"),
                   ("tenant-a", "a-secret"), True),
                  ("tenant B sends A's salt string, stolen", ("tenant-a", "a-secret"),
                   ("tenant-b", "a-secret"), False),
                  ("tenant B sends no salt", ("tenant-a", None), ("tenant-b", None), False),
                  ("tenant B sends A's tenant name as its salt", ("tenant-a", None),
                   ("tenant-b", "tenant-a"), False)]
        for doc, (what, first, second, may_hit) in zip(docs, scenes):
            send(doc, *first)
            rows.append((what, send(doc, *second), may_hit))
    report = "; ".join(f"{what}: {cached} cached" for what, cached, _ in rows)
    for what, cached, may_hit in rows:
        if may_hit and cached == 0:
            raise Mismatch(f"{what}: cache hits (a tenant keeps its own reuse)",
                           "0 cached tokens", report)
        if not may_hit and cached > 0:
            raise Mismatch(f"{what}: 0 cached tokens", f"{cached} cached tokens", report)
    return report


SALT_SCHEME = Exercise(
    name="salt_scheme",
    chapter="06_cache_salt",
    title="a salt scheme a stolen salt cannot open",
    kind="challenge",
    prompt=(
        "You run the server, and you decide the cache_salt each request gets. A tenant must "
        "keep its own cache hits, and no other tenant may reach its blocks, even one who read "
        "its salt string somewhere and sends it. The check sends documents as two tenants "
        "through a real engine with prefix caching and counts the cached tokens of each."
    ),
    full_version=(
        "kvlab serve's key mode (next section) derives the salt from the API key's tenant with "
        "a server-side secret, and refuses a body's cache_salt outright; vLLM itself takes the "
        "salt from the request body, so in front of vLLM it is a gateway's job. The salt "
        "closes the prefix-hit channel only: a tenant's long prefill still delays others "
        "(chapter 04), and a shared pool still evicts everyone's blocks."
    ),
    stub=SALT_STUB,
    hint=(
        "What can the attacker not choose? The requested salt is theirs to write; the tenant "
        "the server authenticated is not."
    ),
    solution=cache_salt_for,
    cases=[
        Case("a non-empty str for every request", _salt_returns_strings,
             "Return a string: the salt the engine hashes into block 0's key."),
        Case("real model: own hits kept, a stolen or guessed salt opens nothing", _salt_measured,
             "The attacker writes the request body; the tenant comes from the API key.",
             real_model=True, timeout_s=300),
    ],
)

EXERCISES_03 = [MAX_NUM_SEQS]
EXERCISES_04 = [CHUNK_BUDGET]
EXERCISES_05 = [RAG_LAYOUT]
EXERCISES_06 = [SALT_SCHEME]

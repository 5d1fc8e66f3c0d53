"""Chapter 05 challenge: the layout of a RAG prompt, for the prefix cache.

What it asks: the order of a RAG prompt's three parts (system prompt, document, question)
that the prefix cache serves the most prompt tokens from. Checked first that every token is
kept, then on the real model: cached prompt tokens with the participant's layout and the
best one.
"""

from __future__ import annotations

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch
from kvlab.sampling import RequestOutputKind, SamplingParams


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
             "Chapter 05's hash chain: a key depends on every token before it, so the cache "
             "matches from the first token. Put first what every request shares.", real_model=True, timeout_s=300),
    ],
)

EXERCISES = [RAG_LAYOUT]

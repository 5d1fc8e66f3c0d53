"""Chapter 05's RAG layouts on the real model: what each order of the parts lets the cache serve,
counted from the parts' lengths in whole blocks (so a wrong count in the bench cannot pass)."""

from kvlab.bench import prefix


def test_shared_parts_first_cache_whole_blocks_and_a_question_first_ends_the_match():
    block = 16
    r = prefix.rag_layouts(block_size=block)
    system, docs = r["lengths"]["system"], r["lengths"]["documents"]
    best = r["cached"][("system", "document", "question")]
    # A document's later questions find the system prompt and the document, in whole blocks.
    per_doc = [best[i * 3:(i + 1) * 3] for i in range(len(docs))]
    for cached, doc in zip(per_doc, docs):
        assert cached[1:] == [(system + doc) // block * block] * 2
    assert best[0] == 0  # a cold cache
    # The other orders put something that varies before a document: they serve less.
    for order, cached in r["cached"].items():
        if order != ("system", "document", "question"):
            assert sum(cached) < sum(best)
    # A question first: document 1's questions differ from their first token on.
    assert r["cached"][("question", "system", "document")][:3] == [0, 0, 0]
    assert len({*r["prompt_tokens"].values()}) == 1  # every order keeps every token

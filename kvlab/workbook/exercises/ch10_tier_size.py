"""Chapter 10 challenge: the smallest second tier that keeps a multi-tenant workload's hits.

What it asks: kv_offloading_size for tenants who take turns asking about their own documents,
behind a pool too small to keep them: as few GiB as possible, and every hit an unbounded tier
would give. Too small a tier and its least recently used blocks go before their tenant comes
back: a tenant whose document's first block is gone finds nothing, however much of the rest
is kept; too big and memory sits idle. Checked on the real model: the participant's tier
beside the smallest one that gets every hit, found by a search on the same engine, for two
workloads.
"""

from __future__ import annotations

import random

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch

GIB = 1 << 30
SLACK = 0.25  # a tier more than this much above the smallest that keeps every hit
WORKLOADS = [
    dict(doc_lens=[120, 200, 80, 160], question_len=12, rounds=3, block_size=16,
         pool_tokens=256),
    dict(doc_lens=[96, 96, 96, 96, 96], question_len=20, rounds=2, block_size=8,
         pool_tokens=200),
]


def choose_tier_size(doc_lens, question_len, rounds, block_size, pool_tokens, block_bytes):
    """GiB for a tier that keeps every tenant's document until its next turn."""
    # Every request stores its prompt's full blocks, its question's among them. When a tenant
    # comes back, the tier has since taken one request of every other tenant: all of their
    # blocks are more recent than this tenant's, and only this tenant's own tail (its question
    # blocks) is less recent than its document. So the tier must hold one round's full prompt
    # blocks.
    blocks = sum((d + question_len) // block_size for d in doc_lens)
    return blocks * block_bytes / 2**30  # kv_offloading_size is in GiB


STUB = '''def choose_tier_size(doc_lens, question_len, rounds, block_size, pool_tokens, block_bytes):
    """Return kv_offloading_size (GiB, a float) for this workload: tenant t has a document of
    doc_lens[t] tokens (and its own cache salt); in each of `rounds` rounds every tenant in
    turn sends one request, its document then a new question of question_len tokens, and waits
    for the answer before the next request is sent. The pool holds pool_tokens tokens, too few
    to keep the documents from one round to the next; blocks of block_size tokens, block_bytes
    bytes each in the tier (vLLM's kv_offloading_size is in GiB: 2**30 bytes).
    The check runs the workload on the real model with your tier: it must find every cached
    token an unbounded tier finds, in at most 25% more than the smallest tier that does
    (found by a search on the same engine)."""
    raise NotImplementedError("your turn")
'''


def _block_bytes(block_size: int) -> int:
    """One block of the packaged model in the tier: K and V of block_size tokens in each of
    its 30 layers, 3 KV heads of 64 float32 values."""
    return 30 * 2 * block_size * 3 * 64 * 4


def _requests(w: dict, seed: int = 5) -> list[dict]:
    from kvlab.bench.prefix import random_prompt

    rng = random.Random(seed)
    docs = [random_prompt(rng, n) for n in w["doc_lens"]]
    return [{"prompt_token_ids": docs[t] + random_prompt(rng, w["question_len"]),
             "cache_salt": f"tenant-{t}"}
            for _ in range(w["rounds"]) for t in range(len(docs))]


def _hits(w: dict, tier_blocks: int | None, requests) -> int:
    """The workload's cached tokens (the pool's and the tier's) with a tier of tier_blocks."""
    from kvlab import LLM, SamplingParams

    size = None if not tier_blocks else tier_blocks * _block_bytes(w["block_size"]) / GIB
    longest = max(w["doc_lens"]) + w["question_len"]
    llm = LLM(block_size=w["block_size"], kv_cache_tokens=w["pool_tokens"],
              max_model_len=longest + 4, kv_offloading_size=size)
    sp = SamplingParams(max_tokens=1, temperature=0)
    for r in requests:
        llm.generate(r, sp)
    s = llm.stats()
    return s["prefix_cache_hits"] + s["external_prefix_cache_hits"]


def _choice(impl, w: dict) -> tuple[float, int]:
    """The participant's kv_offloading_size for workload `w`, and the tier blocks it holds."""
    bb = _block_bytes(w["block_size"])
    got = impl(**w, block_bytes=bb)
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not got > 0:
        raise Mismatch("kv_offloading_size: GiB, a number > 0", repr(got))
    return got, int(got * GIB) // bb


def _smallest_tier(hi: int, finds_all) -> int:
    """The fewest tier blocks in 1..hi for which `finds_all(blocks)` holds (an LRU tier keeps
    more when it is bigger, so the answer is a threshold: a binary search finds it)."""
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if finds_all(mid) else (mid + 1, hi)
    return lo


def _measured(w: dict):
    def run(impl) -> str:
        got, mine_blocks = _choice(impl, w)
        requests = _requests(w)
        unbounded = sum((d + w["question_len"]) // w["block_size"] for d in w["doc_lens"])
        with _real_engine.one_thread():
            best = _hits(w, unbounded * w["rounds"], requests)
            mine = _hits(w, mine_blocks, requests)
            verdict = (f"yours: {got:.4f} GiB ({mine_blocks} blocks), {mine} cached tokens; "
                       f"an unbounded tier: {best}")
            if mine < best:
                raise Mismatch(f"{best} cached tokens", verdict,
                               "blocks went before their tenant came back: count what the tier "
                               "takes between a tenant's turns")
            lo = _smallest_tier(mine_blocks, lambda n: _hits(w, n, requests) >= best)
        verdict += f"; the smallest tier that finds them all: {lo} blocks"
        if mine_blocks > lo * (1 + SLACK):
            raise Mismatch(f"at most {int(lo * (1 + SLACK))} blocks ({SLACK:.0%} above the "
                           "smallest)", verdict, "a block of a tenant's question is never "
                           "asked for again; count what must survive until the next turn")
        return verdict + f"; yours is {mine_blocks / lo:.2f}x the smallest"
    return run


# Other workloads for the fast case: graded against the tier alone, without the model.
OTHER_WORKLOADS = [
    dict(doc_lens=[64, 100, 150], question_len=10, rounds=2, block_size=16, pool_tokens=192),
    dict(doc_lens=[200, 60, 120, 90, 40], question_len=24, rounds=2, block_size=8,
         pool_tokens=240),
    dict(doc_lens=[300, 300], question_len=16, rounds=3, block_size=16, pool_tokens=336),
]


def _tier_alone(w: dict, tier_blocks: int, requests) -> int:
    """The workload's tokens found in a tier of tier_blocks, with no pool in front of it and
    no model: kvlab's OffloadingConnector's own index (its scheduler side), fed each request's
    block keys as the engine feeds them. A pool in front can only find more."""
    from types import SimpleNamespace

    from kvlab.kv_transfer import KVConnectorOutput, KVConnectorRole, KVTransferConfig
    from kvlab.kv_transfer.offloading_connector import OffloadingConnector
    from kvlab.prefix_cache import extend_block_hashes

    bs = w["block_size"]
    conn = OffloadingConnector(KVTransferConfig("OffloadingConnector", kv_connector_extra_config={
        "cpu_bytes_to_use": tier_blocks}), KVConnectorRole.SCHEDULER, bs, block_bytes=1)
    found = 0
    for i, r in enumerate(requests):
        ids = r["prompt_token_ids"]
        keys: list[bytes] = []
        extend_block_hashes(keys, lambda a, b: ids[a:b], len(ids), bs, r["cache_salt"])
        req = SimpleNamespace(request_id=f"r{i}", block_hashes=keys, num_tokens=len(ids),
                              num_prompt_tokens=len(ids))
        hit, _ = conn.get_num_new_matched_tokens(req, 0)
        blocks = list(range(1, len(keys) + 2))
        conn.update_state_after_alloc(req, blocks, hit)
        meta = conn.build_connector_meta(SimpleNamespace(
            scheduled=[(req, len(ids) - hit)], num_computed_tokens={req.request_id: hit},
            block_ids={req.request_id: blocks}))
        # What the worker would report: the load done, the stores written.
        conn.update_connector_output(KVConnectorOutput(
            finished_recving={req.request_id}, finished_stores=[s.keys for s in meta.stores]))
        conn.request_finished(req, blocks)
        found += hit
    return found


def _arithmetic(impl) -> None:
    """Other workloads (so that a constant cannot pass), against the tier alone: within 25%
    either side of the smallest tier that keeps every hit with no pool in front of it (a pool
    can only lower that; the real-model cases measure it)."""
    for w in OTHER_WORKLOADS:
        _, mine = _choice(impl, w)
        requests = _requests(w)
        everything = _tier_alone(w, 10_000, requests)
        lo = _smallest_tier(10_000, lambda n: _tier_alone(w, n, requests) >= everything)
        if not lo / (1 + SLACK) <= mine <= lo * (1 + SLACK):
            raise Mismatch(f"about {lo} blocks, within {SLACK:.0%} ({_describe(w)})",
                           f"{mine} blocks", "count what the tier stores between two turns of "
                           "one tenant, and which of it is less recent than that tenant's "
                           "document")


def _describe(w: dict) -> str:
    return (f"{len(w['doc_lens'])} tenants, documents of {w['doc_lens']} tokens, questions of "
            f"{w['question_len']}, {w['rounds']} rounds, blocks of {w['block_size']}")


TIER_SIZE = Exercise(
    name="tier_size",
    chapter="10_offloading",
    title="a tier for tenants who take turns",
    kind="challenge",
    prompt=(
        "Size the second tier (kv_offloading_size, in GiB) for tenants who take turns asking "
        "about their own documents behind a pool too small to keep them: every cached token an "
        "unbounded tier would find, in as little memory as you can. The path's sweep shows "
        "what a tier too small finds. The check tries three workloads against the tier alone, "
        "then runs two on the real model with your tier and searches for the smallest tier "
        "that finds everything; up to 25% above it passes."
    ),
    full_version=(
        "vLLM's native offloading (vllm/distributed/kv_transfer/kv_connector/v1/"
        "offloading_connector.py) defaults to an LRU policy (vllm/v1/kv_offload/cpu/policies/"
        "lru.py) and has an ARC policy too, which keeps blocks used more than once ahead of "
        "blocks used once, such as a question's; a store threshold can also skip blocks seen "
        "fewer than N times. LMCache adds tiers below host memory (local disk, a remote "
        "store). The tier's keys are chapter 05's prefix-cache keys, salt included (chapter "
        "06), so tenants never share a tier's block."
    ),
    stub=STUB,
    hint=(
        "In the sweep, which tier sizes found nothing and where did the hits start? Between "
        "two turns of one tenant, which blocks were stored? Each of them is more recent than "
        "that tenant's document."
    ),
    solution=choose_tier_size,
    cases=[Case("three other workloads, against the tier alone", _arithmetic,
                "One turn of the tenants' stored full prompt blocks must fit.")]
    + [Case(f"real model: {_describe(w)}", _measured(w),
            "Compare the cached tokens printed above with an unbounded tier's.",
            real_model=True, timeout_s=600) for w in WORKLOADS],
)

EXERCISES = [TIER_SIZE]

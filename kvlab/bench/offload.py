"""KV beyond the pool (chapter 10): a second tier's hit rate and TTFT by its size, loading
against recomputing by prompt length, and preempted requests restored from the tier.

Each function builds fresh engines and runs them one after another in this process; no other
torch job should run meanwhile (two on these cores slow each other many times over).
"""

from __future__ import annotations

import random
import statistics

from kvlab.bench.common import make_prompts
from kvlab.bench.engine_loop import run_burst
from kvlab.bench.prefix import random_prompt
from kvlab.engine import LLM
from kvlab.sampling import SamplingParams

GIB = 1 << 30


def tier_gib(num_blocks: int, llm: LLM) -> float:
    """The kv_offloading_size (GiB) that holds `num_blocks` of this engine's blocks."""
    e = llm.llm_engine
    return num_blocks * e.kv_bytes_per_token * e.config.block_size / GIB


def tier_gib_per_block(block_size: int, model: str | None = None) -> float:
    """The GiB one tier block of `block_size` tokens takes for `model`, from one small engine
    (the tier is sized before its engine exists)."""
    return tier_gib(1, LLM(model, block_size=block_size, kv_cache_tokens=block_size))


def rag_requests(num_tenants: int, rounds: int, doc_len: int, question_len: int,
                 seed: int = 0) -> list[dict]:
    """A multi-tenant RAG workload: each tenant has its own document (and its own cache
    salt, chapter 06) and asks `rounds` questions about it, tenants in turn: tenant 0, 1, ...,
    then tenant 0 again. Distinct random tokens, so only a tenant's own document is shared."""
    rng = random.Random(seed)
    docs = [random_prompt(rng, doc_len) for _ in range(num_tenants)]
    return [{"prompt_token_ids": docs[t] + random_prompt(rng, question_len),
             "cache_salt": f"tenant-{t}"}
            for _ in range(rounds) for t in range(num_tenants)]


def run_one_by_one(llm: LLM, requests: list[dict], max_tokens: int) -> dict:
    """Each request alone, in order (a request arrives when the last has its answer): the
    pool's prefix cache holds what the last requests left. Per request its TTFT; overall
    the pool's and the tier's hits, and the tokens."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    before = llm.stats()
    ttfts, tokens, cached = [], [], []
    for r in requests:
        out = llm.generate(r, sp)[0]
        ttfts.append(out.metrics.ttft)
        tokens.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)  # the pool's hit and the tier's
    s = llm.stats()
    queries = s["prefix_cache_queries"] - before["prefix_cache_queries"]
    pool = s["prefix_cache_hits"] - before["prefix_cache_hits"]
    tier = s["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
    return {"ttfts": ttfts, "tokens": tokens, "cached": cached, "queries": queries,
            "pool_hits": pool,
            "tier_hits": tier,
            "load_gb": (s["kv_offload_load_bytes"] - before["kv_offload_load_bytes"]) / 1e9,
            "load_s": s["kv_offload_load_time"] - before["kv_offload_load_time"]}


def tier_size_sweep(tier_docs=(0, 2, 4, 6), num_tenants: int = 4, rounds: int = 3,
                    doc_len: int = 240, question_len: int = 16, pool_docs: float = 2.5,
                    max_tokens: int = 4, block_size: int = 16, seed: int = 0,
                    model: str | None = None) -> list[dict]:
    """The RAG workload through a pool that holds `pool_docs` documents, with a tier that
    holds `tier_docs` documents' blocks (0: no tier). Per size, over the repeat rounds (the
    first round finds nothing anywhere): the tier's blocks and GiB, the share of their prompt
    tokens found (the pool's hit and the tier's), the most that could be found (each document,
    in whole blocks), their median TTFT, and whether the tokens equal the run without a tier."""
    requests = rag_requests(num_tenants, rounds, doc_len, question_len, seed)
    prompt_len = doc_len + question_len
    doc_blocks = doc_len // block_size
    rows, want = [], None
    gib_per_block = tier_gib_per_block(block_size, model)
    for docs in tier_docs:
        size = int(docs * doc_blocks) * gib_per_block if docs else None
        llm = LLM(model, block_size=block_size, max_model_len=prompt_len + max_tokens + 1,
                  kv_cache_tokens=int(pool_docs * doc_len), kv_offloading_size=size)
        warm = random.Random(99)  # warm-up at the workload's length, unsalted: shares nothing
        llm.generate([{"prompt_token_ids": random_prompt(warm, prompt_len)} for _ in range(2)],
                     SamplingParams(max_tokens=max_tokens))
        r = run_one_by_one(llm, requests, max_tokens)
        if want is None:
            want = r["tokens"]
        repeat = r["ttfts"][num_tenants:]
        repeat_tokens = prompt_len * len(repeat)
        rows.append({
            "tier_docs": docs,
            "tier_blocks": llm.stats()["kv_offload_tier_blocks"],
            "kv_offloading_size_gib": round(size or 0.0, 4),
            "hit_rate": sum(r["cached"][num_tenants:]) / repeat_tokens,
            "ceiling": len(repeat) * (doc_len // block_size * block_size) / repeat_tokens,
            "median_ttft_ms": 1000 * statistics.median(repeat),
            "identical": r["tokens"] == want,
        })
    return rows


def load_vs_recompute(lengths=(16, 64, 256, 1024), repeats: int = 3, block_size: int = 16,
                      seed: int = 0, model: str | None = None) -> list[dict]:
    """One request alone, its prompt computed from nothing (no tier, a cold pool) or loaded
    from the tier (the pool's cache reset, the tier kept). Per prompt length: the median TTFT
    of each, the tokens the tier supplied, and its bytes per second while loading.

    `reset_prefix_cache()` empties the pool's prefix cache only, as vLLM's does by default
    (its connector's cache is reset only when asked)."""
    rng = random.Random(seed)
    top = max(lengths)
    kw = dict(block_size=block_size, max_model_len=top + 8, max_num_batched_tokens=top + 8,
              kv_cache_tokens=2 * top + 64)
    plain = LLM(model, **kw)
    tiered = LLM(model, kv_offloading_size=tier_gib(2 * top // block_size + 8, plain), **kw)
    one = SamplingParams(max_tokens=1, temperature=0)
    for llm in (plain, tiered):  # warm-up
        llm.generate({"prompt_token_ids": random_prompt(rng, 64)}, one)
    rows = []
    for n in lengths:
        recompute, load, bandwidth, supplied = [], [], [], 0
        for _ in range(repeats):
            p = {"prompt_token_ids": random_prompt(rng, n)}
            plain.reset_prefix_cache()
            a = plain.generate(p, one)[0]
            tiered.generate(p, one)  # the prompt's full blocks go to the tier
            tiered.reset_prefix_cache()
            before = tiered.stats()
            b = tiered.generate(p, one)[0]
            s = tiered.stats()
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            supplied = s["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
            dt = s["kv_offload_load_time"] - before["kv_offload_load_time"]
            if dt > 0:
                bandwidth.append((s["kv_offload_load_bytes"] - before["kv_offload_load_bytes"])
                                 / dt)
            recompute.append(a.metrics.ttft)
            load.append(b.metrics.ttft)
        rows.append({
            "prompt_len": n,
            "tier_tokens": supplied,
            "recompute_ttft_ms": 1000 * statistics.median(recompute),
            "load_ttft_ms": 1000 * statistics.median(load),
            "load_gb_per_s": statistics.median(bandwidth) / 1e9 if bandwidth else None,
        })
    return rows


def preemption_restore(num_requests: int = 12, min_len: int = 160, max_len: int = 240,
                       max_tokens: int = 32, kv_cache_tokens: int = 768, block_size: int = 16,
                       tier_blocks: int = 256, modes=("recompute", "prefix cache",
                                                      "prefix cache + tier"),
                       model: str | None = None) -> list[dict]:
    """Chapter 03's preemption burst with long prompts in a small pool: preempted requests
    recompute (prefix cache off), find what the pool still holds (vLLM's default), or find that
    and load the rest of their prompt from the tier. Per mode: preemptions, tokens computed
    again, tokens found in the pool, tokens loaded from the tier, wall time, and whether the
    tokens equal those of the first mode run (a "roomy" first mode, a pool 16 times bigger, is
    that reference and is not a row)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kwargs = {"roomy": {}, "recompute": {"enable_prefix_caching": False}, "prefix cache": {},
              "prefix cache + tier": {"tier": True}}
    gib_per_block = tier_gib_per_block(block_size, model)
    prompts, want, rows = None, None, []
    for name in modes:
        kw = dict(kwargs[name])
        size = tier_blocks * gib_per_block if kw.pop("tier", False) else None
        llm = LLM(model, block_size=block_size, max_model_len=max_len + max_tokens + block_size,
                  kv_cache_tokens=(16 * kv_cache_tokens if name == "roomy" else kv_cache_tokens),
                  kv_offloading_size=size, **kw)
        if prompts is None:
            prompts = [{"prompt_token_ids": p}
                       for p in make_prompts(llm.get_tokenizer(), num_requests, min_len, max_len)]
        llm.generate({"prompt_token_ids": random_prompt(random.Random(7), 32)},
                     SamplingParams(max_tokens=1))  # warm-up
        run = run_burst(llm, prompts, sp)
        tokens = run.pop("tokens")
        if want is None:
            want = tokens
            if name == "roomy":
                continue
        rows.append({"mode": name, **run, "identical": tokens == want})
    return rows


# ---- the path's small experiments -------------------------------------------------------------
def prompt_keys(llm: LLM, prompt: dict) -> list[bytes]:
    """The prefix-cache keys of a prompt's full blocks, as the engine computes them."""
    from kvlab.prefix_cache import extend_block_hashes

    ids, e = prompt["prompt_token_ids"], llm.llm_engine
    keys: list[bytes] = []
    extend_block_hashes(keys, lambda a, b: ids[a:b], len(ids), e.config.block_size,
                        prompt.get("cache_salt"), e.config.prefix_caching_hash_algo)
    return keys


def block_map(llm: LLM, prompt: dict) -> str:
    """Where each full block of the prompt is now: "P" in the pool's prefix cache, "T" in the
    tier only, "." in neither (one letter a block, in order)."""
    e = llm.llm_engine
    pool, tier = e.kv_cache_manager.block_pool, e.kv_connector.index
    return " ".join("P" if pool.get_cached_block(k) is not None else "T" if k in tier else "."
                    for k in prompt_keys(llm, prompt))


def knock_out(llm: LLM, prompt: dict, block_index: int) -> None:
    """An experiment: drop one of the prompt's blocks from the tier (as an eviction would)."""
    conn = llm.llm_engine.kv_connector
    key = prompt_keys(llm, prompt)[block_index]
    conn.free_slots.append(conn.index.pop(key))


def send(llm: LLM, prompt: dict, max_tokens: int = 1) -> dict:
    """Send one request alone; the tokens the pool found, the tier loaded, and the model
    computed for its prompt."""
    before = llm.stats()["external_prefix_cache_hits"]
    out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    tier = llm.stats()["external_prefix_cache_hits"] - before
    n = len(prompt["prompt_token_ids"])
    cached = out.num_cached_tokens
    return {"pool": cached - tier, "tier": tier,
            "computed": n - cached + (1 if cached == n else 0), "tokens": n,
            "token_ids": out.outputs[0].token_ids}


def block_maps(block_size: int = 16, seed: int = 2, model: str | None = None) -> list[dict]:
    """Three requests that show where a tier's load starts and stops, each with its block map
    just before it was sent: a document whose head the pool still holds, the same document
    with one block knocked out of the tier, and a prompt of whole blocks all in the tier."""
    rng = random.Random(seed)
    llm = LLM(model, block_size=block_size, kv_cache_tokens=14 * block_size,
              max_model_len=8 * block_size, kv_offloading_size=0.05)
    doc = random_prompt(rng, 5 * block_size)
    ask = lambda: {"prompt_token_ids": doc + random_prompt(rng, block_size // 2)}  # noqa: E731
    send(llm, ask())
    for _ in range(2):  # other documents push the first one's tail out of the pool
        send(llm, {"prompt_token_ids": random_prompt(rng, 6 * block_size)})
    rows = []
    p = ask()
    rows.append({"request": "the document again", "map": block_map(llm, p), **send(llm, p)})
    p = ask()
    llm.reset_prefix_cache()
    knock_out(llm, p, 3)
    rows.append({"request": "again, pool emptied, block 3 knocked out of the tier",
                 "map": block_map(llm, p), **send(llm, p)})
    whole = {"prompt_token_ids": random_prompt(rng, 4 * block_size)}
    send(llm, whole)
    llm.reset_prefix_cache()
    rows.append({"request": "a prompt of 4 whole blocks, pool emptied",
                 "map": block_map(llm, whole), **send(llm, whole)})
    return rows


def hook_trace(block_size: int = 16, model: str | None = None) -> list[tuple[int, str, str]]:
    """The connector hooks vLLM's engine calls, in their order, while one prompt is stored to
    the tier and then, after the pool is emptied, loaded from it: (step, side, hook). A step
    is one call of the scheduler's `schedule()` (each builds one connector metadata)."""
    llm = LLM(model, block_size=block_size, kv_cache_tokens=8 * block_size,
              max_model_len=6 * block_size, kv_offloading_size=0.01)
    e = llm.llm_engine
    calls: list[tuple[int, str, str]] = []
    step = [0]
    schedule = e.scheduler.schedule

    def counted_schedule():
        step[0] += 1
        return schedule()
    e.scheduler.schedule = counted_schedule
    hooks = {"scheduler": (e.kv_connector, ("get_num_new_matched_tokens",
                                            "update_state_after_alloc", "build_connector_meta",
                                            "update_connector_output", "request_finished")),
             "worker": (e.model_runner.kv_connector, ("start_load_kv", "wait_for_save",
                                                      "get_finished"))}
    for side, (conn, names) in hooks.items():
        for name in names:
            def logged(*args, _f=getattr(conn, name), _side=side, _name=name, **kw):
                calls.append((step[0], _side, _name))
                return _f(*args, **kw)
            setattr(conn, name, logged)
    prompt = {"prompt_token_ids": random_prompt(random.Random(5), 3 * block_size + 4)}
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
    calls.append((step[0], "", "-- pool emptied (reset_prefix_cache), same prompt again --"))
    llm.reset_prefix_cache()
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
    return calls

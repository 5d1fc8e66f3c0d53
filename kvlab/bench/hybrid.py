"""Chapter 09's experiments: the packaged model with sliding-window layers (`hf_overrides`), the
blocks each KV cache group holds as a request grows, capacity at the same bytes, and the
prefix hit when a window group keeps only some of its blocks."""

from __future__ import annotations

from kvlab.engine import LLM
from kvlab.kv_cache_interface import FullAttentionSpec, SLIDING_ATTENTION, FULL_ATTENTION
from kvlab.sampling import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def layer_types(num_layers: int, local_per_global: int) -> list[str]:
    """`local_per_global` sliding-window layers, then one full-attention layer, repeated from
    the first layer (Gemma 3's pattern is 5 to 1)."""
    period = local_per_global + 1
    return [FULL_ATTENTION if i % period == local_per_global else SLIDING_ATTENTION
            for i in range(num_layers)]


def overrides(window: int, local_per_global: int = 1, num_layers: int = 30) -> dict:
    """The `hf_overrides` that give the packaged model's 30 layers a window."""
    return {"layer_types": layer_types(num_layers, local_per_global), "sliding_window": window}


def group_kinds(llm: LLM) -> list[str]:
    """Each KV cache group's kind, in group order: "full" or "window"."""
    return ["full" if isinstance(g.spec, FullAttentionSpec) else "window"
            for g in llm.llm_engine.kv_cache_groups]


def window_trace(prompt_ids: list[int], max_tokens: int, window: int, block_size: int,
                 model: str | None = None) -> dict:
    """One request alone, step by step (the synchronous loop, so each step's tokens are
    known when it ends): the tokens in the cache and the blocks each group holds after each
    step, with the window group's block table (0 is the null block)."""
    llm = LLM(model, hf_overrides=overrides(window), block_size=block_size,
              max_model_len=len(prompt_ids) + max_tokens, enable_prefix_caching=False,
              async_scheduling=False, max_num_batched_tokens=max(64, len(prompt_ids)))
    engine, kv = llm.llm_engine, llm.llm_engine.kv_cache_manager
    kinds = group_kinds(llm)
    full, win = kinds.index("full"), kinds.index("window")
    engine.add_request("r", {"prompt_token_ids": prompt_ids},
                       SamplingParams(max_tokens=max_tokens, **GREEDY))
    rows = []
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.requests.get("r")
        if request is None:
            break
        held = kv.num_blocks_held("r")
        rows.append({"tokens": request.num_computed_tokens, "full": held[full],
                     "window": held[win], "window_table": kv.get_block_ids("r")[win]})
    return {"rows": rows, "window": window, "block_size": block_size,
            "free_after": llm.stats()["num_free_blocks"],
            "usable": llm.stats()["num_usable_blocks"]}


def capacity(patterns: dict[str, dict | None], kv_cache_tokens: int, block_size: int,
             max_model_len: int, max_num_batched_tokens: int, burst: int, prompt_len: int,
             output_len: int, prompt_ids, model: str | None = None) -> list[dict]:
    """For each model (None: every layer full attention), at the same KV bytes: the blocks in
    the pool, vLLM's start-up figures, and a burst run through it (requests running at once,
    the most and on average over its steps; preemptions)."""
    rows = []
    for name, hf in patterns.items():
        llm = LLM(model, hf_overrides=hf, block_size=block_size, kv_cache_tokens=kv_cache_tokens,
                  max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                  enable_prefix_caching=False)
        cap = llm.llm_engine.kv_cache_capacity()
        prompts = [{"prompt_token_ids": prompt_ids[i * 7: i * 7 + prompt_len]}
                   for i in range(burst)]
        llm.generate(prompts, SamplingParams(max_tokens=output_len, **GREEDY))
        trace = llm.llm_engine.step_trace
        stats = llm.stats()
        rows.append({"model": name, "groups": stats["num_kv_cache_groups"],
                     "num_blocks": stats["num_blocks"], "kv_bytes": llm.llm_engine.kv_cache.nbytes,
                     "vllm_tokens": cap["kv_cache_size_tokens"],
                     "vllm_concurrency": cap["kv_cache_max_concurrency"],
                     "line": cap["line"], "peak_running": max(r.num_running for r in trace),
                     "mean_running": sum(r.num_running for r in trace) / len(trace),
                     "preemptions": stats["num_preemptions"], "steps": len(trace)})
    return rows


def shared_prefix_hits(system_ids: list[int], tails: list[list[int]], window: int,
                       block_size: int, model: str | None = None) -> dict[str, list[int]]:
    """A system prompt with a different tail each time, sent one request after another:
    each request's cached tokens, for the windowed model under vLLM's default retention, the
    same with every full block kept, and every layer full attention."""
    setups = {"window, retention 0 (vLLM's default)": dict(hf_overrides=overrides(window)),
              "window, retention None (every block)": dict(
                  hf_overrides=overrides(window), prefix_cache_retention_interval=None),
              "every layer full attention": {}}
    sp = SamplingParams(max_tokens=4, **GREEDY)
    out = {}
    for name, kwargs in setups.items():
        llm = LLM(model, block_size=block_size, max_model_len=512, kv_cache_tokens=2048,
                  **kwargs)
        out[name] = [llm.generate({"prompt_token_ids": system_ids + t}, sp)[0].num_cached_tokens
                     for t in tails]
    return out

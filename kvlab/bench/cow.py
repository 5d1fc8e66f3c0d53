"""KV memory saved by block sharing: parallel sampling and beam search (chapter 02)."""

from __future__ import annotations

from kvlab.beam_search import BeamSearchParams
from kvlab.bench.common import make_prompts
from kvlab.engine import LLM
from kvlab.model import load_model
from kvlab.sampling import SamplingParams


def cow_run(kind: str, k: int, prompt_ids: list[int], max_tokens: int, share: bool = True,
            block_size: int = 16, model: str | None = None) -> dict:
    """One parallel-sampling (`kind="sampling"`, n=k) or beam-search (`"beam"`, width k) run
    in a fresh engine; returns its peak blocks, blocks in use per step, CoW copies and tokens.

    `share=False` is the baseline without sharing: every fork copies all its parent's blocks.
    """
    if kind not in ("sampling", "beam"):
        raise ValueError(f"kind must be 'sampling' or 'beam', got {kind!r}")
    total = len(prompt_ids) + max_tokens
    # The paper's fork (chosen by name: vLLM v1's default is child requests) and no prefix
    # cache, so that only the fork's sharing is measured.
    llm = LLM(model, block_size=block_size, max_model_len=total + 1,
              kv_cache_tokens=2 * max(k, 8) * (total + block_size), parallel_sampling="fork",
              enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.kv_cache_manager.share_blocks = share
    prompt = {"prompt_token_ids": list(prompt_ids)}
    if kind == "sampling":
        sp = SamplingParams(n=k, max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
        tokens = [o.token_ids for o in llm.generate(prompt, sp)[0].outputs]
    else:
        bp = BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True)
        tokens = [sq.tokens for sq in llm.beam_search(prompt, bp)[0].sequences]
    stats = llm.stats()
    return {
        "peak_blocks": stats["peak_blocks_used"],
        "blocks_per_step": [r.num_used_blocks for r in engine.step_trace],
        "cow_copies": stats["num_cow_copies"],
        "tokens": tokens,
        "leaked_blocks": stats["num_used_blocks"],
    }


def cow_savings(prompt_lens=(32, 512), ns=(2, 4, 8), beam_widths=(2, 4, 8),
                max_tokens: int = 64, block_size: int = 16, model: str | None = None,
                progress: bool = True) -> list[dict]:
    """Peak KV blocks with block sharing against the same requests without it (chapter 02).

    Parallel sampling: `SamplingParams(n)` forks one prefilled prompt n ways. Beam search: beams
    fork and free every step. Both runs must produce the same tokens.
    """
    from tqdm.auto import tqdm

    tok = load_model(model).tokenizer
    rows = []
    jobs = [(kind, L, k) for L in prompt_lens
            for kind, ks in (("sampling", ns), ("beam", beam_widths)) for k in ks]
    for kind, prompt_len, k in tqdm(jobs, desc="cow", disable=not progress):
        prompt = make_prompts(tok, 1, prompt_len, prompt_len)[0]
        shared, unshared = (cow_run(kind, k, prompt, max_tokens, share, block_size, model)
                            for share in (True, False))
        rows.append({
            "kind": kind, "prompt_len": prompt_len, "output_len": max_tokens, "k": k,
            "peak_blocks_shared": shared["peak_blocks"],
            "peak_blocks_unshared": unshared["peak_blocks"],
            "saved": round(1 - shared["peak_blocks"] / unshared["peak_blocks"], 3),
            "identical_outputs": shared["tokens"] == unshared["tokens"],
        })
    return rows


PARALLEL_SAMPLING_MODES = {
    # label: LLM keyword arguments
    "fork + CoW (paper, vLLM v0)": dict(parallel_sampling="fork", enable_prefix_caching=False),
    "child requests + prefix cache (vLLM v1)": dict(parallel_sampling="child_requests",
                                                    enable_prefix_caching=True),
    "unshared": dict(parallel_sampling="child_requests", enable_prefix_caching=False),
}


def parallel_sampling_run(mode: str, n: int, prompt_ids: list[int], max_tokens: int,
                          block_size: int = 16, model: str | None = None) -> dict:
    """One `SamplingParams(n)` request in a fresh engine, in one of PARALLEL_SAMPLING_MODES:
    the peak KV blocks held, the prompt tokens computed (prefill work), and the samples."""
    total = len(prompt_ids) + max_tokens
    llm = LLM(model, block_size=block_size, max_model_len=total + 1,
              kv_cache_tokens=2 * max(n, 8) * (total + block_size),
              **PARALLEL_SAMPLING_MODES[mode])
    sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": list(prompt_ids)}, sp)[0]
    stats = llm.stats()
    return {
        "peak_blocks": stats["peak_blocks_used"],
        "prompt_tokens_computed": sum(r.num_prefill_tokens for r in llm.llm_engine.step_trace),
        "tokens": [o.token_ids for o in out.outputs],
        "leaked_blocks": stats["num_used_blocks"],
    }


def parallel_sampling_table(prompt_lens=(32, 512), ns=(2, 4, 8), max_tokens: int = 32,
                            block_size: int = 16, model: str | None = None,
                            progress: bool = True) -> list[dict]:
    """The paper's fork against vLLM v1's child requests (chapter 02), side by side: blocks held
    and prompt tokens computed for each n, and whether each mode's samples equal the unshared
    run's (sample i draws from seed + i in every mode, so they must)."""
    from tqdm.auto import tqdm

    tok = load_model(model).tokenizer
    rows = []
    jobs = [(L, n) for L in prompt_lens for n in ns]
    for prompt_len, n in tqdm(jobs, desc="parallel sampling", disable=not progress):
        prompt = make_prompts(tok, 1, prompt_len, prompt_len)[0]
        runs = {mode: parallel_sampling_run(mode, n, prompt, max_tokens, block_size, model)
                for mode in PARALLEL_SAMPLING_MODES}
        base = runs["unshared"]
        for mode, run in runs.items():
            rows.append({
                "prompt_len": prompt_len, "n": n, "mode": mode,
                "peak_blocks": run["peak_blocks"],
                "prompt_tokens_computed": run["prompt_tokens_computed"],
                "identical_to_unshared": run["tokens"] == base["tokens"],
                "leaked_blocks": run["leaked_blocks"],
            })
    return rows


def mean_shape_savings(shapes: dict[str, tuple[int, int]], ns=(2, 4, 6), block_size: int = 16,
                       model: str | None = None) -> list[dict]:
    """Fork's KV saving for one `SamplingParams(n)` request of each (prompt, output) shape.

    The PagedAttention paper reports the *average* memory saved over a serving run (its §6.3),
    so the saving here is over the blocks held averaged across the run's steps, beside the
    peak. Every sample must equal the unshared run's: sharing may change memory, never tokens.
    """
    tok = load_model(model).tokenizer
    rows = []
    for name, (prompt_len, output_len) in shapes.items():
        prompt = make_prompts(tok, 1, prompt_len, prompt_len)[0]
        for n in ns:
            shared, unshared = (cow_run("sampling", n, prompt, output_len, share, block_size,
                                        model) for share in (True, False))
            # The trace records the blocks held after each step; the last step's record is 0
            # (the request finished and freed them), so it is left out of the average.
            mean_on, mean_off = (sum(held) / len(held) for held in
                                 ([b for b in r["blocks_per_step"] if b] for r in (shared, unshared)))
            rows.append({
                "workload": name, "prompt_len": prompt_len, "output_len": output_len, "n": n,
                "mean_blocks_shared": round(mean_on, 1), "mean_blocks_unshared": round(mean_off, 1),
                "mean_saved": round(1 - mean_on / mean_off, 3),
                "peak_saved": round(1 - shared["peak_blocks"] / unshared["peak_blocks"], 3),
                "identical_outputs": shared["tokens"] == unshared["tokens"],
                "leaked_blocks": shared["leaked_blocks"] + unshared["leaked_blocks"],
            })
    return rows

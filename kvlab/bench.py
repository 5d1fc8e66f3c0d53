"""Benchmarks: kvlab against its peers, side by side in one run, reported as ratios.

    python -m kvlab.bench speed            # kvlab vs transformers generate, batch 1 and 16
    python -m kvlab.bench cow              # KV memory saved by block sharing (chapter 02)

Protocol (as the seed articles): one warm-up run excluded, then `repeats` runs; the median and
the spread (min-max) are reported. Both sides generate exactly `max_tokens` tokens (EOS ignored)
greedily from the same prompts on the same weights, and both outputs are checked to be equal, so
the comparison is of the same work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvlab.beam_search import BeamSearchParams
from kvlab.engine import LLM
from kvlab.model import load_model
from kvlab.sampling import SamplingParams

BENCH_TEXT = (
    "The KV cache stores the keys and values of every past token so that each new token attends "
    "to them without recomputing. Serving engines such as vLLM split it into fixed-size blocks, "
    "share blocks between sequences, and schedule requests at every step. "
)


def make_prompts(tokenizer, num_prompts: int, min_len: int, max_len: int) -> list[list[int]]:
    """Distinct prompts with lengths spread evenly over [min_len, max_len] (deterministic)."""
    base = tokenizer(BENCH_TEXT * (max_len // 20 + 2)).input_ids
    prompts = []
    for i in range(num_prompts):
        length = min_len + (max_len - min_len) * i // max(num_prompts - 1, 1)
        start = (7 * i) % 40  # different offsets, so no two prompts are the same
        prompts.append(base[start : start + length])
    return prompts


@dataclass
class Timing:
    name: str
    median_s: float
    min_s: float
    max_s: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s


def time_runs(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first-call allocations and kernel selection are not the steady state
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def transformers_generate(hf_model, prompts: list[list[int]], max_tokens: int, pad_id: int):
    """Greedy `generate` on a left-padded batch: static batching, transformers' default path."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    dev = hf_model.device
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id,
        )
    return [row[width:].tolist() for row in out]


def speed(batch_sizes=(1, 16), max_tokens: int = 64, repeats: int = 3, prompt_len=(64, 128),
          model: str | None = None) -> list[dict]:
    """kvlab `LLM.generate` against transformers `generate` at each batch size, same prompts."""
    loaded = load_model(model)
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    llm = LLM(model, max_model_len=1024, kv_cache_tokens=32 * 1024)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for batch in batch_sizes:
        prompts = make_prompts(tok, batch, *prompt_len)
        kv_out = [o.outputs[0].token_ids
                  for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        hf_out = transformers_generate(loaded.hf_model, prompts, max_tokens, pad_id)
        same = sum(a == b for a, b in zip(kv_out, hf_out))
        results = {}
        for name, fn in (
            ("transformers", lambda: transformers_generate(loaded.hf_model, prompts, max_tokens, pad_id)),
            ("kvlab", lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], sp)),
        ):
            times = time_runs(fn, repeats)
            results[name] = Timing(name, statistics.median(times), min(times), max(times),
                                   batch * max_tokens)
        row = {
            "batch": batch,
            "max_tokens": max_tokens,
            "identical_outputs": f"{same}/{batch}",
            **{f"{k}_tok_s": round(v.tokens_per_s, 1) for k, v in results.items()},
            **{f"{k}_spread_s": [round(v.min_s, 3), round(v.max_s, 3)] for k, v in results.items()},
            "kvlab_over_transformers": round(
                results["kvlab"].tokens_per_s / results["transformers"].tokens_per_s, 3
            ),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cow_run(kind: str, k: int, prompt_ids: list[int], max_tokens: int, share: bool = True,
            block_size: int = 16, model: str | None = None) -> dict:
    """One parallel-sampling (`kind="sampling"`, n=k) or beam-search (`"beam"`, width k) run
    in a fresh engine; returns its peak blocks, blocks in use per step, CoW copies and tokens.

    `share=False` is the baseline without sharing: every fork copies all its parent's blocks.
    """
    if kind not in ("sampling", "beam"):
        raise ValueError(f"kind must be 'sampling' or 'beam', got {kind!r}")
    total = len(prompt_ids) + max_tokens
    llm = LLM(model, block_size=block_size, max_model_len=total + 1,
              kv_cache_tokens=2 * max(k, 8) * (total + block_size))
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("speed", help="kvlab vs transformers generate at batch 1 and 16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the rows to this file")
    p = sub.add_parser("cow", help="KV memory saved by block sharing (n and beam width)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 512])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.command == "speed":
        rows = speed(tuple(args.batch_sizes), args.max_tokens, args.repeats, model=args.model)
    else:
        rows = cow_savings(tuple(args.prompt_lens), max_tokens=args.max_tokens, model=args.model)
        for row in rows:
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

"""kvlab against transformers `generate`, same prompts, same weights, side by side (chapter 00)."""

from __future__ import annotations

import json
import statistics

from kvlab.bench.common import Timing, make_prompts, time_runs, transformers_generate
from kvlab.engine import LLM
from kvlab.model import load_model
from kvlab.sampling import SamplingParams


def speed(batch_sizes=(1, 16), max_tokens: int = 64, repeats: int = 3, prompt_len=(64, 128),
          model: str | None = None) -> list[dict]:
    """kvlab `LLM.generate` against transformers `generate` at each batch size, same prompts."""
    loaded = load_model(model)
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    llm = LLM(model, max_model_len=1024, kv_cache_tokens=32 * 1024,
              enable_prefix_caching=False)  # repeated prompts: computed every time
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

"""The weights' precision, the other half of the KV precision lever: bfloat16 against float32.

    python -m kvlab.bench weights-dtype

vLLM's CPU platform resolves `dtype="auto"` to bfloat16 on x86 (`supported_dtypes` in
`vllm/platforms/cpu.py`); kvlab keeps float32 on a CPU (`kvlab/platforms.py`). Per dtype, in one
run:
- a decode step at each batch size (whole `LLMEngine.step()` calls, median), against the ceiling
  in that dtype: the weights and the KV read once at this machine's copy bandwidth, and the
  arithmetic at the fastest matmul measured in that dtype, whichever is slower;
- greedy agreement with transformers' `generate` in the same dtype on the same weights (where
  each prompt's tokens first differ), and with kvlab in float32.

Whether this CPU computes bfloat16 natively is printed beside it (`cpu_native_bf16`).
"""

from __future__ import annotations

import torch

from kvlab.bench.common import make_prompts, transformers_generate
from kvlab.bench.kv_dtype import first_divergence
from kvlab.bench.offline_peers import decode_ceiling
from kvlab.bench.roofline import best_rates, decode_steps
from kvlab.engine import LLM
from kvlab.platforms import cpu_native_bf16
from kvlab.sampling import SamplingParams

DTYPES = ("float32", "bfloat16")
BATCHES = (1, 16, 64)


def weights_dtype_table(dtypes=DTYPES, batches=BATCHES, context: int = 64, steps: int = 6,
                        num_prompts: int = 4, prompt_len: int = 24, max_tokens: int = 16,
                        model: str | None = None, log=None) -> dict:
    """Rows per (dtype, batch) and an agreement summary per dtype (see the module docstring)."""
    rows, agreement, greedy = [], [], {}
    max_len = context + 32
    for name in dtypes:
        llm = LLM(model, dtype=name, max_model_len=max_len, max_num_seqs=max(batches),
                  kv_cache_tokens=max(batches) * max_len + 64, max_num_batched_tokens=2048,
                  enable_prefix_caching=False)  # repeated prompts: computed every time
        engine = llm.llm_engine
        rates = best_rates(engine.device, engine.dtype, repeats=3)
        # Warm-up: first-call allocations, kernel choices (a batch the pool holds at once).
        decode_steps(llm, min(4, max(batches)), min(32, context), steps=2)
        for batch in batches:
            row = decode_steps(llm, batch, context, steps)
            ceiling = decode_ceiling(row["batch"], row["context"],
                                     {"matmul_flops": rates["peak_matmul_flops"],
                                      "bandwidth_bytes": rates["bandwidth_bytes"]},
                                     model, dtype=engine.dtype)
            out = {"dtype": name, "batch": batch, "context": row["context"],
                   "step_ms": row["step_ms"], "tok_s": row["tok_s"],
                   "ceiling_ms": ceiling["step_ms"], "bound": ceiling["bound"],
                   "fraction_of_ceiling": round(ceiling["step_ms"] / row["step_ms"], 3),
                   "matmul_gflops": round(rates["peak_matmul_flops"] / 1e9, 1),
                   "bandwidth_gbs": round(rates["bandwidth_bytes"] / 1e9, 1)}
            rows.append(out)
            if log:
                log(out)
        tok = llm.get_tokenizer()
        prompts = make_prompts(tok, num_prompts, prompt_len, prompt_len)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        mine = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
        theirs = [transformers_generate(engine.loaded.hf_model, [p], max_tokens,
                                        tok.eos_token_id)[0] for p in prompts]
        greedy[name] = mine
        vs_hf = [first_divergence(a, b) for a, b in zip(mine, theirs)]
        vs_fp32 = ([first_divergence(a, b) for a, b in zip(greedy["float32"], mine)]
                   if "float32" in greedy else None)
        agreement.append({"dtype": name, "prompts": num_prompts, "max_tokens": max_tokens,
                          "first_divergence_vs_transformers": vs_hf,
                          "first_divergence_vs_kvlab_float32": vs_fp32})
        if log:
            log(agreement[-1])
        del llm, engine
    native, why = cpu_native_bf16()
    return {"rows": rows, "agreement": agreement, "native_bf16": native, "native_why": why,
            "threads": torch.get_num_threads()}


def report(result: dict) -> str:
    lines = [f"{'dtype':<9} {'batch':>5} {'step ms':>8} {'tok/s':>7} {'ceiling ms':>10} "
             f"{'bound':>7} {'% of ceiling':>12}"]
    for r in result["rows"]:
        lines.append(f"{r['dtype']:<9} {r['batch']:>5} {r['step_ms']:>8.1f} {r['tok_s']:>7.1f} "
                     f"{r['ceiling_ms']:>10.2f} {r['bound']:>7} "
                     f"{r['fraction_of_ceiling']:>12.0%}")
    for a in result["agreement"]:
        same = lambda d: "identical" if d is None else f"differs at token {d}"  # noqa: E731
        lines.append(f"{a['dtype']}: vs transformers in {a['dtype']}: "
                     + ", ".join(same(d) for d in a["first_divergence_vs_transformers"]))
    lines.append(f"native bfloat16 on this CPU: {result['native_bf16']} ({result['native_why']});"
                 f" {result['threads']} threads; ceilings at each dtype's fastest matmul")
    return "\n".join(lines)

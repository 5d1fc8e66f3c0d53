"""The GPU check: one script to run whenever a GPU is lent (a few minutes on one H200).

    python benchmarks/gpu_check.py                  # everything, results in gpu-results/
    python benchmarks/gpu_check.py --quick          # correctness and speed only (~1 minute)
    python benchmarks/gpu_check.py --device cpu --quick   # the same script on a CPU (a dry run)

What it checks, in order, each part saved to OUT/gpu_check.json as soon as it is done (so a run
cut short still reports what it reached):
1. the machine: torch and CUDA versions, the device;
2. correctness: greedy tokens of the three backends (reference, auto, flex) against
   transformers `generate`, in fp32 (must be identical) and in bf16 (reported: in bf16 a
   near-tie can flip with summation order), on mixed prompts with chunked prefill, prefix hits
   and preemption; the largest logit difference flex vs reference;
3. speed: decode tokens/s at batch 1, 16 and 64 and prefill tokens/s, auto against flex;
4. the peers: kvlab, transformers `generate` and `generate_batch` on 64 mixed requests, and
   kvlab's fraction of the GPU's own matmul/bandwidth ceiling;
5. every published experiment the notebooks reproduce (`python -m kvlab.bench reproduce`), tables saved as
   JSON and CSV next to the report;
6. what torch.compile did for flex over the whole run: graphs compiled, each recompile's reason,
   against dynamo's recompile limit (torch's default, 8: this script does not change it).
Flex runs compiled everywhere here (`enforce_eager=False`), on a CPU too (inductor's C++
kernel), so the CPU dry run compiles what the GPU run will; the flex mask pads each step's
query rows to a power of two and refills buffers made once (kvlab/flex_attention.py), which
keeps the count to a few graphs (`python -m kvlab.bench compiled-flex` shows it on a CPU).
The exit status is 1 when an fp32 token check fails or the flex graphs reach the limit.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from kvlab import LLM, SamplingParams
from kvlab.attention import get_attention_backend
from kvlab.attention_metadata import CommonAttentionMetadata
from kvlab.bench import peers, reproduce
from kvlab.bench.common import make_prompts, transformers_generate
from kvlab.bench.compiled_flex import compile_counters, compiles_since
from kvlab.model import Transformer, load_model

BACKENDS = ("reference", "auto", "flex")
COMPILED = {"flex": {"enforce_eager": False}}  # flex compiled on any device (see above)


def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30))
    return info


def token_check(device: str, dtype: str) -> dict:
    """Greedy tokens of every backend against transformers, and flex's logits against the
    reference's on one 40-token prompt."""
    loaded = load_model(None, device, dtype)
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    system = make_prompts(tok, 1, 96, 96)[0]
    prompts = [system + p for p in make_prompts(tok, 8, 4, 160)]  # shared prefix, mixed tails
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    hf = [transformers_generate(loaded.hf_model, [p], 24, pad)[0] for p in prompts]
    out = {"dtype": dtype, "prompts": len(prompts)}
    for backend in BACKENDS:
        # A budget of 64 tokens chunks every prompt; 640 KV tokens force preemption; the second
        # pass hits the cached shared prefix.
        llm = LLM(device=device, dtype=dtype, backend=backend, max_num_batched_tokens=64,
                  kv_cache_tokens=640, max_model_len=320, enable_prefix_caching=True,
                  **COMPILED.get(backend, {}))
        for _ in range(2):
            got = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sp)]
        stats = llm.stats()
        out[backend] = {"identical_to_transformers": sum(a == b for a, b in zip(got, hf)),
                        "prefix_cache_hits": stats["prefix_cache_hits"],
                        "num_preemptions": stats["num_preemptions"]}
    return out


def flex_logit_diff(loaded, prompt: list[int], enforce_eager: bool | None = None) -> float:
    dev = loaded.device
    logits = []
    for fast, backend in ((False, "reference"), (True, "flex")):
        model = Transformer(loaded, fast=fast,
                            attn_backend=get_attention_backend(backend, enforce_eager))
        kv = torch.zeros((model.num_layers, 2, 4, 16, model.num_kv_heads, model.head_dim),
                         dtype=loaded.dtype, device=dev)
        table = torch.tensor([2, 0, 3], device=dev)
        meta = model.attn_backend.build(CommonAttentionMetadata(
            slot_mapping=(table[:, None] * 16 + torch.arange(16, device=dev)).flatten()[:40],
            query_start_loc=[0, 40], seq_lens=[40], block_table_ids=[[2, 0, 3]],
            block_size=16, num_blocks=4, device=dev))
        hidden = model.forward(torch.tensor(prompt, device=dev), torch.arange(40, device=dev),
                               kv, meta)
        logits.append(model.compute_logits(hidden))
    return round((logits[0] - logits[1]).abs().max().item(), 5)


def speed_check(device: str, batches=(1, 16, 64), new_tokens: int = 64) -> dict:
    """Decode tokens/s (median step of a full batch) and prefill tokens/s, per backend."""
    rows = {}
    tok = load_model(None, device).tokenizer
    for backend in ("auto", "flex"):
        # A pool sized to the largest batch: FlexAttention's mask spans the whole pool.
        llm = LLM(device=device, backend=backend, max_model_len=1024 + new_tokens + 16,
                  kv_cache_tokens=max(batches) * (128 + new_tokens + 16) + 1024,
                  **COMPILED.get(backend, {}))
        sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate({"prompt_token_ids": make_prompts(tok, 1, 32, 32)[0]}, sp)  # warm-up
        row = {}
        for b in batches:
            prompts = [{"prompt_token_ids": p} for p in make_prompts(tok, b, 128, 128)]
            llm.generate(prompts, sp)  # warm-up at this shape (compiles on a GPU)
            first = llm.llm_engine.num_steps
            llm.generate(prompts, sp)
            steps = sorted(r.step_time for r in llm.llm_engine.step_trace
                           if r.step > first and r.num_prefill_tokens == 0
                           and len(r.request_ids) == b)
            row[f"decode_tok_s_batch{b}"] = round(b / steps[len(steps) // 2], 1)
        long = {"prompt_token_ids": make_prompts(tok, 1, 1024, 1024)[0]}
        one = SamplingParams(max_tokens=1)
        llm.generate(long, one)
        t0 = time.perf_counter()
        llm.generate(long, one)
        row["prefill_tok_s_1024"] = round(1024 / (time.perf_counter() - t0), 1)
        rows[backend] = row
    return rows


def flex_compile_report(before: dict) -> dict:
    """Every compile since `before`, counted per compiled function (`flex_attention`: the
    flex kernel; eager FlexAttention compiles a wrapper of its own, under another name), each
    recompile's reason, and whether flex stayed under dynamo's limit (past it, the function is
    compiled with fullgraph=True, so dynamo raises FailOnRecompileLimitHit and the step fails)."""
    report = compiles_since(before)
    report["under_recompile_limit"] = (report["compiles_per_function"].get("flex_attention", 0)
                                       < report["recompile_limit"])
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--quick", action="store_true", help="parts 1-3 only")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {}

    def done(part: str, value) -> None:
        report[part] = value
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"== {part}\n{json.dumps(value, indent=2)}", flush=True)

    parts = run_parts(args.device, args.quick, out_dir, done)
    failed = any(
        isinstance(parts.get("tokens_float32"), dict)
        and "error" not in parts["tokens_float32"]
        and parts["tokens_float32"][b]["identical_to_transformers"]
        != parts["tokens_float32"]["prompts"]
        for b in BACKENDS)
    failed |= not parts["flex_compile"].get("under_recompile_limit", True)
    return 1 if failed or any(isinstance(v, dict) and "error" in v for v in parts.values()) else 0


def run_parts(device: str, quick: bool, out_dir: Path, done) -> dict:
    """Run every part on its own: a part that raises records its error in the report and the
    next part still runs (a GPU lease is short; one broken part must not cost the rest)."""
    parts: list[tuple[str, object]] = [("machine", lambda: machine(device))]
    for dtype in ("float32", "bfloat16") if device == "cuda" else ("float32",):
        parts.append((f"tokens_{dtype}", lambda dtype=dtype: token_check(device, dtype)))
    parts.append(("flex_vs_reference_max_logit_diff",
                  lambda: flex_logit_diff(load_model(None, device, "float32"),
                                          make_prompts(load_model(None, device).tokenizer,
                                                       1, 40, 40)[0], enforce_eager=False)))
    parts.append(("speed", lambda: speed_check(device, (1, 16) if quick else (1, 16, 64))))
    if not quick:
        parts.append(("peers", lambda: peers.compare_peers(num_requests=64, repeats=3)))
        parts.append(("ceiling", lambda: peers.ceiling_fraction(batch=64)))
        parts.append(("reproduce", lambda: {
            name: len(rows) for name, rows in reproduce.run_experiments(
                list(reproduce.EXPERIMENTS), repeats=3, out_dir=out_dir, progress=False).items()}))
    compiled_before = compile_counters()
    parts.append(("flex_compile", lambda: flex_compile_report(compiled_before)))
    results = {}
    t0 = time.perf_counter()
    for name, part in parts:
        try:
            value = part()
        except Exception as e:  # noqa: BLE001 (recorded, not hidden: the exit status is 1)
            value = {"error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=8)}
        results[name] = value
        done(name, value)
    done("wall_s", round(time.perf_counter() - t0, 1))
    return results


if __name__ == "__main__":
    sys.exit(main())

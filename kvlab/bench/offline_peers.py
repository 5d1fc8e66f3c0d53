"""Peers side by side, and this machine's ceiling.

- transformers `generate` (static, padded) and `generate_batch` (its continuous batching with
  paged attention) against kvlab, same prompts, same weights, useful output tokens per second;
- the machine's limit: measured matmul rate and memory bandwidth, turned into a decode-step
  time floor for this model at a given batch, and kvlab's fraction of it.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlab.bench.common import make_prompts, mixed_workload, transformers_generate
from kvlab.engine import LLM
from kvlab.model import load_model
from kvlab.sampling import SamplingParams


def transformers_generate_batch(hf_model, prompts: list[list[int]], max_tokens: int) -> list:
    """transformers' own continuous batching (`generate_batch`), greedy, EOS not stopping.

    Its paged cache is sized for the workload, as kvlab's pool is in the same comparison: left
    to itself, generate_batch sizes the cache from the free memory (most of it; on a CPU through
    psutil), and its process peaked at 14.5 GB here for two short prompts, more than a workshop
    laptop has (and without psutil it sizes from zero bytes and fails)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig()
    # transformers 5.24 calls a block's tokens page_size, 5.17 block_size.
    page = getattr(cb, "page_size", None) or getattr(cb, "block_size", None) or 256
    longest = max(len(p) for p in prompts) + max_tokens
    cb.num_blocks = len(prompts) * -(-longest // page) + 1
    cb.max_batch_tokens = min(8192, max(256, sum(len(p) for p in prompts)))
    with torch.inference_mode():
        out = hf_model.generate_batch(inputs=prompts, generation_config=cfg,
                                      continuous_batching_config=cb, progress_bar=False)
    return [o.generated_tokens for o in out.values()]


def compare_peers(num_requests: int = 16, input_lens=(64, 128), output_lens=(96, 128),
                  repeats: int = 3, model: str | None = None, warmup: str = "full") -> dict:
    """Useful output tokens/s of kvlab, `generate` and `generate_batch` on one mixed-length
    workload; the transformers peers run every request to the longest output (they take one
    max_new_tokens), so only the requested tokens count as useful.

    `warmup="full"`: each contender first runs the whole workload untimed (those outputs are
    the ones compared), then `repeats` timed runs, interleaved. `warmup="short"`, a notebook's
    shortcut (`generate_batch` takes most of the time here): each first runs one request for
    two tokens untimed, which pays its one-time costs (first-call allocations, kernel choice),
    then the compared run is timed too and counts as one of the `repeats`."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup not in ("full", "short"):
        raise ValueError(f"warmup must be 'full' or 'short', got {warmup!r}")
    loaded = load_model(model)
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = num_requests
    prompts, params, lens_out = mixed_workload(tok, n, input_lens, output_lens)
    # Cold (no prefix cache): the warm-up and the peers run the same prompts, and kvlab must
    # compute them as the peers do.
    llm = LLM(model, max_model_len=max(input_lens) + max(output_lens) + 16,
              enable_prefix_caching=False)
    two = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def run(name: str, batch: list[list[int]], short: bool = False):
        max_new = 2 if short else max(lens_out)
        if name == "kvlab":
            return llm.generate([{"prompt_token_ids": p} for p in batch], two if short else params)
        if name == "transformers generate":
            return transformers_generate(loaded.hf_model, batch, max_new, pad_id)
        return transformers_generate_batch(loaded.hf_model, batch, max_new)

    names = ("kvlab", "transformers generate", "transformers generate_batch")
    times: dict[str, list[float]] = {k: [] for k in names}
    first = {}  # each contender's first run over the workload: the outputs compared
    for name in names:
        if warmup == "short":
            run(name, prompts[:1], short=True)
        t0 = time.perf_counter()
        first[name] = run(name, prompts)
        if warmup == "short":
            times[name].append(time.perf_counter() - t0)
    ours = [o.outputs[0].token_ids for o in first["kvlab"]]
    identical = {name: sum(list(t[:k]) == o for t, k, o in zip(out, lens_out, ours))
                 for name, out in first.items() if name != "kvlab"}
    for _ in range(repeats - len(times["kvlab"])):  # interleaved
        for name in names:
            t0 = time.perf_counter()
            run(name, prompts)
            times[name].append(time.perf_counter() - t0)
    return {**summarize(times, sum(lens_out)),
            "identical_to_kvlab": {k: f"{v}/{n}" for k, v in identical.items()}}


def summarize(times: dict[str, list[float]], useful: int) -> dict:
    """compare_peers' verdict from its timed runs: `times` maps each contender ("kvlab" first
    among them) to its run times in seconds, run i of every contender in the same round.

    Each row: the median's useful tokens/s and the spread over the runs (the slowest run's rate
    and the fastest's). Each peer: kvlab's speed over it at the medians, the same ratio run by
    run (round i's peer time over round i's kvlab time: its min-max), and in how many rounds
    kvlab was the faster, so a verdict says how many repeats back it."""
    rows = {k: {"useful_tok_s": round(useful / statistics.median(t), 1),
                "useful_tok_s_spread": [round(useful / max(t), 1), round(useful / min(t), 1)],
                "spread_s": [round(min(t), 2), round(max(t), 2)]} for k, t in times.items()}
    ours = times["kvlab"]
    kv = rows["kvlab"]["useful_tok_s"]
    peers = [k for k in times if k != "kvlab"]
    ratios = {k: [theirs / mine for theirs, mine in zip(times[k], ours)] for k in peers}
    out = {"rows": rows, "useful_tokens": useful, "repeats": len(ours),
           "ratio_spread": {k: [round(min(r), 2), round(max(r), 2)] for k, r in ratios.items()},
           "kvlab_ahead": {k: f"{sum(x > 1 for x in r)}/{len(r)}" for k, r in ratios.items()}}
    for k in peers:  # "kvlab_over_generate", "kvlab_over_generate_batch"
        out[f"kvlab_over_{k.removeprefix('transformers ')}"] = round(
            kv / rows[k]["useful_tok_s"], 2)
    return out


def machine_rates(size: int = 2048, copy_mib: int = 512, repeats: int = 5,
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """This machine's matmul rate (FLOP/s, in the model's dtype) and memory bandwidth (bytes/s),
    best of runs; on a GPU, its own rate and bandwidth (a bigger matmul keeps it busy).

    `matmul_flops` is torch.mm's rate. `peak_matmul_flops`
    is the fastest matmul measured: on a CPU in fp32 also oneDNN's packed linear, the kernel the
    model's own matmuls run on (model.fused_linear), faster than torch.mm here (by 1.1x to 2.5x
    across runs and machines). The
    bandwidth is a copy's bytes read plus written per second."""
    from kvlab.model import packed_linear, use_onednn_for

    device = torch.device(device)
    if device.type == "cuda":
        size = max(size, 8192)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)
    t = min(_timed(lambda: torch.mm(a, b), device) for _ in range(repeats))
    peak = 2 * size**3 / t
    # oneDNN's packed linear: the kernel the model's fp32 matmuls run on, and on a CPU the
    # fastest bfloat16 one measured too where oneDNN takes it.
    if use_onednn_for(device, dtype) or (device.type == "cpu" and dtype == torch.bfloat16
                                         and torch.backends.mkldnn.is_available()):
        linear = packed_linear(b, None)
        linear(a)
        peak = max(peak, 2 * size**3 / min(_timed(lambda: linear(a), device)
                                           for _ in range(repeats)))
    # The source is written first: a never-written CPU tensor reads the kernel's shared zero
    # page, which stays in the cache (a 512 MiB sum of one ran at 404 GB/s here).
    src = torch.randn(copy_mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    c = min(_timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    return {"matmul_flops": 2 * size**3 / t, "peak_matmul_flops": peak,
            "bandwidth_bytes": 2 * src.numel() * 4 / c}


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()  # the GPU's time, not the launch's
    return time.perf_counter() - t0


def decode_ceiling(batch: int, context: int, rates: dict, model: str | None = None,
                   dtype: torch.dtype | None = None) -> dict:
    """The fastest a decode step could be at `batch` sequences of `context` tokens: the larger
    of its arithmetic at the matmul rate and its bytes (weights once, plus every sequence's KV,
    both in `dtype`, default the loaded model's) at the memory bandwidth."""
    loaded = load_model(model)
    cfg = loaded.config
    itemsize = torch.empty((), dtype=dtype or loaded.dtype).element_size()
    params = sum(p.numel() for p in loaded.hf_model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context
    flops = batch * (2 * params + attn_flops)
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
    bytes_moved = params * itemsize + batch * context * kv_bytes
    compute_s = flops / rates["matmul_flops"]
    memory_s = bytes_moved / rates["bandwidth_bytes"]
    step = max(compute_s, memory_s)
    return {"batch": batch, "context": context, "step_ms": round(1000 * step, 2),
            "tok_s": round(batch / step, 1),
            "bound": "compute" if compute_s > memory_s else "memory",
            "compute_bound_tok_s": round(batch / compute_s, 1),
            "memory_bound_tok_s": round(batch / memory_s, 1)}


def ceiling_fraction(batch: int = 16, input_len: int = 96, output_len: int = 64,
                     model: str | None = None) -> dict:
    """kvlab's decode throughput at `batch` running requests as a fraction of the ceiling.

    The ceiling's arithmetic rate is the fastest matmul measured here (`peak_matmul_flops`: on
    a CPU in fp32, oneDNN's packed kernel, which the model's own matmuls run on); torch.mm's
    slower rate would flatter kvlab, so its fraction is returned beside, for comparison only."""
    loaded = load_model(model)
    rates = machine_rates(device=loaded.device, dtype=loaded.dtype)
    llm = LLM(model, max_model_len=input_len + output_len + 16,
              enable_prefix_caching=False)  # repeated prompts: computed every time, as the peers do
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(tok, batch, input_len, input_len)]
    llm.generate(prompts[:2], sp)  # warm-up
    first = llm.llm_engine.num_steps
    llm.generate(prompts, sp)
    steps = [r for r in llm.llm_engine.step_trace
             if r.step > first and r.num_prefill_tokens == 0 and len(r.request_ids) == batch]
    step_s = statistics.median(r.step_time for r in steps)
    context = input_len + output_len // 2
    ceiling = decode_ceiling(batch, context, dict(rates, matmul_flops=rates["peak_matmul_flops"]),
                             model)
    torch_mm = decode_ceiling(batch, context, rates, model)
    measured = batch / step_s
    return {"matmul_gflops": round(rates["peak_matmul_flops"] / 1e9, 1),
            "torch_mm_gflops": round(rates["matmul_flops"] / 1e9, 1),
            "bandwidth_gb_s": round(rates["bandwidth_bytes"] / 1e9, 1),
            "ceiling": ceiling, "kvlab_decode_tok_s": round(measured, 1),
            "fraction_of_ceiling": round(measured / ceiling["tok_s"], 3),
            "fraction_of_torch_mm_ceiling": round(measured / torch_mm["tok_s"], 3)}

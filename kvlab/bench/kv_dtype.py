"""KV density by precision: what each kv_cache_dtype buys and what it costs.

    python -m kvlab.bench kv-dtype                      # every precision, side by side

Per `kv_cache_dtype`, on the real model, in one run:
- density: bytes per token (scales included), the blocks one `kv_cache_memory_bytes` holds,
  and how many requests of `request_len` tokens fit in it at once;
- accuracy against the full-precision cache ("auto") on the same inputs: greedy token
  agreement on short prompts (and where each first diverges), the mean KL divergence of the
  next-token distributions over a fixed text set (`kvlab/data/kv_dtype_texts.txt`, teacher
  forced: every position's distribution given the true prefix), and that set's mean
  log-likelihood per token;
- cost: the time one decode step spends writing its K/V (quantizing) and reading the batch's
  context (dequantizing), every layer, against the same write and read at full precision.

Differences from "auto" are measurements: nothing here assumes a lossy format is lossless.
"""

from __future__ import annotations

import statistics
import time
import types
from pathlib import Path

import torch

from kvlab.attention import write_kv
from kvlab.kv_cache import allocate_kv_cache, cdiv
from kvlab.kv_quant import QuantizedKVLayer

DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head",
          "int8_per_token_head", "int4_per_token_head")
TEXTS_FILE = Path(__file__).resolve().parents[1] / "data" / "kv_dtype_texts.txt"


def model_dtype_for(kv_cache_dtype: str) -> str:
    """The model dtype an engine needs to store K/V at `kv_cache_dtype`: vLLM stores float K/V
    only in the model's own dtype (VllmConfig._reject_mismatched_float_kv_cache in
    vllm/config/vllm.py), so a bfloat16 or float16 cache comes with a model in that dtype (its
    row then measures the model's precision and the cache's together); the quantized dtypes
    keep the model's."""
    return kv_cache_dtype if kv_cache_dtype in ("bfloat16", "float16") else "auto"


def load_texts(path: Path | str = TEXTS_FILE) -> list[str]:
    """The committed texts, one per paragraph."""
    return [p.strip() for p in Path(path).read_text().split("\n\n") if p.strip()]


def text_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    """Every position's next-token log-probabilities (len - 1, V) for one text, computed as a
    prefill computes them (each layer writes the text's K/V into the pool, quantized at the
    engine's kv_cache_dtype, then attends by reading them back). Runs the engine's model
    runner on blocks 0.. of an idle engine, outside the scheduler: a measurement, not a
    request."""
    engine = llm.llm_engine
    bs = engine.config.block_size
    num_blocks = cdiv(len(token_ids), bs)
    pool = engine.kv_cache_manager.block_pool
    if engine.has_unfinished_requests() or num_blocks > pool.num_usable_blocks:
        raise ValueError("text_logprobs needs an idle engine whose pool holds the text")
    request = types.SimpleNamespace(request_id="text", num_tokens=len(token_ids),
                                    token_ids=lambda start, end: token_ids[start:end])
    # Blocks 1.. (block 0 is the null block), from position 0.
    sched = types.SimpleNamespace(scheduled=[(request, len(token_ids))],
                                  num_computed_tokens={"text": 0},
                                  block_ids={"text": list(range(1, 1 + num_blocks))})
    ids, pos, meta = engine.model_runner.prepare(sched)
    hidden = engine.model.forward(ids, pos, engine.kv_cache, meta)
    return engine.model.compute_logits(hidden[:-1]).log_softmax(-1)  # (len - 1, V)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def mean_kl(base: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """KL(base || other) in nats, averaged over every scored position of every text: how far
    `other`'s next-token distributions moved from `base`'s (log-probs, as text_logprobs gives)."""
    total = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(base, other))
    return total / sum(len(p) for p in base)


def kv_step_time(kv_cache_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, batch: int, context: int, block_size: int,
                 repeats: int = 5, inner: int = 10) -> dict:
    """One decode step's K/V traffic on this CPU, every layer: write `batch` new tokens (quantize)
    and read `batch` contexts of `context` tokens the way the batched decode path reads them
    (dequantize into its buffer). Times one layer, median of `repeats` x `inner` calls, times
    `num_layers`."""
    per_seq = cdiv(context, block_size)
    num_blocks = batch * per_seq
    cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                              torch.device("cpu"), kv_cache_dtype)
    layer = cache[0]
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn((batch, num_kv_heads, head_dim), generator=gen, dtype=torch.float32)
            .to(dtype) for _ in range(2))
    slots = torch.arange(batch) * per_seq * block_size  # each sequence's own first block
    blocks = torch.randperm(num_blocks, generator=gen)  # scattered, as a real pool's are
    index = torch.cat((blocks, blocks + num_blocks))  # K rows, then V rows
    out = torch.empty((len(index), block_size * num_kv_heads * head_dim), dtype=dtype)
    if isinstance(layer, QuantizedKVLayer):
        read = lambda: layer.read_rows(index, out)  # noqa: E731
    else:
        pool = layer.view(2 * num_blocks, -1)
        read = lambda: torch.index_select(pool, 0, index, out=out)  # noqa: E731
    write = lambda: write_kv(layer, k, v, slots)  # noqa: E731

    def median_s(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
        return statistics.median(times)

    return {"write_ms": 1e3 * num_layers * median_s(write),
            "read_ms": 1e3 * num_layers * median_s(read)}


def kv_dtype_table(dtypes=DTYPES, memory_bytes: int = 64 * 2**20, request_len: int = 512,
                   num_prompts: int = 5, prompt_len: int = 32, max_tokens: int = 32,
                   texts: list[str] | None = None, batch: int = 16, context: int = 256,
                   block_size: int = 16, repeats: int = 5, model: str | None = None,
                   progress: bool = True) -> list[dict]:
    """One row per kv_cache_dtype (see the module docstring); "auto" is always measured first,
    as the reference the others are compared with."""
    from tqdm.auto import tqdm

    from kvlab.engine import LLM
    from kvlab.sampling import SamplingParams

    dtypes = ["auto", *[d for d in dtypes if d != "auto"]]
    texts = load_texts() if texts is None else texts
    rows, base = [], {}
    for name in tqdm(dtypes, desc="kv dtype", disable=not progress):
        # The pool is the same bytes for every precision; a request of request_len must fit.
        llm = LLM(model, dtype=model_dtype_for(name), kv_cache_dtype=name,
                  kv_cache_memory_bytes=memory_bytes, block_size=block_size,
                  max_model_len=request_len)
        engine = llm.llm_engine
        tok = engine.tokenizer
        tok_ids = [tok(t).input_ids[:request_len] for t in texts]
        stats = llm.stats()
        prompts = [{"prompt_token_ids": ids[:prompt_len]} for ids in tok_ids[:num_prompts]]
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        logprobs = [text_logprobs(llm, ids) for ids in tok_ids]
        loglik = [float(lp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
                  for lp, ids in zip(logprobs, tok_ids)]
        num_scored = sum(len(ids) - 1 for ids in tok_ids)
        m = engine.model
        io = kv_step_time(name, m.num_layers, m.num_kv_heads, m.head_dim, engine.dtype, batch,
                          context, block_size, repeats)
        if name == "auto":
            base = {"outs": outs, "logprobs": logprobs, "loglik": sum(loglik), "io": io}
        divergence = [first_divergence(a, b) for a, b in zip(base["outs"], outs)]
        agree = sum(max_tokens if d is None else d for d in divergence)
        base_io = base["io"]["write_ms"] + base["io"]["read_ms"]
        rows.append({
            "kv_cache_dtype": stats["kv_cache_dtype"],
            "bytes_per_token": stats["kv_bytes_per_token"],
            "kv_cache_memory_bytes": memory_bytes,
            "num_blocks": stats["num_blocks"],
            "capacity_tokens": stats["kv_capacity_tokens"],
            "request_len": request_len,
            "requests_fit": stats["num_usable_blocks"] // cdiv(request_len, block_size),
            # Tokens generated before each prompt's first difference from "auto", over all.
            "greedy_agreement": round(agree / (max_tokens * len(outs)), 4),
            "first_divergence": divergence,  # per prompt; None: identical to "auto"
            "mean_kl": mean_kl(base["logprobs"], logprobs),  # nats, KL(auto || this) per position
            "loglik_per_token": sum(loglik) / num_scored,  # nats
            "loglik_delta": (sum(loglik) - base["loglik"]) / num_scored,
            "kv_write_ms": round(io["write_ms"], 3),
            "kv_read_ms": round(io["read_ms"], 3),
            "kv_io_vs_auto": round((io["write_ms"] + io["read_ms"]) / base_io, 2),
            "step": {"batch": batch, "context": context, "num_layers": m.num_layers,
                     "threads": torch.get_num_threads()},
        })
    return rows


def report(rows: list[dict]) -> str:
    """The rows as a plain-text table."""
    head = (f"{'kv_cache_dtype':<20} {'B/token':>7} {'blocks':>6} {'fit':>4} {'agree':>6} "
            f"{'1st diff':>9} {'mean KL':>9} {'loglik/tok':>10} {'delta':>8} "
            f"{'write ms':>8} {'read ms':>8} {'io x':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        diverged = [d for d in r["first_divergence"] if d is not None]
        first = "-" if not diverged else str(min(diverged))
        lines.append(
            f"{r['kv_cache_dtype']:<20} {r['bytes_per_token']:>7} {r['num_blocks']:>6} "
            f"{r['requests_fit']:>4} {r['greedy_agreement']:>6.3f} {first:>9} "
            f"{r['mean_kl']:>9.2e} {r['loglik_per_token']:>10.4f} {r['loglik_delta']:>+8.4f} "
            f"{r['kv_write_ms']:>8.3f} {r['kv_read_ms']:>8.3f} {r['kv_io_vs_auto']:>5.2f}")
    r = rows[0]
    lines.append(f"pool {r['kv_cache_memory_bytes']} bytes; fit: requests of {r['request_len']} "
                 f"tokens at once; agree: the share of the greedy tokens produced before each prompt's "
                 f"first difference from auto; "
                 f"1st diff: earliest such position; KL and loglik in nats per text token; "
                 f"write/read: one decode step's K/V (batch {r['step']['batch']}, context "
                 f"{r['step']['context']}, {r['step']['num_layers']} layers, "
                 f"{r['step']['threads']} threads); io x: against auto")
    return "\n".join(lines)


def capacity_by_dtype(dtypes=DTYPES, memory_bytes: int = 8 * 2**20, concurrency: int = 16,
                      input_len: int = 64, output_len: int = 32, block_size: int = 16,
                      repeats: int = 1, model: str | None = None,
                      progress: bool = False) -> list[dict]:
    """Chapter 03's KV-capacity experiment at one budget in bytes, per precision: a burst of
    `concurrency` requests of input_len + output_len tokens (EOS ignored) through a pool of
    `memory_bytes`. A denser precision holds more of the burst at once: fewer preemptions,
    each of which recomputes its victim's whole prefix. One engine per precision, run one after
    another in this process (a warm-up burst first, not counted)."""
    from tqdm.auto import tqdm

    from kvlab.bench.scheduling import measure_bursts
    from kvlab.engine import LLM

    rows = []
    per_request = cdiv(input_len + output_len, block_size)
    for name in tqdm(dtypes, desc="capacity by dtype", disable=not progress):
        llm = LLM(model, dtype=model_dtype_for(name), kv_cache_dtype=name,
                  kv_cache_memory_bytes=memory_bytes, block_size=block_size,
                  max_model_len=input_len + output_len + block_size)
        stats = llm.stats()
        rows.append({"kv_cache_dtype": stats["kv_cache_dtype"],
                     "bytes_per_token": stats["kv_bytes_per_token"],
                     "num_blocks": stats["num_blocks"],
                     "memory_bytes": memory_bytes,
                     "fit_at_once": stats["num_usable_blocks"] // per_request,
                     "concurrency": concurrency,
                     **measure_bursts(llm, concurrency, input_len, output_len, repeats)})
        del llm
    return rows

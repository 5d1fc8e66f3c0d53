"""Chapter 08 exercise: store K/V in int8, one scale per (token, head).

What it teaches: a quantized KV cache stores small integers and a scale beside them, and the
scale is a decision. Too large and every value loses precision; too small and the largest values
clip. One scale for the whole tensor lets one loud head drown the quiet ones. The chapter shows
all three on the real model's K; the participant picks the rule.

Checked on hand-made tensors first (shapes and dtypes, every value within half a step, nothing
clipped, the whole range used, a loud head beside quiet ones, an all-zero head, seeded random
tensors), then plugged into the engine's int8_per_token_head cache on the real model: the
next-token distributions over the chapter's texts must be as close to the full-precision cache's
as kvlab's own int8 quantizer keeps them.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from kvlab.kv_sizing import blocks_held, pool_bytes
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch

IMPORTS = "import torch"


def quantize_int8(x):
    """x: (..., head_dim) float, one vector per (token, KV head) -> (q int8 of x's shape, scale
    float32 of x.shape[:-1]) such that q * scale[..., None] reads back close to x."""
    # One scale per vector: a loud head must not cost a quiet one its precision.
    # The smallest scale at which nothing clips maps the largest |value| to 127; a larger one
    # only widens every step. The floor keeps an all-zero vector finite.
    scale = (x.float().abs().amax(dim=-1) / 127).clamp_min(1e-6)
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


STUB = '''import torch


def quantize_int8(x):
    """Quantize K or V for an int8 cache. x: a float tensor (..., head_dim), one vector per
    (token, KV head). Return (q, scale): q an int8 tensor of x's shape, scale a float32 tensor
    of shape x.shape[:-1], one per vector, so that q * scale[..., None] reads x back.

    What must hold, for every vector: nothing clips (each value reads back within half a step,
    scale / 2, of x); the step is no coarser than that needs (the cell above showed what a
    coarse step costs a quiet vector); and a vector of zeros reads back as zeros, in finite
    numbers. Example: x of shape (6, 3, 64) -> q int8 (6, 3, 64), scale float32 (6, 3).
    """
    raise NotImplementedError("your turn")
'''


def _call(impl, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = impl(x.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise Mismatch("a tuple (q, scale)", f"{type(out).__name__}")
    q, scale = out
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.shape != x.shape:
        got = (f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor)
               else type(q).__name__)
        raise Mismatch(f"q: an int8 tensor of shape {tuple(x.shape)}", got)
    if not isinstance(scale, torch.Tensor) or scale.shape != x.shape[:-1]:
        got = (f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor)
               else type(scale).__name__)
        raise Mismatch(f"scale: a tensor of shape {tuple(x.shape[:-1])}, one per vector", got)
    return q, scale.float()


def _read_back(q, scale):
    return q.float() * scale[..., None]


def _within_half_step(impl, x: torch.Tensor, what: str) -> None:
    q, scale = _call(impl, x)
    if not torch.isfinite(scale).all():
        raise Mismatch("a finite scale for every vector", f"{scale[~torch.isfinite(scale)][:3]}")
    err = (_read_back(q, scale) - x).abs()
    bound = scale[..., None] / 2 * (1 + 1e-4) + 1e-7
    if (err > bound).any():
        i = tuple(int(j) for j in (err > bound).nonzero()[0])
        raise Mismatch(f"every value within half a step of x ({what})",
                       f"x{list(i)} = {float(x[i]):.4g} reads back as "
                       f"{float(_read_back(q, scale)[i]):.4g}, a step being {float(scale[i[:-1]]):.3g}",
                       "a value past 127 steps clips; a rounding down loses up to a whole step")


def _k_like(seed: int, tokens: int = 6, heads: int = 3, dim: int = 64) -> torch.Tensor:
    """Vectors shaped as real K: most channels small, a few large, heads of unequal size."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((tokens, heads, dim), generator=gen)
    x[..., int(torch.randint(0, dim, (1,), generator=gen))] *= 8  # an outlier channel
    return x * torch.tensor([0.5, 2.0, 6.0])[:heads, None]


def _shapes(impl) -> None:
    for shape in [(4, 3, 64), (1, 1, 8), (2, 5, 2, 16)]:
        _call(impl, torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))))


def _half_step(impl) -> None:
    _within_half_step(impl, _k_like(1), "K-like vectors, heads of unequal size")
    # The largest value of a vector, exactly, and its negative: neither may clip.
    x = torch.tensor([[[3.0, -1.0, 0.5, 2.0], [-7.5, 7.5, 0.1, 0.0]]])
    _within_half_step(impl, x, "a vector whose largest value is negative")


def _finest_step(impl) -> None:
    """The scale is no larger than it must be: the largest |value| maps to 127."""
    x = _k_like(2)
    q, scale = _call(impl, x)
    need = x.abs().amax(-1) / 127
    if (scale > need * 1.001).any():
        i = tuple(int(j) for j in (scale > need * 1.001).nonzero()[0])
        raise Mismatch(f"a step of at most {float(need[i]):.4g} for vector {list(i)} (its "
                       f"largest |value| {float(x[i].abs().max()):.4g} at 127)",
                       f"a step of {float(scale[i]):.4g}: {float(scale[i] / need[i]):.2f}x "
                       "coarser than int8 allows")


def _loud_head(impl) -> None:
    """One head 1,000x louder than the others: the quiet heads keep their own fine steps."""
    x = torch.randn((4, 3, 64), generator=torch.Generator().manual_seed(3))
    x[:, 0] *= 1000.0
    q, scale = _call(impl, x)
    err = (_read_back(q, scale) - x)[:, 1:].abs().max()
    quiet = x[:, 1:].abs().max()
    if err > quiet / 127:
        raise Mismatch("the quiet heads read back within 1/254 of their own largest value",
                       f"an error of {float(err):.3g} on values of at most {float(quiet):.3g}",
                       "one scale for the whole tensor is set by the loud head")


def _zeros(impl) -> None:
    x = torch.randn((2, 3, 16), generator=torch.Generator().manual_seed(4))
    x[1, 2] = 0.0
    q, scale = _call(impl, x)
    if not float(scale[1, 2]) > 0:
        raise Mismatch("a positive scale for a vector of zeros", f"{float(scale[1, 2])!r}",
                       "with a scale of 0 every value is 0 / 0 = NaN, and what casting NaN to "
                       "int8 gives is undefined")
    back = _read_back(q, scale)
    if not torch.isfinite(back).all() or back[1, 2].abs().max() != 0:
        raise Mismatch("a vector of zeros to read back as zeros", f"{back[1, 2][:4].tolist()}",
                       "0 / 0 is NaN: a scale of zero needs a floor")


def _random(impl) -> None:
    for seed in range(5, 10):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((8, 3, 64), generator=gen) * torch.rand((8, 3, 1), generator=gen) * 10
        _within_half_step(impl, x, f"seeded random vectors (seed {seed})")
        q, scale = _call(impl, x)
        ref_q, ref_scale = quantize_int8(x)
        if not torch.allclose(scale, ref_scale, rtol=1e-3):
            raise Mismatch("the finest scale int8 allows for every vector",
                           f"scales {scale.flatten()[:3].tolist()} where "
                           f"{ref_scale.flatten()[:3].tolist()} fit")


# ---- the real model -----------------------------------------------------------------------------
MODE = "int8_per_token_head"
NUM_TEXTS = 3
TEXT_TOKENS = 96


@contextmanager
def installed(impl):
    """The engine's int8_per_token_head cache quantizes with `impl` while this lasts (every
    other precision as before); the reading side is kvlab's (q * scale)."""
    from kvlab import kv_quant

    original = kv_quant.quantize

    def quantize(spec, x, storage, rotation, kv_scale=1.0):
        if spec.name != MODE:
            return original(spec, x, storage, rotation, kv_scale)
        q, scale = _call(impl, x)
        return q, scale.to(torch.float32)

    kv_quant.quantize = quantize
    try:
        yield
    finally:
        kv_quant.quantize = original


def _texts() -> list[list[int]]:
    from kvlab.bench.kv_dtype import load_texts
    from kvlab.model import load_model

    tok = load_model().tokenizer
    return [tok(t).input_ids[:TEXT_TOKENS] for t in load_texts()[:NUM_TEXTS]]


def text_kl(kv_cache_dtype: str, base=None) -> tuple[float, list]:
    """Mean KL(auto || this) in nats over the texts' positions, and this cache's log-probs."""
    from kvlab.bench.kv_dtype import mean_kl, text_logprobs
    from kvlab.engine import LLM

    llm = LLM(kv_cache_dtype=kv_cache_dtype, max_model_len=TEXT_TOKENS + 16,
              kv_cache_tokens=TEXT_TOKENS + 16)
    logprobs = [text_logprobs(llm, ids) for ids in _texts()]
    return (0.0 if base is None else mean_kl(base, logprobs)), logprobs


@functools.lru_cache(maxsize=1)
def _reference() -> tuple[list, float]:
    """auto's log-probs and kvlab's own int8 KL, once per process."""
    with _real_engine.one_thread():
        _, base = text_kl("auto")
        kl, _ = text_kl(MODE, base)
    return base, kl


def _real_model(impl) -> str:
    base, ref_kl = _reference()
    with _real_engine.one_thread(), installed(impl):
        mine, _ = text_kl(MODE, base)
    verdict = (f"yours: mean KL {mine:.2e} nats against the full-precision cache; kvlab's int8: "
               f"{ref_kl:.2e} ({NUM_TEXTS} texts of {TEXT_TOKENS} tokens, every position)")
    if not mine <= 1.2 * ref_kl + 1e-6:
        raise Mismatch("the next-token distributions as close to full precision as kvlab's "
                       "int8 keeps them (within 20%)", verdict)
    return verdict


EXERCISE = Exercise(
    name="quantize_int8",
    chapter="08_kv_precision",
    title="int8 K/V with a scale per (token, head)",
    prompt=(
        "Write the write side of an int8 KV cache: each (token, KV head) vector becomes int8 "
        "values and one float32 scale. Choose the scale from what this chapter showed: what "
        "clips, what wastes the range, and what one loud head does to the others. The check "
        "runs hand-made tensors, then plugs your function into the real engine's "
        "int8_per_token_head cache and measures the next-token distributions it gives."
    ),
    full_version=(
        "vLLM quantizes as K/V are written, in the kernel that scatters them into the cache "
        "(_reshape_cache_per_token_head in vllm/v1/attention/ops/triton_reshape_and_cache_flash"
        ".py), with the same absmax / 127 scale and a floor, rounding halves away from zero; its "
        "attention kernel multiplies the scale back in tile by tile. kvlab's full version "
        "(kvlab/kv_quant.py) adds fp8 per tensor and per (token, head), int4 with a rotation "
        "and a zero point, and copies the scales with a block on copy-on-write (chapter 02)."
    ),
    stub=STUB,
    hint=(
        "In the cell above, one scale for the whole layer left the quietest vector 17 of its "
        "127 steps (printed), and a scale from the typical values clipped. For one vector, which scale "
        "clips nothing and leaves no step unused? Then: what does your formula give for a "
        "vector of zeros?"
    ),
    solution=quantize_int8,
    imports=IMPORTS,
    cases=[
        Case("shapes and dtypes: q int8 as x, one scale per vector", _shapes,
             "q = x's shape in int8; scale = x.shape[:-1]: one per (token, KV head) vector, as "
             "int8_per_token_head keeps them (chapter 08's table of what each setting stores)."),
        Case("every value within half a step (nothing clipped)", _half_step,
             "A value larger than 127 steps cannot be stored: it clips (chapter 08's 'The scale "
             "is a decision': the scale from 3 x the mean |value| clipped, and its worst error "
             "was far over a step). The scale must reach each vector's largest |value|, negative"
             " ones too."),
        Case("the finest step int8 allows", _finest_step,
             "Chapter 08's 'The scale is a decision': one scale for the whole layer left the "
             "quietest vector 17 of its 127 steps (printed), and its relative error grew. Each vector's"
             " largest |value| should land on 127, not below."),
        Case("a loud head beside quiet ones", _loud_head,
             "Chapter 08's 'The scale is a decision': one scale for the layer is set by its "
             "loudest vector. Reduce over the last dimension only: one scale per (token, head)."),
        Case("a vector of zeros", _zeros,
             "A vector's largest |value| can be 0, and 0 / 0 is NaN: give the scale a floor, "
             "such as 1e-6."),
        Case("seeded random vectors, against kvlab's scales", _random,
             "The scale that avoids both failures of chapter 08's 'The scale is a decision': "
             "the vector's largest |value| / 127."),
        Case("real model: the int8 cache's next-token distributions, yours beside kvlab's",
             _real_model, "Compare the two KL divergences printed above: chapter 08's table "
             "ranks the precisions by this KL.", real_model=True,
             timeout_s=300),
    ],
)


# ---- challenge: a precision and a pool for a workload -------------------------------------------
# The float32 model's choices: a bfloat16 cache is not one (vLLM refuses a float16/bfloat16
# kv_cache_dtype unlike the model's dtype: VllmConfig._reject_mismatched_float_kv_cache in
# vllm/config/vllm.py, and so does kvlab).
CHALLENGE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head",
                    "int8_per_token_head", "int4_per_token_head")
BURST = dict(num_requests=16, prompt_len=68, output_len=32, block_size=16)
MAX_KL = 2e-3  # nats; measured here: int8_per_token_head ~8e-4, fp8_per_token_head ~5e-3


def choose_kv_cache(num_requests, prompt_len, output_len, block_size, max_kl, kl_by_dtype,
                    bytes_per_token):
    """The fewest bytes that hold the whole burst at once, at a precision within the bound."""
    # Accuracy first: only precisions whose measured KL stays within the bound.
    allowed = [d for d, kl in kl_by_dtype.items() if kl <= max_kl]
    # Of those, the densest: the fewest bytes per token (scales included).
    dtype = min(allowed, key=lambda d: bytes_per_token[d])
    # A request ends holding whole blocks of K/V for all its tokens but the last one sampled
    # (that token is returned, never fed back: chapter 01's p + N - 1); the bytes must hold
    # every request's blocks at once, and block 0, vLLM's null block, never handed out.
    blocks = num_requests * blocks_held(prompt_len, output_len, block_size)
    return {"kv_cache_dtype": dtype,
            "kv_cache_memory_bytes": pool_bytes(blocks, block_size, bytes_per_token[dtype])}


CHALLENGE_STUB = '''def choose_kv_cache(num_requests, prompt_len, output_len, block_size, max_kl,
                    kl_by_dtype, bytes_per_token):
    """Return {"kv_cache_dtype": ..., "kv_cache_memory_bytes": ...} for a burst of num_requests
    requests, each a prompt_len-token prompt and output_len new tokens, blocks of block_size
    tokens, all running at once.
    kl_by_dtype: each kv_cache_dtype's mean KL from the full-precision cache (nats), as this
    chapter measured it; bytes_per_token: each one's bytes per token. The burst must run with
    nothing preempted, the chosen precision's KL must stay within max_kl, and the check counts
    the bytes you ask for against the fewest that do both."""
    raise NotImplementedError("your turn")
'''


def _challenge_choice(impl, **workload) -> tuple[str, int]:
    out = impl(**workload)
    if not isinstance(out, dict) or set(out) != {"kv_cache_dtype", "kv_cache_memory_bytes"}:
        raise Mismatch('a dict with "kv_cache_dtype" and "kv_cache_memory_bytes"',
                       repr(out)[:120])
    dtype, nbytes = out["kv_cache_dtype"], out["kv_cache_memory_bytes"]
    if dtype not in workload["kl_by_dtype"]:
        raise Mismatch(f"one of {sorted(workload['kl_by_dtype'])}", repr(dtype))
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise Mismatch("kv_cache_memory_bytes as an int >= 1", repr(nbytes))
    return dtype, nbytes


# Bytes per token of SmolLM2-135M (30 layers, 3 KV heads of 64) at each precision.
_BPT = {"auto": 46080, "fp8_e4m3": 11520, "fp8_e5m2": 11520,
        "fp8_per_token_head": 12240, "int8_per_token_head": 12240,
        "int4_per_token_head": 6480}


def _challenge_arithmetic(impl) -> None:
    """Other workloads and bounds, with made-up KLs (so that a constant cannot pass)."""
    kls = {"auto": 0.0, "fp8_e4m3": 3e-3, "fp8_e5m2": 2e-2,
           "fp8_per_token_head": 8e-4, "int8_per_token_head": 1e-4,
           "int4_per_token_head": 5e-2}
    for n, p, o, bs, bound in [(8, 80, 20, 16, 1e-3), (4, 60, 4, 16, 1e-1), (10, 23, 10, 8, 1e-5),
                               (3, 45, 5, 32, 0.0), (6, 150, 50, 16, 5e-3)]:
        work = dict(num_requests=n, prompt_len=p, output_len=o, block_size=bs, max_kl=bound,
                    kl_by_dtype=dict(kls), bytes_per_token=dict(_BPT))
        dtype, nbytes = _challenge_choice(impl, **work)
        best = choose_kv_cache(**work)
        need = pool_bytes(n * blocks_held(p, o, bs), bs, _BPT[dtype])
        where = f"{n} requests of {p} + {o} tokens, blocks of {bs}, max_kl {bound:g}"
        if kls[dtype] > bound:
            raise Mismatch(f"a precision within max_kl ({where})",
                           f"{dtype}, whose KL is {kls[dtype]:g}")
        if nbytes < need:
            raise Mismatch(f"at least {need:,} bytes at {dtype} ({where}): every request's "
                           "whole blocks at once, and block 0", f"{nbytes:,}",
                           "a request's last block is whole even when half full, and block 0 "
                           "(the null block) is never handed out")
        if nbytes > 1.25 * best["kv_cache_memory_bytes"]:
            raise Mismatch(f"at most 25% over the fewest bytes, {best['kv_cache_memory_bytes']:,}"
                           f" at {best['kv_cache_dtype']} ({where})", f"{nbytes:,} at {dtype}")


def _burst(kv_cache_dtype: str, memory_bytes: int) -> dict:
    """The burst through a fresh engine with this pool: preemptions, peak running, tok/s."""
    import time

    from kvlab.engine import LLM
    from kvlab.sampling import RequestOutputKind, SamplingParams

    b = BURST
    prompts = _real_engine.prompt_ids([b["prompt_len"]] * b["num_requests"])
    sp = SamplingParams(max_tokens=b["output_len"], temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    llm = LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=memory_bytes,
              block_size=b["block_size"], max_model_len=b["prompt_len"] + b["output_len"],
              max_num_batched_tokens=b["prompt_len"] * b["num_requests"])
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    seconds = time.perf_counter() - t0
    trace = llm.llm_engine.step_trace
    return {"preemptions": llm.stats()["num_preemptions"],
            "peak_running": max(r.num_running for r in trace),
            "tok_s": b["num_requests"] * b["output_len"] / seconds}


@functools.lru_cache(maxsize=1)
def measured_kls() -> dict[str, float]:
    """Each precision's mean KL from "auto" on the chapter's texts, once per process."""
    with _real_engine.one_thread():
        _, base = text_kl("auto")
        return {d: (0.0 if d == "auto" else text_kl(d, base)[0]) for d in CHALLENGE_DTYPES}


def _challenge_measured(impl) -> str:
    from kvlab.kv_quant import get_kv_cache_dtype
    from kvlab.model import load_model

    cfg = load_model().config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    bpt = {d: get_kv_cache_dtype(d).bytes_per_token(
        cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.float32)
        for d in CHALLENGE_DTYPES}
    kls = measured_kls()
    b = BURST
    work = dict(num_requests=b["num_requests"], prompt_len=b["prompt_len"],
                output_len=b["output_len"], block_size=b["block_size"], max_kl=MAX_KL, kl_by_dtype=dict(kls),
                bytes_per_token=dict(bpt))
    dtype, nbytes = _challenge_choice(impl, **work)
    best = choose_kv_cache(**work)
    with _real_engine.one_thread():
        mine = _burst(dtype, nbytes)
    verdict = (f"yours: {dtype}, {nbytes / 2**20:.2f} MiB: KL {kls[dtype]:.1e} nats (bound "
               f"{MAX_KL:g}), {mine['peak_running']} of {b['num_requests']} running at once, "
               f"{mine['preemptions']} preemptions; the fewest bytes: "
               f"{best['kv_cache_dtype']}, {best['kv_cache_memory_bytes'] / 2**20:.2f} MiB")
    if kls[dtype] > MAX_KL:
        raise Mismatch(f"a precision whose KL stays within {MAX_KL:g} nats", verdict,
                       "the bytes saved are paid for in next-token distributions")
    if mine["preemptions"] > 0 or mine["peak_running"] < b["num_requests"]:
        raise Mismatch("every request running at once, none preempted", verdict,
                       "the pool holds fewer requests than the burst: a request holds whole "
                       "blocks of K/V for its prompt and every new token but the last (chapter "
                       "01), and the pool's block 0, the null block, is never handed out")
    ratio = nbytes / best["kv_cache_memory_bytes"]
    if ratio > 1.25:
        raise Mismatch("at most 25% more bytes than the fewest that do both", verdict,
                       "a denser precision within the bound, or a pool sized in whole blocks "
                       "for exactly the burst, holds it in less")
    return f"{verdict}; yours asks for {ratio:.2f}x the fewest bytes"


CHALLENGE = Exercise(
    name="kv_precision",
    chapter="08_kv_precision",
    title="a precision and a pool for a workload",
    kind="challenge",
    prompt=(
        "Choose kv_cache_dtype and kv_cache_memory_bytes for a burst that must run at once "
        "within an accuracy bound, in as few bytes as you can. Your function gets the KL and "
        "the bytes per token of every precision, measured as this chapter measures them; "
        "within the bound means at most max_kl. The check measures your choice on the real "
        "model: the KL, the preemptions, and your bytes against the fewest that do both."
    ),
    full_version=(
        "A server does not know its burst in advance: vLLM sizes the pool from the memory left "
        "after the weights (gpu_memory_utilization, or kv_cache_memory_bytes), and the scheduler"
        " admits what fits and preempts the rest (chapter 03). The accuracy side is usually "
        "judged on task benchmarks rather than one KL, and fp8 with calibrated per-tensor scales"
        " (llm-compressor, vLLM's Quantized KV Cache docs) does better than kvlab's uncalibrated "
        "scale of 1.0."
    ),
    stub=CHALLENGE_STUB,
    hint=(
        "First drop every precision whose KL is over max_kl. Of the rest, take the one with the "
        "fewest bytes per token. Then size the pool in whole blocks: how many does one request "
        "hold at its last step (chapter 01's count)? And which block of the pool is never "
        "handed out to any request?"
    ),
    solution=choose_kv_cache,
    imports="from kvlab.kv_sizing import blocks_held, pool_bytes",
    cases=[
        Case("five other workloads and bounds, with made-up KLs, by the arithmetic",
             _challenge_arithmetic,
             "Filter by the bound, then the fewest bytes, then whole blocks and the null block."),
        Case(f"real model: {BURST['num_requests']} requests of {BURST['prompt_len']} + "
             f"{BURST['output_len']} tokens, KL within {MAX_KL:g}, yours beside the best",
             _challenge_measured, "Compare the KL, preemptions and bytes printed above.",
             real_model=True, timeout_s=600),
    ],
)
EXERCISES = [EXERCISE, CHALLENGE]

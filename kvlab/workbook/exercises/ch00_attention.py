"""Attention for one decode token: chapter 00 over a contiguous KV cache, chapter 01 over a
paged one.

Chapter 00 (`decode_attention`): a request's cache is one contiguous region reserved for its
longest length; the rows past the tokens it holds are not written yet. Cut at the sequence's
length, let each group of query heads read its shared KV head (grouped-query attention), attend.
Chapter 01 (`paged_decode_attention`): the same attention, but the keys and values are wherever
the sequence's block table says in a pool of blocks: gather them back in order first (the last
block is only partly filled).

Both are checked against `F.scaled_dot_product_attention` over the contiguous keys and values,
with garbage in every slot that is not the sequence's; then plugged into the real engine as the
decode path of an attention backend, where the tokens must equal kvlab's own.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from kvlab.attention import ReferenceBackend, gather_kv, paged_attention_reference
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, cdiv

IMPORTS = "import torch"


def decode_attention(q, k_cache, v_cache, seq_len, scale):
    """Attention output of one decode token: q (num_heads, head_dim) -> (num_heads, head_dim).

    k_cache, v_cache: (max_len, num_kv_heads, head_dim), this request's contiguous cache; rows
    0 .. seq_len - 1 hold its tokens (the new token's K/V already written at seq_len - 1).
    """
    num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    # The region was reserved for the longest the request may grow: the rows past seq_len are
    # tokens not generated yet, whatever they hold. Attend over the first seq_len only.
    k, v = k_cache[:seq_len], v_cache[:seq_len]  # (L, Hkv, D)
    # Grouped-query attention: query head h reads KV head h // group, so repeat each KV head
    # for the `group` query heads that share it.
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # (L, Hq, D)
    v = v.repeat_interleave(group, dim=1)  # (L, Hq, D)
    # The decode token is the newest position: it may see every key, so there is no mask.
    scores = torch.einsum("hd,lhd->hl", q, k) * scale  # (Hq, L)
    weights = torch.softmax(scores, dim=-1)  # each query head's weights sum to 1
    return torch.einsum("hl,lhd->hd", weights, v)  # (Hq, D)


CONTIGUOUS_STUB = '''import torch


def decode_attention(q, k_cache, v_cache, seq_len, scale):
    """Attention output of one decode token: q (num_heads, head_dim) -> (num_heads, head_dim).

    Row h of the output is query head h's attention: the softmax of (q . k) * scale over its
    keys weights its values. k_cache, v_cache: (max_len, num_kv_heads, head_dim), this
    request's region, reserved for max_len tokens: rows 0 .. seq_len - 1 hold its tokens (the
    newest one's included); the rows past them are not written yet and hold anything.
    num_heads is a multiple of num_kv_heads: several query heads share one KV head, and which
    share which, the SDPA table above shows.
    Example: q (9, 64), k_cache and v_cache (128, 3, 64), seq_len 20 -> a tensor (9, 64).
    """
    raise NotImplementedError("your turn")
'''


def _sdpa_case(seed: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               seq_len: int, extra_blocks: int = 0, scale: float | None = None):
    """A pool full of garbage, one sequence scattered through it, and SDPA's answer."""
    g = torch.Generator().manual_seed(seed)
    num_used = cdiv(seq_len, block_size) + extra_blocks
    num_blocks = num_used + 3
    kv_layer = 10 * torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    block_table = torch.randperm(num_blocks, generator=g)[:num_used].tolist()
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)  # the contiguous sequence
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    for p in range(seq_len):
        kv_layer[0, block_table[p // block_size], p % block_size] = k[p]
        kv_layer[1, block_table[p // block_size], p % block_size] = v[p]
    q = torch.randn(num_heads, head_dim, generator=g)
    scale = head_dim**-0.5 if scale is None else scale
    expected = F.scaled_dot_product_attention(
        q[None, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale,
        enable_gqa=True)[0, :, 0, :]
    return (q, kv_layer, block_table, seq_len, scale), expected


def _compare(impl, args, expected, what: str) -> None:
    q, kv_layer, block_table, seq_len, scale = args
    got = impl(q.clone(), kv_layer.clone(), list(block_table), seq_len, scale)
    _check_output(got, expected, what)


def _fixed(desc: str, **kw):
    def run(impl):
        args, expected = _sdpa_case(**kw)
        _compare(impl, args, expected, desc)
    return run


def _random_shapes(impl) -> None:
    rng = random.Random(0)
    for trial in range(40):
        num_kv_heads = rng.choice([1, 2, 3])
        group = rng.choice([1, 2, 3])
        kw = dict(seed=1000 + trial, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                  head_dim=rng.choice([2, 4, 8]), block_size=rng.choice([1, 2, 4, 5, 16]),
                  seq_len=rng.randint(1, 40), extra_blocks=rng.choice([0, 0, 1]),
                  scale=rng.uniform(0.1, 1.0))
        args, expected = _sdpa_case(**kw)
        _compare(impl, args, expected, "random case: " + ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in kw.items() if k != "seed"))


class _ParticipantDecodeBackend(ReferenceBackend):
    """kvlab's reference backend, with every decode token attended by the participant's
    function (a prefill still goes through kvlab's own path)."""

    name = "exercise"

    def __init__(self, impl) -> None:
        self.impl = impl

    def forward(self, q, kv_layer, meta, scale):
        out = paged_attention_reference(q, kv_layer, meta, scale)
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if end - start != 1:
                continue
            o = self.impl(q[start], kv_layer, meta.block_tables[i].tolist(), seq_len, scale)
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(q[start].shape):
                raise Mismatch(f"a tensor of shape {tuple(q[start].shape)} in the engine",
                               f"{type(o).__name__} {tuple(getattr(o, 'shape', ()))}")
            out[start] = o
        return out


_ENGINE = dict(block_size=4, max_model_len=128, kv_cache_tokens=512, backend="reference")


def _contiguous_case(seed: int, num_heads: int, num_kv_heads: int, head_dim: int, seq_len: int,
                     max_len: int | None = None, scale: float | None = None):
    """One request's cache reserved for max_len tokens (garbage past seq_len), and SDPA's
    answer over its first seq_len tokens."""
    g = torch.Generator().manual_seed(seed)
    max_len = seq_len if max_len is None else max_len
    k_cache = 10 * torch.randn(max_len, num_kv_heads, head_dim, generator=g)
    v_cache = 10 * torch.randn(max_len, num_kv_heads, head_dim, generator=g)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    k_cache[:seq_len], v_cache[:seq_len] = k, v
    q = torch.randn(num_heads, head_dim, generator=g)
    scale = head_dim**-0.5 if scale is None else scale
    expected = F.scaled_dot_product_attention(
        q[None, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale,
        enable_gqa=True)[0, :, 0, :]
    return (q, k_cache, v_cache, seq_len, scale), expected


def _check_output(got, expected, what: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"a tensor of shape {tuple(expected.shape)}", type(got).__name__)
    if tuple(got.shape) != tuple(expected.shape):
        raise Mismatch(f"shape {tuple(expected.shape)} (num_heads, head_dim)",
                       f"shape {tuple(got.shape)}", what)
    err = (got.float() - expected).abs()
    if not torch.isfinite(err).all() or err.max() > 1e-4:
        head = int(err.max(dim=-1).values.argmax()) if torch.isfinite(err).all() else 0
        raise Mismatch("the output of SDPA over the sequence's own tokens (within 1e-4)",
                       f"a difference of {err.max().item():.3g} (largest at query head {head})",
                       what)


def _contiguous_fixed(desc: str, **kw):
    def run(impl):
        (q, k_cache, v_cache, seq_len, scale), expected = _contiguous_case(**kw)
        got = impl(q.clone(), k_cache.clone(), v_cache.clone(), seq_len, scale)
        _check_output(got, expected, desc)
    return run


def _contiguous_random(impl) -> None:
    rng = random.Random(1)
    for trial in range(40):
        num_kv_heads = rng.choice([1, 2, 3])
        group = rng.choice([1, 2, 3])
        seq_len = rng.randint(1, 40)
        kw = dict(seed=2000 + trial, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                  head_dim=rng.choice([2, 4, 8]), seq_len=seq_len,
                  max_len=seq_len + rng.choice([0, 1, 7]), scale=rng.uniform(0.1, 1.0))
        _contiguous_fixed("random case: " + ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in kw.items() if k != "seed"), **kw)(impl)


class _ParticipantContiguousBackend(ReferenceBackend):
    """kvlab's reference backend, with every decode token attended by the participant's
    contiguous-cache function: each sequence's K/V are gathered from the pool into a region
    reserved for max_model_len tokens, garbage past the sequence's length."""

    name = "exercise"

    def __init__(self, impl) -> None:
        self.impl = impl
        self.garbage = torch.Generator().manual_seed(0)

    def forward(self, q, kv_layer, meta, scale):
        out = paged_attention_reference(q, kv_layer, meta, scale)
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if end - start != 1:
                continue
            k, v = gather_kv(kv_layer, meta.block_tables[i], seq_len)  # (Hkv, L, D)
            max_len = _ENGINE["max_model_len"]
            shape = (max_len, k.shape[0], k.shape[2])
            k_cache = 10 * torch.randn(shape, generator=self.garbage, dtype=k.dtype)
            v_cache = 10 * torch.randn(shape, generator=self.garbage, dtype=v.dtype)
            k_cache[:seq_len], v_cache[:seq_len] = k.transpose(0, 1), v.transpose(0, 1)
            o = self.impl(q[start], k_cache, v_cache, seq_len, scale)
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(q[start].shape):
                raise Mismatch(f"a tensor of shape {tuple(q[start].shape)} in the engine",
                               f"{type(o).__name__} {tuple(getattr(o, 'shape', ()))}")
            out[start] = o
        return out




def _batches():
    prompts = _real_engine.prompt_ids([5, 11, 18])
    return [[(f"r{i}", {"prompt_token_ids": p}, _real_engine.GREEDY) for i, p in enumerate(prompts)]]


def real_model_case(name: str, backend_class):
    """The real engine with `backend_class(impl)` as its attention: kvlab's tokens expected."""
    def run(impl) -> None:
        expected = _real_engine.reference_workload(name, _ENGINE, _batches)

        def install(engine):
            engine.set_attention_backend(backend_class(impl))

        engine, got = _real_engine.run_with(_ENGINE, _batches, install)
        _real_engine.compare_tokens(expected, got, "your attention in every decode step")
        _real_engine.check_bookkeeping(engine)
    return run


EXERCISE = Exercise(
    name="decode_attention",
    chapter="00_the_model_and_its_kv_cache",
    title="Attention of one decode token over its KV cache",
    prompt=(
        "Write the attention of one decode token over its request's KV cache, the region "
        "pictured above. Which KV head each query head reads is yours to work out, from the "
        "SDPA table above. The check compares you with PyTorch's SDPA, then runs the real model "
        "with your function in every decode step."
    ),
    full_version=(
        "kvlab keeps no region per request: its cache is a pool of blocks, and a request's K/V "
        "are wherever its block table says (chapter 01, whose exercise is this attention through "
        "a block table). Its decode path attends for every decode token of a step in one call "
        "(kvlab/attention.py, paged_attention_decode), folding each KV head's query heads into "
        "rows so no K/V is repeated (chapter 03 batches the decodes)."
    ),
    stub=CONTIGUOUS_STUB,
    hint=(
        "Read the SDPA table again: which query heads moved with KV head 0, and how many share "
        "each KV head, for 9 and 3, then 4 and 2? Write query head h's KV head as a formula of h, "
        "num_heads and num_kv_heads. Then take only the request's rows, give each query head "
        "its KV head's keys and values (repeat_interleave on the head dimension does all at "
        "once), and attend."
    ),
    solution=decode_attention,
    imports=IMPORTS,
    cases=[
        Case("one KV head per query head, the cache exactly full", _contiguous_fixed(
            "1 head, head_dim 4, seq_len 4, max_len 4", seed=1, num_heads=1, num_kv_heads=1,
            head_dim=4, seq_len=4),
            "Chapter 00's attention (the docstring): each query head's softmax of "
            "(q . k) * scale over the keys weights the values."),
        Case("rows past seq_len are not the sequence's: reserved, not written", _contiguous_fixed(
            "seq_len 5 in a cache of max_len 12", seed=2, num_heads=2, num_kv_heads=2,
            head_dim=4, seq_len=5, max_len=12),
            "Chapter 00's region: max_len rows are reserved, only the first seq_len are "
            "written; the rows past them are no token's (here, large garbage). Attend over the "
            "first seq_len rows only."),
        Case("a single token (seq_len 1)", _contiguous_fixed(
            "2 heads, seq_len 1, max_len 8", seed=3, num_heads=2, num_kv_heads=2, head_dim=4,
            seq_len=1, max_len=8), "Chapter 00's region, one row written: with one key the "
            "softmax weight is 1, so each query head's output is its KV head's value row 0."),
        Case("grouped-query attention: 9 query heads share 3 KV heads (SmolLM2)",
             _contiguous_fixed("9 query heads, 3 KV heads, head_dim 8, seq_len 10", seed=4,
                               num_heads=9, num_kv_heads=3, head_dim=8, seq_len=10, max_len=16),
             "Chapter 00's SDPA table: changing KV head 0 moved query heads 0, 1, 2, KV head "
             "1 moved 3, 4, 5, KV head 2 moved 6, 7, 8. Neighbouring query heads share a KV "
             "head, num_heads // num_kv_heads of them: query head h reads KV head "
             "h // (num_heads // num_kv_heads), not h % num_kv_heads."),
        Case("multi-query attention: 4 query heads, 1 KV head", _contiguous_fixed(
            "4 query heads, 1 KV head, seq_len 6", seed=5, num_heads=4, num_kv_heads=1,
            head_dim=4, seq_len=6, max_len=9),
             "Chapter 00's SDPA table, taken to one KV head: every query head reads it."),
        Case("the scale is applied to q . k", _contiguous_fixed(
            "scale 0.37", seed=6, num_heads=2, num_kv_heads=2, head_dim=4, seq_len=6,
            max_len=8, scale=0.37),
            "The docstring's contract: multiply the scores by `scale` before the softmax (it "
            "is not always 1/sqrt(D))."),
        Case("40 random shapes and lengths", _contiguous_random,
             "Chapter 00's SDPA table holds for any shape: num_heads // num_kv_heads "
             "neighbouring query heads per KV head, and only the first seq_len rows."),
        Case("real model: the decode path of every layer, same tokens as kvlab",
             real_model_case("decode_attention", _ParticipantContiguousBackend),
             "The fast cases passed, so compare what your function does with a (9, 64) query and "
             "(128, 3, 64) caches.", real_model=True),
    ],
)
EXERCISES = [EXERCISE]

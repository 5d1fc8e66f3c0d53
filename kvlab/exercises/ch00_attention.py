"""Chapter 00 exercise: attention for one decode token over a paged KV cache.

What it teaches: the cache is a pool of blocks, and a sequence's keys and values are wherever its
block table says. Gather them back in order through the table, cut at the sequence's length (the
last block is only partly filled), let each group of query heads read its shared KV head
(grouped-query attention), and the result is plain attention over the contiguous sequence.

Checked against `F.scaled_dot_product_attention` over the contiguous keys and values, on random
pools whose unused slots hold garbage; then plugged into the real engine as the decode path of an
attention backend, where the tokens must equal kvlab's own.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from kvlab.attention import ReferenceBackend, paged_attention_reference
from kvlab.exercises import _engine
from kvlab.exercises._common import Case, Exercise, Mismatch, cdiv

IMPORTS = "import torch"


def paged_decode_attention(q, kv_layer, block_table, seq_len, scale):
    """Attention output of one decode token: q (num_heads, head_dim) -> (num_heads, head_dim).

    kv_layer is one layer of the pool, (2, num_blocks, block_size, num_kv_heads, head_dim):
    keys at [0], values at [1]. Token p of this sequence sits in block block_table[p //
    block_size], slot p % block_size. The new token's K/V are already written (position
    seq_len - 1).
    """
    num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    # Gather: indexing the pool with the block table puts this sequence's blocks back in
    # logical order; flatten (blocks, slots) into one row of positions and cut it at seq_len,
    # since the last block is usually only partly filled (its other slots are not ours).
    k = kv_layer[0][block_table].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # (L, Hkv, D)
    v = kv_layer[1][block_table].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # (L, Hkv, D)
    # Grouped-query attention: query head h reads KV head h // group, so repeat each KV head
    # for the `group` query heads that share it.
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # (L, Hq, D)
    v = v.repeat_interleave(group, dim=1)  # (L, Hq, D)
    # The decode token is the newest position: it may see every key, so there is no mask.
    scores = torch.einsum("hd,lhd->hl", q, k) * scale  # (Hq, L)
    weights = torch.softmax(scores, dim=-1)  # each query head's weights sum to 1
    return torch.einsum("hl,lhd->hd", weights, v)  # (Hq, D)


STUB = '''import torch


def paged_decode_attention(q, kv_layer, block_table, seq_len, scale):
    """Attention output of one decode token: q (num_heads, head_dim) -> (num_heads, head_dim).

    kv_layer: (2, num_blocks, block_size, num_kv_heads, head_dim), keys at [0], values at [1].
    Token p of the sequence sits in block block_table[p // block_size], slot p % block_size;
    read only its first seq_len tokens. Query head h reads KV head h // (num_heads //
    num_kv_heads). Softmax of (q . k) * scale over the seq_len keys, then the weighted sum of
    the values. Example: block_size 4, block_table [7, 2], seq_len 6 -> keys from block 7
    slots 0-3, then block 2 slots 0-1.
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
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"a tensor of shape {tuple(expected.shape)}", type(got).__name__)
    if tuple(got.shape) != tuple(expected.shape):
        raise Mismatch(f"shape {tuple(expected.shape)} (num_heads, head_dim)",
                       f"shape {tuple(got.shape)}", what)
    err = (got.float() - expected).abs()
    if not torch.isfinite(err).all() or err.max() > 1e-4:
        head = int(err.max(dim=-1).values.argmax()) if torch.isfinite(err).all() else 0
        raise Mismatch("the output of SDPA over the contiguous sequence (within 1e-4)",
                       f"a difference of {err.max().item():.3g} (largest at query head {head})",
                       what)


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


def _batches():
    prompts = _engine.prompt_ids([5, 11, 18])
    return [[(f"r{i}", {"prompt_token_ids": p}, _engine.GREEDY) for i, p in enumerate(prompts)]]


def _real_model(impl) -> None:
    expected = _engine.reference_workload("paged_attention", _ENGINE, _batches)

    def install(engine):
        engine.set_attention_backend(_ParticipantDecodeBackend(impl))

    engine, got = _engine.run_with(_ENGINE, _batches, install)
    _engine.compare_tokens(expected, got, "your attention in every decode step")
    _engine.check_bookkeeping(engine)


EXERCISE = Exercise(
    name="paged_attention",
    chapter="00_the_model_and_its_kv_cache",
    title="Attention over a paged KV cache",
    prompt=(
        "Write the attention of one decode token. Its keys and values are not in one tensor: "
        "they are scattered over the pool, and the block table says where. Gather them back in "
        "order, keep the first seq_len, let each group of query heads read its shared KV head, "
        "and attend. The check compares you with PyTorch's SDPA, then runs the real model with "
        "your function in every decode step."
    ),
    full_version=(
        "kvlab's decode path (kvlab/attention.py, paged_attention_decode) attends for every "
        "decode token of a step in one call: it gathers each sequence's blocks through its block "
        "table, folds each KV head's group of query heads into rows so no K/V is repeated, and "
        "masks the slots past each sequence's length, since sequences in one batch differ in "
        "length (chapter 03). Prefills attend over the cached past and the new chunk with a "
        "causal mask (chapters 04 and 05). The step's new K/V are written first, through the slot"
        " mapping (write_kv), so every layer reads its own token. backend=\"flex\" does the same "
        "with FlexAttention, compiled on a GPU (chapter 07)."
    ),
    stub=STUB,
    hint=(
        "kv_layer[0][block_table] picks the sequence's blocks in logical order: shape "
        "(num_used_blocks, block_size, num_kv_heads, head_dim). Reshape it to (-1, num_kv_heads, "
        "head_dim) and slice [:seq_len]. For grouped-query attention, repeat each KV head "
        "num_heads // num_kv_heads times (repeat_interleave on the head dimension)."
    ),
    solution=paged_decode_attention,
    imports=IMPORTS,
    cases=[
        Case("one KV head per query head, one full block", _fixed(
            "1 head, head_dim 4, block_size 4, seq_len 4", seed=1, num_heads=1, num_kv_heads=1,
            head_dim=4, block_size=4, seq_len=4),
            "Gather the sequence's K and V through the block table, then softmax(q . k * scale) "
            "weights the values."),
        Case("blocks anywhere in the pool, in block-table order", _fixed(
            "2 heads, block_size 2, seq_len 8, shuffled block table", seed=3, num_heads=2,
            num_kv_heads=2, head_dim=4, block_size=2, seq_len=8),
            "Logical block i of the sequence is physical block block_table[i]: index the pool "
            "with the whole table to get the blocks in order."),
        Case("the last block partly filled: its other slots are not ours", _fixed(
            "block_size 5, seq_len 7 (block 1 holds 2 tokens and 3 garbage slots)", seed=4,
            num_heads=3, num_kv_heads=3, head_dim=4, block_size=5, seq_len=7),
            "Attend over exactly seq_len keys: cut the gathered row of slots at seq_len."),
        Case("a single token (seq_len 1)", _fixed(
            "2 heads, block_size 4, seq_len 1", seed=2, num_heads=2, num_kv_heads=2, head_dim=4,
            block_size=4, seq_len=1), "With one key the softmax weight is 1: the output is v."),
        Case("seq_len an exact multiple of block_size", _fixed(
            "block_size 4, seq_len 8", seed=5, num_heads=2, num_kv_heads=1, head_dim=8,
            block_size=4, seq_len=8), "seq_len // block_size full blocks, nothing more."),
        Case("a block table longer than the sequence needs", _fixed(
            "block_size 4, seq_len 6, 3 blocks in the table", seed=6, num_heads=2,
            num_kv_heads=2, head_dim=4, block_size=4, seq_len=6, extra_blocks=1),
            "Read seq_len tokens, not len(block_table) * block_size."),
        Case("block_size 1", _fixed(
            "block_size 1, seq_len 5", seed=7, num_heads=2, num_kv_heads=2, head_dim=4,
            block_size=1, seq_len=5), "With block_size 1 every token has its own block."),
        Case("grouped-query attention: 9 query heads share 3 KV heads (SmolLM2)", _fixed(
            "9 query heads, 3 KV heads, head_dim 8, block_size 4, seq_len 10", seed=8,
            num_heads=9, num_kv_heads=3, head_dim=8, block_size=4, seq_len=10),
            "Query head h reads KV head h // (num_heads // num_kv_heads): heads 0-2 read KV "
            "head 0, 3-5 read KV head 1, 6-8 read KV head 2."),
        Case("multi-query attention: 4 query heads, 1 KV head", _fixed(
            "4 query heads, 1 KV head, block_size 4, seq_len 6", seed=9, num_heads=4,
            num_kv_heads=1, head_dim=4, block_size=4, seq_len=6),
            "Every query head reads the one KV head."),
        Case("the scale is applied to q . k", _fixed(
            "scale 0.37", seed=10, num_heads=2, num_kv_heads=2, head_dim=4, block_size=4,
            seq_len=6, scale=0.37),
            "Multiply the scores by `scale` before the softmax (it is not always 1/sqrt(D))."),
        Case("40 random shapes, block sizes and lengths", _random_shapes),
        Case("real model: the decode path of every layer, same tokens as kvlab", _real_model,
             "The fast cases passed, so compare what your function does with a (9, 64) query and "
             "a (2, num_blocks, 4, 3, 64) pool.", real_model=True),
    ],
)
EXERCISES = [EXERCISE]

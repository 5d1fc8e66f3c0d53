"""kv_cache_dtype (vLLM's names) and kv_cache_memory_bytes.

Model-free: what each mode stores and what one token costs, the round trip's error, scales
travelling with copied blocks, and every backend reading a quantized layer exactly as it reads
the same values dequantized. On the real model: the same bytes hold more tokens at a lower
precision, and at each precision cached = cold, chunked = unchunked, preempted = not preempted
and forked samples = unforked ones, token for token (quantized against full precision is only
measured: `python -m kvlab.bench kv-dtype`)."""

from __future__ import annotations

import functools

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.attention import get_attention_backend, write_kv
from kvlab.attention_metadata import CommonAttentionMetadata
from kvlab.config import EngineConfig
from kvlab.kv_cache import allocate_kv_cache
from kvlab.kv_quant import (KV_CACHE_DTYPES, QuantizedKVCache, dequantize, get_kv_cache_dtype,
                            hadamard_rotation, quantize)

QUANTIZED = ["bfloat16", "fp8", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head",
             "int4_per_token_head"]


# ---------------------------------------------------------------- model-free


@pytest.mark.parametrize("name, stored_bytes, scale_bytes", [
    ("auto", 4 * 64, 0), ("float16", 2 * 64, 0), ("bfloat16", 2 * 64, 0), ("fp8", 64, 0),
    ("fp8_e5m2", 64, 0), ("fp8_per_token_head", 64, 4), ("int8_per_token_head", 64, 4),
    ("int4_per_token_head", 32, 4),  # two values a byte
])
def test_bytes_per_token_count_values_and_scales(name, stored_bytes, scale_bytes):
    spec = get_kv_cache_dtype(name)
    # SmolLM2-135M: 30 layers x 3 KV heads, K and V, head_dim 64, fp32 weights.
    assert spec.bytes_per_token(30, 3, 64, torch.float32) == 30 * 3 * 2 * (
        stored_bytes + scale_bytes)
    cache = allocate_kv_cache(30, 4, 16, 3, 64, torch.float32, torch.device("cpu"), name)
    # The pool's bytes are exactly what the token count says: 4 blocks x 16 slots.
    assert cache.nbytes == 4 * 16 * spec.bytes_per_token(30, 3, 64, torch.float32)
    assert isinstance(cache, torch.Tensor) == (name == "auto")  # auto: the plain pool, as before


def test_fp8_is_an_alias_and_unknown_names_list_the_supported_ones(monkeypatch):
    assert get_kv_cache_dtype("fp8") == get_kv_cache_dtype("fp8_e4m3")
    with pytest.raises(ValueError, match="choose one of.*int4_per_token_head"):
        get_kv_cache_dtype("int4")
    monkeypatch.delattr(torch, "float8_e5m2")  # a torch build without it
    with pytest.raises(ValueError, match="float8_e5m2, which this torch build"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    EngineConfig(kv_cache_dtype="int8_per_token_head")  # the others still stand


@pytest.mark.parametrize("name", [n for n in KV_CACHE_DTYPES if n != "auto"])
def test_round_trip_error_is_bounded_by_the_format(name):
    spec = get_kv_cache_dtype(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((40, 3, 64), generator=gen) * 3
    x[:, :, 5] *= 10  # an outlier channel, as RoPE'd keys have
    storage = spec.storage_dtype(torch.float32)
    rot = hadamard_rotation(64, "cpu") if spec.values_per_byte == 2 else None
    stored, scales = quantize(spec, x, storage, rot)
    assert stored.shape == (40, 3, 64 // spec.values_per_byte) and stored.dtype == storage
    y = dequantize(spec, stored, scales, torch.float32, rot)
    err = (y - x).abs().amax(-1)  # (token, head)
    absmax = x.abs().amax(-1)
    if name == "int8_per_token_head":
        assert (err <= absmax / 127 / 2 * 1.0001).all()  # half a step of absmax / 127
    elif name == "int4_per_token_head":
        # Half a step of the rotated vector's range / 15 in every rotated channel; rotating
        # back can add up the channels' errors at most by sqrt(64).
        r = x @ rot
        step = (r.amax(-1) - r.amin(-1)) / 15
        assert (err <= step / 2 * 8 * 1.001).all()
        assert 0 < float((y - x).norm() / x.norm()) < 0.15
    else:  # float formats: a relative error of their mantissa (or a per-head scale's)
        rel = {"float16": 2**-11, "bfloat16": 2**-8, "fp8_e4m3": 2**-4, "fp8": 2**-4,
               "fp8_e5m2": 2**-3, "fp8_per_token_head": 2**-4}[name]
        assert ((y - x).abs() <= x.abs() * rel + 1e-3 * absmax[..., None]).all()
    assert (y != x).any()  # it is a lossy format: measured, never assumed equal


def test_int4_hides_the_zero_point_in_the_scale():
    spec = get_kv_cache_dtype("int4_per_token_head")
    rot = hadamard_rotation(64, "cpu")
    assert torch.allclose(rot @ rot.T, torch.eye(64), atol=1e-6)  # orthonormal
    x = torch.randn((8, 3, 64)) + 2.0  # all positive-ish: the zero point is not 8
    stored, scales = quantize(spec, x, torch.uint8, rot)
    zero = scales.view(torch.int32) & 15
    assert scales.dtype == torch.float32 and (zero >= 0).all() and (zero <= 15).all()
    lo = (x @ rot).amin(-1)
    true_scale = ((x @ rot).amax(-1) - lo) / 15
    assert torch.allclose(scales, true_scale, rtol=2**-18)  # the bits cost almost nothing
    assert torch.equal(zero.float(), torch.trunc(-lo / true_scale + 0.5).clamp(0, 15))


def pool_and_plain(name: str, num_blocks=12, block_size=4, heads=3, dim=64):
    """A quantized pool with K/V written into random slots, and the plain pool holding the
    same values dequantized."""
    gen = torch.Generator().manual_seed(1)
    cache = allocate_kv_cache(1, num_blocks, block_size, heads, dim, torch.float32,
                              torch.device("cpu"), name)
    slots = torch.randperm(num_blocks * block_size, generator=gen)
    k, v = (torch.randn((len(slots), heads, dim), generator=gen) for _ in range(2))
    write_kv(cache[0], k, v, slots)
    k_all, v_all = cache[0].gather(torch.arange(num_blocks))
    return cache, torch.stack((k_all, v_all))[None], k, v, slots  # plain: (1, 2, nb, bs, H, D)


def test_copied_blocks_take_their_scales_with_them():
    from kvlab.model_runner import ModelRunner

    cache, plain, *_ = pool_and_plain("int8_per_token_head")
    runner = ModelRunner.__new__(ModelRunner)  # only copy_blocks is used: no model needed
    runner.kv_cache, runner.device = cache, torch.device("cpu")
    before = cache.scales.clone()
    runner.copy_blocks([(2, 7), (5, 0)])
    assert torch.equal(cache.scales[:, :, 7], before[:, :, 2])
    assert torch.equal(cache.scales[:, :, 0], before[:, :, 5])
    k7, v7 = cache[0].gather(torch.tensor([7]))
    assert torch.equal(k7[0], plain[0, 0, 2]) and torch.equal(v7[0], plain[0, 1, 2])


@pytest.mark.parametrize("backend", ["reference", "auto", "flex"])
@pytest.mark.parametrize("name", ["fp8", "int8_per_token_head", "int4_per_token_head"])
def test_every_backend_reads_the_dequantized_values(backend, name):
    """A step of two decodes and a prefill chunk over a quantized layer gives the same output
    as over a plain pool holding the same values dequantized: each backend dequantizes what it
    reads, and nothing else changes."""
    cache, plain, *_ = pool_and_plain(name)
    tables = [[3, 8, 1], [0, 11], [6, 2, 9, 4]]
    seq_lens, new = [11, 6, 15], [1, 1, 5]
    starts = [0, 1, 2, 7]
    common = CommonAttentionMetadata(
        slot_mapping=torch.zeros(7, dtype=torch.long), query_start_loc=starts,
        seq_lens=seq_lens, block_table_ids=tables, block_size=4, num_blocks=12,
        device=torch.device("cpu"), layer_kv_bytes_per_token=2 * 3 * 64 * 4)
    q = torch.randn((7, 9, 64), generator=torch.Generator().manual_seed(2))
    outs = []
    for layer in (cache[0], plain[0]):
        b = get_attention_backend(backend, enforce_eager=True)
        outs.append(b.forward(q, layer, b.build(common), 0.125))
    assert torch.allclose(outs[0], outs[1], atol=1e-6), (outs[0] - outs[1]).abs().max()


def test_quantized_cache_on_the_meta_device_has_the_logical_shape():
    cache = allocate_kv_cache(2, 5, 16, 3, 64, torch.bfloat16, torch.device("meta"),
                              "int4_per_token_head")
    assert isinstance(cache, QuantizedKVCache)
    assert cache.shape == (2, 2, 5, 16, 3, 64) and cache.dtype == torch.bfloat16
    assert cache.data.shape[-1] == 32 and cache.scales.shape == (2, 2, 5, 16, 3)


# ---------------------------------------------------------------- on the real model
LLMBase = LLM


@pytest.mark.parametrize("name, dtype, allowed", [
    ("bfloat16", "float32", "`auto`."), ("float16", "bfloat16", "`auto` or `bfloat16`.")])
def test_a_float_kv_dtype_unlike_the_models_is_refused_as_vllm_refuses_it(name, dtype, allowed):
    """vLLM stores float K/V only in the model's dtype (VllmConfig._reject_mismatched_float_kv_cache,
    vllm/config/vllm.py): refused before any pool is allocated, with vLLM's words."""
    with pytest.raises(ValueError, match=f'kv_cache_dtype="{name}" is incompatible with '
                                         f'dtype="{dtype}".*{allowed}'):
        LLM(dtype=dtype, kv_cache_dtype=name, kv_cache_tokens=256, max_model_len=64)


def test_the_same_bytes_hold_more_tokens_at_lower_precision():
    budget = 16 * 2**20
    rows = {}
    # (model dtype, KV dtype): vLLM stores float K/V only in the model's own dtype, so bf16 KV
    # comes with a bf16 model.
    for dtype, name in (("float32", "auto"), ("bfloat16", "bfloat16"),
                        ("float32", "int8_per_token_head"), ("float32", "int4_per_token_head")):
        s = LLM(dtype=dtype, kv_cache_dtype=name, kv_cache_memory_bytes=budget,
                max_model_len=128).stats()
        block_bytes = s["kv_bytes_per_token"] * s["block_size"]
        assert s["num_blocks"] == budget // block_bytes  # whole blocks, as vLLM
        assert s["kv_cache_bytes"] == s["num_blocks"] * block_bytes <= budget
        assert s["kv_capacity_tokens"] == (s["num_blocks"] - 1) * s["block_size"]  # null block
        assert s["kv_cache_dtype"] == name
        rows[name] = s["kv_capacity_tokens"]
    assert rows["auto"] < rows["bfloat16"] < rows["int8_per_token_head"] < rows[
        "int4_per_token_head"]
    assert rows["int4_per_token_head"] >= 7 * rows["auto"]  # 46,080 -> 6,480 bytes a token


# fp32 itself is not bit-identical across chunkings or batches here (oneDNN sums a chunk's rows
# in another order: K/V differ in the last bits, up to ~2e-5), and a quantized cache turns such a
# difference into a whole quantization step wherever a value sits on a rounding boundary; each
# step changes the next layer's inputs, so the flips multiply layer by layer (measured here,
# 30 prompt tokens chunked by 8 against one chunk: ~4% of fp8_e5m2's and ~11% of fp8_e4m3's stored
# values differ, by one or two steps). Two runs that must agree are therefore compared as vLLM
# compares its own fp8 KV cache runs (check_logprobs_close in vLLM's tests/models/utils.py, used by
# tests/models/quantization/test_fp8.py): token for token up to their first difference, where
# each run's token must be among the other's top logprobs.
TOP = 5
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=TOP)


def outputs(llm, prompts, params=GREEDY):
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def assert_logprobs_close(plain, other):
    """plain, other: CompletionOutputs of the same prompts. Returns how many differed."""
    differed = 0
    for a, b in zip(plain, other):
        at = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if at is None:
            continue
        differed += 1
        assert len(a.logprobs[at]) == len(b.logprobs[at]) == TOP
        assert b.token_ids[at] in a.logprobs[at], (at, a.token_ids, b.token_ids, a.logprobs[at])
        assert a.token_ids[at] in b.logprobs[at], (at, a.token_ids, b.token_ids, b.logprobs[at])
    return differed


@pytest.mark.parametrize("name", QUANTIZED)
def test_cached_chunked_and_preempted_equal_the_plain_run_at_each_precision(name, text_ids):
    # Two 30-token prompts sharing their first 16 tokens (one full block, bs 16).
    prompts = [{"prompt_token_ids": text_ids[:16] + text_ids[40 + 20 * i : 54 + 20 * i]}
               for i in range(2)]
    # bf16 K/V only on a bf16 model (vLLM refuses a float KV dtype unlike the model's); the
    # plain run is then the bf16 model's.
    LLM = functools.partial(LLMBase, dtype="bfloat16") if name == "bfloat16" else LLMBase
    plain = outputs(LLM(kv_cache_dtype=name, max_model_len=64, kv_cache_tokens=1024,
                        enable_prefix_caching=False), prompts)
    # Chunked: 8-token chunks, so every prompt is read back from the pool across steps.
    chunked = LLM(kv_cache_dtype=name, max_model_len=64, kv_cache_tokens=1024,
                  max_num_batched_tokens=8, enable_prefix_caching=False)
    assert_logprobs_close(plain, outputs(chunked, prompts))
    # Cached: cold, then warm (the shared first block hits). The hit holds exactly what the
    # cold run wrote; only the recomputed tail (in another batch) can differ, in the last bits.
    cached = LLM(kv_cache_dtype=name, max_model_len=64, kv_cache_tokens=1024,
                 enable_prefix_caching=True)
    cold = outputs(cached, prompts[:1])
    warm = cached.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in warm] == [16, 16]
    assert_logprobs_close(cold + plain[1:], [o.outputs[0] for o in warm])
    # Preempted: 4 blocks for two 2-block prompts that each grow into a third block.
    block_bytes = cached.stats()["kv_bytes_per_token"] * 16
    tight = LLM(kv_cache_dtype=name, max_model_len=48, kv_cache_memory_bytes=5 * block_bytes,
                enable_prefix_caching=False)
    assert tight.stats()["num_blocks"] == 5  # 4 usable: block 0 is the null block
    assert_logprobs_close(plain, outputs(tight, prompts))
    assert tight.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("name", ["int8_per_token_head", "int4_per_token_head"])
def test_forked_samples_copy_scales_on_write_and_equal_unforked_runs(name, text_ids):
    """n=2 forks the prompt's blocks, the partly filled last one included; the first write into
    it copies the block (values and scales) first. Each sample equals its seed run alone."""
    llm = LLM(kv_cache_dtype=name, max_model_len=64, kv_cache_tokens=512,
              parallel_sampling="fork")
    prompt = {"prompt_token_ids": text_ids[:21]}  # 16 + 5: a partial last block
    sp = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    out = llm.generate(prompt, sp)[0]
    assert llm.stats()["num_cow_copies"] >= 1
    alone = [outputs(llm, [prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=3 + i,
                                                   ignore_eos=True))[0].token_ids
             for i in range(2)]
    assert [o.token_ids for o in out.outputs] == alone
    assert llm.stats()["num_used_blocks"] == 0

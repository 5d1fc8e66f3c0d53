"""Greedy kvlab output equals transformers `generate` on the same weights, whatever the knobs."""

from __future__ import annotations

import pytest
from tests.helpers import assert_no_blocks_held

from kvlab import LLM, SamplingParams

N_NEW = 16
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)


def lengths_for(block_size: int) -> list[int]:
    """The block-boundary cases: 1, block_size - 1, block_size, block_size + 1, and a long one."""
    return sorted({1, max(1, block_size - 1), block_size, block_size + 1, 300})


@pytest.mark.parametrize("kv_layout", ["paged", "contiguous"])
@pytest.mark.parametrize("block_size", [1, 2, 16, 64])
def test_greedy_matches_transformers(block_size, kv_layout, text_ids, hf_greedy):
    # All boundary lengths in one batch: mixed prefill lengths share the steps.
    prompts = [text_ids[:n] for n in lengths_for(block_size)]
    llm = LLM(block_size=block_size, kv_layout=kv_layout, max_model_len=512,
              kv_cache_tokens=4096)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(prompt, N_NEW), f"prompt length {len(prompt)}"
        assert out.outputs[0].finish_reason == "length"
    assert_no_blocks_held(llm)


@pytest.mark.slow
def test_paged_equals_contiguous_equals_reference_and_flex_attention(text_ids):
    prompts = [{"prompt_token_ids": text_ids[i : i + 20 + 9 * i]} for i in range(6)]
    results = []
    for layout, backend in [("paged", "auto"), ("contiguous", "auto"), ("paged", "reference"),
                            ("paged", "flex")]:
        llm = LLM(block_size=8, kv_layout=layout, backend=backend, max_model_len=256,
                  kv_cache_tokens=2048)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
        assert_no_blocks_held(llm)
    assert results[0] == results[1] == results[2] == results[3]


@pytest.mark.slow
def test_flex_attention_with_chunks_prefix_hits_and_preemption(text_ids, hf_greedy):
    """The GPU path's mask (block tables -> which pool slots each token sees) on a CPU, eagerly:
    chunked prompts, shared cached blocks and recomputed preempted requests all go through it."""
    system = text_ids[:48]
    prompts = [system + text_ids[60 + 7 * i : 60 + 7 * i + 10 + 5 * i] for i in range(4)]
    llm = LLM(backend="flex", block_size=8, max_model_len=128, kv_cache_tokens=136,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    for _ in range(2):  # the second pass hits the cached system prompt
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(p, N_NEW)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert_no_blocks_held(llm)


def test_chunked_prefill_and_static_scheduling_give_the_same_tokens(text_ids, hf_greedy):
    prompt = text_ids[:300]
    for kwargs in (
        dict(max_num_batched_tokens=64),  # the prompt takes five steps
        dict(max_num_batched_tokens=512, enable_chunked_prefill=False),
        dict(scheduling="static", max_num_seqs=2),
    ):
        llm = LLM(block_size=16, max_model_len=512, kv_cache_tokens=2048, **kwargs)
        outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": text_ids[:40]}] * 2,
                            GREEDY)
        assert outs[0].outputs[0].token_ids == hf_greedy(prompt, N_NEW), kwargs
        assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert outs[1].outputs[0].token_ids == hf_greedy(text_ids[:40], N_NEW), kwargs
        assert_no_blocks_held(llm)


def test_preemption_under_a_tiny_kv_budget_keeps_outputs_exact(text_ids, hf_greedy):
    prompts = [text_ids[i : i + 30] for i in range(0, 48, 8)]
    llm = LLM(block_size=4, max_model_len=64, kv_cache_tokens=128)  # 6 x 46 tokens cannot fit
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(p, N_NEW)
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("backend, tolerance", [("reference", 5e-4), ("auto", 1e-3),
                                                ("flex", 1e-3)])
def test_logits_match_transformers_within_tolerance(loaded, text_ids, backend, tolerance):
    """Token equality rests on this: kvlab's logits equal transformers' up to float summation
    order. The reference backend runs transformers' own matmul calls; "auto" packs weights for
    oneDNN, which sums in another order; "flex" attends through FlexAttention. Logits here
    reach ~40; measured differences are under 1e-4 for all three: `tolerance` leaves room for
    other CPUs."""
    import torch

    from kvlab.attention import get_attention_backend
    from kvlab.attention_metadata import CommonAttentionMetadata
    from kvlab.model import Transformer

    prompt = text_ids[:40]
    with torch.inference_mode():
        ref = loaded.hf_model(torch.tensor([prompt])).logits[0].float()  # (T, V)
    model = Transformer(loaded, fast=backend != "reference",
                        attn_backend=get_attention_backend(backend))
    kv = torch.zeros((model.num_layers, 2, 4, 16, model.num_kv_heads, model.head_dim))
    # Blocks out of order, with an unused one in the pool: the mask must follow the table.
    table = torch.tensor([2, 0, 3])
    meta = model.attn_backend.build(CommonAttentionMetadata(
        slot_mapping=(table[:, None] * 16 + torch.arange(16)).flatten()[:40],
        query_start_loc=[0, 40], seq_lens=[40], block_table_ids=[[2, 0, 3]], block_size=16,
        num_blocks=4, device=torch.device("cpu")))
    hidden = model.forward(torch.tensor(prompt), torch.arange(40), kv, meta)
    ours = model.compute_logits(hidden)
    diff = (ours - ref).abs().max().item()
    assert diff < tolerance, diff
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

"""The batched decode path of the default backend: the same attention as the reference,
and the same tokens as transformers, whatever the lengths, block sizes, groups and steps."""

from __future__ import annotations

import random

import pytest
import torch
from tests.helpers import assert_no_blocks_held

from kvlab import LLM, SamplingParams, attention
from kvlab.attention import ReferenceBackend, SDPABackend
from kvlab.attention_metadata import CommonAttentionMetadata

N_NEW = 16
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)


def random_step(rng: random.Random, block_size: int, num_new: list[int], seq_lens: list[int],
                num_heads=6, num_kv_heads=2, head_dim=8, shared_prefix_blocks=1):
    """A pool with random K/V, block tables scattered over it (the first blocks shared by every
    sequence, as a prefix-cache hit shares them), and random queries for each new token."""
    tables, used = [], set()
    free = list(range(1, 1000))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_prefix_blocks)]
    for n in seq_lens:
        need = -(-n // block_size)
        own = [free.pop() for _ in range(max(0, need - len(shared)))]
        table = (shared + own)[:need]
        tables.append(table)
        used.update(table)
    num_blocks = max(used) + 2  # one unused block at the end
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for k in num_new:
        starts.append(starts[-1] + k)
    common = CommonAttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=starts,
        seq_lens=seq_lens, block_table_ids=tables, block_size=block_size, num_blocks=num_blocks,
        device=torch.device("cpu"), layer_kv_bytes_per_token=2 * num_kv_heads * head_dim * 4)
    q = torch.randn(starts[-1], num_heads, head_dim)
    return q, kv, common


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("group_bytes", [attention.DECODE_GROUP_BYTES, 1])
def test_batched_decode_equals_reference(block_size, group_bytes, monkeypatch):
    """Mixed lengths (1 token, block boundaries, long), decodes mixed with prefill chunks in one
    step (decodes not first), and copy groups down to one sequence each."""
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", group_bytes)
    rng = random.Random(block_size)
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 150, 37]
    for num_new in ([1] * len(lens), [1, 1, 5, 1, 7, 1], [3, 1, 1, 1, 1, 1]):
        seq_lens = [max(n, k) for n, k in zip(lens, num_new)]
        q, kv, common = random_step(rng, block_size, num_new, seq_lens)
        ref = ReferenceBackend()
        fast = SDPABackend()
        expected = ref.forward(q, kv, ref.build(common), 0.3)
        meta = fast.build(common)
        assert meta.decode is not None and meta.decode.num_seqs == num_new.count(1)
        if group_bytes == 1:
            assert len(meta.decode.groups) == meta.decode.num_seqs
        got = fast.forward(q, kv, meta, 0.3)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_step_with_no_decode_takes_the_reference_path():
    q, kv, common = random_step(random.Random(0), 16, [5, 9], [5, 30])
    meta = SDPABackend().build(common)
    assert meta.decode is None and meta.per_seq == [0, 1]
    ref = ReferenceBackend()
    torch.testing.assert_close(SDPABackend().forward(q, kv, meta, 0.5),
                               ref.forward(q, kv, ref.build(common), 0.5))


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_mixed_steps_give_transformers_tokens(block_size, text_ids, hf_greedy):
    """Mixed prompt lengths under a small token budget: decodes share steps with other prompts'
    chunks, so the batched decode path runs beside the one-at-a-time prefill path."""
    prompts = [text_ids[i : i + n] for i, n in enumerate([3, 17, 40, 64, 90, 130])]
    llm = LLM(block_size=block_size, max_model_len=256, kv_cache_tokens=2048,
              max_num_batched_tokens=48)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    mixed = [r for r in llm.llm_engine.step_trace
             if r.num_decode_tokens > 1 and r.num_prefill_tokens > 0]
    assert mixed, "no step held decodes and a prefill chunk together"
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(p, N_NEW), f"prompt length {len(p)}"
    assert_no_blocks_held(llm)


@pytest.mark.slow
def test_preemption_and_small_copy_groups_keep_tokens(text_ids, hf_greedy, monkeypatch):
    """Recomputed (preempted) requests and one copy group per sequence: the same tokens."""
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 1)
    prompts = [text_ids[i : i + 30 + i // 2] for i in range(0, 48, 8)]  # 30 to 50 tokens
    llm = LLM(block_size=4, max_model_len=96, kv_cache_tokens=160)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(p, N_NEW)
    assert_no_blocks_held(llm)

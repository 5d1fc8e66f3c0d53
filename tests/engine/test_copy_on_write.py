"""Fork and copy-on-write: parallel sampling and beam search share blocks and change no token."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import assert_no_blocks_held, llm_fixture

from kvlab import LLM, BeamSearchParams, SamplingParams
from kvlab.kv_cache import KVCacheManager


def test_fork_shares_every_block_and_cow_copies_the_partial_one():
    m = KVCacheManager(num_blocks=8, block_size=4, max_model_len=32)
    assert m.allocate_slots("p", 6)  # blocks [1, 2] (0 is the null block), the second half full
    assert m.fork("p", "c")
    pool = m.block_pool
    assert m.get_block_ids("c") == m.get_block_ids("p") == [1, 2]
    assert [b.ref_cnt for b in pool.blocks[1:3]] == [2, 2]
    # The child writes token 6 into block 2, still shared: it gets its own copy first.
    assert m.allocate_slots("c", 7, num_computed_tokens=6)
    assert m.get_block_ids("c") == [1, 3] and m.take_pending_copies() == [(2, 3)]
    assert [b.ref_cnt for b in pool.blocks[1:4]] == [2, 1, 1]
    # The parent is now the only owner of block 2: it writes in place, no copy.
    assert m.allocate_slots("p", 7, num_computed_tokens=6)
    assert m.get_block_ids("p") == [1, 2] and m.take_pending_copies() == []
    assert m.num_cow_copies == 1
    m.free("p")
    assert pool.blocks[1].ref_cnt == 1 and pool.blocks[2].ref_cnt == 0
    m.free("c")
    assert pool.get_num_free_blocks() == 7
    pool.check_invariants()


def test_cow_needs_a_free_block_and_takes_nothing_without_one():
    m = KVCacheManager(num_blocks=3, block_size=4, max_model_len=8)  # null block + 2
    assert m.allocate_slots("p", 6) and m.fork("p", "c")
    assert not m.allocate_slots("c", 7, num_computed_tokens=6)  # a copy needs a block: none
    assert m.get_block_ids("c") == [1, 2] and m.num_cow_copies == 0
    m.block_pool.check_invariants()


# The paper's fork, chosen by name (vLLM v1's default for n > 1 is child requests).
llm = llm_fixture(block_size=8, max_model_len=256, kv_cache_tokens=2048, parallel_sampling="fork")


def test_parallel_samples_share_the_prompt_and_equal_unshared_runs(llm, text_ids):
    prompt = {"prompt_token_ids": text_ids[:61]}  # 61 tokens: the last block is partly full
    sp = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7)
    shared = llm.generate(prompt, sp)[0]
    peak_shared = llm.stats()["peak_blocks_used"]
    assert llm.stats()["num_cow_copies"] >= 3  # three samples copied the shared last block
    assert [o.index for o in shared.outputs] == [0, 1, 2, 3]
    # Sample i draws from seed + i: run each alone, no sharing, in a fresh engine.
    alone = LLM(block_size=8, max_model_len=256, kv_cache_tokens=2048)
    for i, out in enumerate(shared.outputs):
        solo = alone.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i))
        assert out.token_ids == solo[0].outputs[0].token_ids, f"sample {i}"
    # Reproducible: the same call again gives the same samples.
    again = llm.generate(prompt, sp)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in shared.outputs]
    # Four unshared copies of a 61 + 10 token sequence need 4 x 9 blocks; shared needs fewer.
    assert peak_shared < 4 * 9
    assert_no_blocks_held(llm)
    assert_no_blocks_held(alone)


def test_greedy_samples_are_identical_and_contiguous_forks_by_copying(text_ids, hf_greedy):
    prompt = {"prompt_token_ids": text_ids[:30]}
    for layout in ("paged", "contiguous"):
        llm = LLM(block_size=8, kv_layout=layout, max_model_len=64, kv_cache_tokens=256,
                  parallel_sampling="fork")
        out = llm.generate(prompt, SamplingParams(n=3, max_tokens=12, temperature=0,
                                                  ignore_eos=True))[0]
        ref = hf_greedy(text_ids[:30], 12)
        assert all(o.token_ids == ref for o in out.outputs), layout
        assert_no_blocks_held(llm)


@pytest.mark.slow
@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_equals_transformers(llm, loaded, beam_width):
    tok = loaded.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a color."}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    cases = [  # (prompt ids, ignore_eos, length_penalty); the chat prompt ends with EOS early
        (tok("The best way to learn a language is").input_ids, True, 1.0),
        (tok("def add(a, b):").input_ids, False, 0.5),
        (list(chat), False, 1.0),
    ]
    for ids, ignore_eos, lp in cases:
        out = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(
            beam_width=beam_width, max_tokens=16, ignore_eos=ignore_eos, length_penalty=lp))[0]
        kw = dict(min_new_tokens=16) if ignore_eos else {}
        with torch.inference_mode():
            ref = loaded.hf_model.generate(
                torch.tensor([ids]), num_beams=beam_width, max_new_tokens=16, do_sample=False,
                length_penalty=lp, pad_token_id=tok.eos_token_id, **kw)[0].tolist()
        assert out.sequences[0].tokens == ref
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True) and len(scores) == beam_width
        assert_no_blocks_held(llm)
    assert llm.stats()["num_cow_copies"] > 0


@pytest.mark.slow
def test_beam_search_bad_input_and_exhaustion(text_ids):
    small = LLM(block_size=4, max_model_len=64, kv_cache_tokens=64)  # 16 usable blocks
    prompt = {"prompt_token_ids": text_ids[:20]}
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        small.beam_search(prompt, SamplingParams())
    with pytest.raises(ValueError, match="needs at least"):
        small.beam_search(prompt, BeamSearchParams(beam_width=12, max_tokens=4))
    assert_no_blocks_held(small)
    # Fits at the start, not once the beams diverge: beams are preempted and recomputed like
    # any request (an idle beam gives way to the one its search waits for), and the result is
    # the roomy pool's.
    bp = BeamSearchParams(beam_width=8, max_tokens=16, ignore_eos=True)
    got = small.beam_search(prompt, bp)[0].sequences
    assert small.stats()["num_preemptions"] > 0
    roomy = LLM(block_size=4, max_model_len=64, kv_cache_tokens=1024)
    assert [s.tokens for s in got] == [s.tokens for s in roomy.beam_search(prompt, bp)[0].sequences]
    assert_no_blocks_held(small)
    assert small.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4))[0].sequences


def test_samples_under_memory_pressure_are_preempted_not_changed(text_ids):
    prompt = {"prompt_token_ids": text_ids[:30]}
    sp = SamplingParams(n=4, max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    roomy = LLM(block_size=4, max_model_len=64, kv_cache_tokens=1024).generate(prompt, sp)[0]
    tight = LLM(block_size=4, max_model_len=64, kv_cache_tokens=72,  # 18 blocks for 4 x 14
                parallel_sampling="fork")
    out = tight.generate(prompt, sp)[0]
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in roomy.outputs]
    assert_no_blocks_held(tight)


def test_vllm_v1_child_requests_share_full_blocks_through_the_prefix_cache():
    """parallel_sampling="child_requests" (vLLM v1): n requests, full prompt blocks shared
    through the prefix cache in the same step, the partial last block computed by each; the
    samples equal the fork's and the unshared run's, token for token."""
    from kvlab.bench.cow import parallel_sampling_table

    rows = {r["mode"]: r for r in parallel_sampling_table(prompt_lens=(40,), ns=(3,),
                                                          max_tokens=6, block_size=16,
                                                          progress=False)}
    fork, v1, unshared = rows.values()
    assert all(r["identical_to_unshared"] and r["leaked_blocks"] == 0 for r in rows.values())
    assert fork["prompt_tokens_computed"] == 40  # the prompt once
    assert v1["prompt_tokens_computed"] == 40 + 2 * 8  # + each child's partial last block
    assert unshared["prompt_tokens_computed"] == 3 * 40
    assert fork["peak_blocks"] <= v1["peak_blocks"] < unshared["peak_blocks"]
    with pytest.raises(ValueError, match="parallel_sampling"):
        LLM(parallel_sampling="fan_out")


def test_mean_shape_savings_average_the_blocks_held_over_the_run():
    """Chapter 02's like-for-like rows: the saving is over the blocks held on average, which for
    one fork group is countable by hand, and sharing never changes a sample."""
    from kvlab.bench.cow import mean_shape_savings

    rows = mean_shape_savings({"tiny": (17, 15)}, ns=(2, 3), block_size=16)
    assert [r["n"] for r in rows] == [2, 3]
    for r in rows:
        n = r["n"]
        assert r["identical_outputs"] and r["leaked_blocks"] == 0
        # 17 prompt tokens: one full block and one partial. Fork holds both once after the
        # prefill, then the shared full block plus each sample's own copy of the partial one
        # (13 more steps hold blocks; the 15th frees them). Unshared, every sample holds two.
        assert r["mean_blocks_shared"] == round((2 + 13 * (1 + n)) / 14, 1)
        assert r["mean_blocks_unshared"] == 2 * n
        assert r["mean_saved"] == round(1 - (2 + 13 * (1 + n)) / (14 * 2 * n), 3)
        assert r["peak_saved"] == round(1 - (1 + n) / (2 * n), 3)
    assert rows[1]["mean_saved"] > rows[0]["mean_saved"]

"""Prefix caching: the hash chain, salts, eviction order, and outputs equal to cold runs."""

from __future__ import annotations

import pytest
from tests.helpers import assert_no_blocks_held
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import LLM, SamplingParams
from kvlab.kv_cache import KVCacheManager
from kvlab.prefix_cache import hash_block_tokens
from kvlab.request import Request
from tests import helpers

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_hash_chain_properties():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic (not Python's hash)
    assert len(a) == 32  # sha256
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert a != hash_block_tokens(None, [1, 2, 3, 4], (("cache_salt", "t"),))
    # The chain: same block tokens under different parents are different keys.
    assert hash_block_tokens(a, [9, 9]) != hash_block_tokens(None, [9, 9])
    # Canonical encoding: no ambiguity between token boundaries or salt strings.
    assert hash_block_tokens(None, [12, 3]) != hash_block_tokens(None, [1, 23])
    assert hash_block_tokens(None, [1], (("cache_salt", "ab"),)) != \
        hash_block_tokens(None, [1], (("cache_salt", "a"), ("b", "")))
    assert len(hash_block_tokens(None, [1], algo="sha512")) == 64


def make_request(rid, tokens, salt=None):
    return helpers.make_request(rid, tokens, cache_salt=salt)


def admit(m: KVCacheManager, req: Request) -> int:
    """What the scheduler does on admission; returns the tokens found in the cache."""
    hits, num_hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req.request_id, req.num_tokens, num_hit, hits)
    req.num_computed_tokens = req.num_tokens
    m.cache_blocks(req)
    return num_hit


def test_lookup_hits_full_blocks_only_and_never_the_last_token():
    m = KVCacheManager(16, 4, 64, enable_prefix_caching=True)
    first = make_request("a", range(10))  # blocks [0-3], [4-7], [8, 9]: two are full
    assert admit(m, first) == 0
    m.free("a")
    # Shares 9 tokens: the prefix ends mid-block, so only the first two blocks match.
    assert admit(m, make_request("b", [*range(9), 99])) == 8
    # Exactly 8 tokens, both blocks cached: one block is recomputed for the last token's logits.
    assert admit(m, make_request("c", range(8))) == 4
    m.block_pool.check_invariants()


def test_freed_blocks_keep_their_keys_and_evict_tail_first():
    m = KVCacheManager(5, 2, 16, enable_prefix_caching=True)  # block 0 + 4
    req = make_request("a", range(8))  # four full blocks (1-4): the whole pool
    admit(m, req)
    m.free("a")
    pool = m.block_pool
    # Freed last block first: the head of the queue (evicted first) is the request's tail.
    assert list(pool.free_queue) == [4, 3, 2, 1]
    assert len(pool.cached_block_hash_to_block) == 4
    (taken,) = pool.get_new_blocks(1)  # reuse evicts the head, and drops its key
    assert taken.block_id == 4 and taken.block_hash is None
    assert len(pool.cached_block_hash_to_block) == 3
    pool.free_blocks([taken])
    assert admit(m, make_request("b", range(8))) == 6  # blocks 1-3 still there
    pool.check_invariants()


def test_hits_are_taken_before_new_blocks_are_popped():
    # 3 usable blocks (and block 0). "a" fills and frees two cached blocks; they are the only
    # free ones besides one.
    m = KVCacheManager(4, 2, 16, enable_prefix_caching=True)
    admit(m, make_request("a", [1, 2, 3, 4]))
    m.free("a")
    pool = m.block_pool
    # "b" hits both cached blocks and needs one new block: the hits must not be the ones popped.
    b = make_request("b", [1, 2, 3, 4, 5])
    assert admit(m, b) == 4
    assert sorted(m.get_block_ids("b")[:2]) == [1, 2] and all(
        pool.blocks[i].block_hash is not None for i in (1, 2))
    # A request whose hits leave too few free blocks is refused, taking nothing.
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7, 8])
    hits, n = m.get_computed_blocks(c)
    assert n == 4 and not m.allocate_slots("c", 8, 4, hits)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    pool.check_invariants()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from([None, "a", "b"]),  # salt
                              st.integers(0, 3),  # which shared prefix
                              st.integers(1, 12),  # length
                              st.booleans()),  # free it at once?
                    min_size=1, max_size=40),
       block_size=st.sampled_from([1, 2, 4]))
def test_no_cross_salt_hit_and_hits_hold_the_same_tokens(ops, block_size):
    m = KVCacheManager(12, block_size, 64, enable_prefix_caching=True)
    # What each keyed block holds: block id -> (its key, salt, every token up to its end).
    content: dict[int, tuple] = {}
    live = []
    for i, (salt, prefix, length, free_now) in enumerate(ops):
        tokens = [prefix] * 3 + list(range(length))
        req = make_request(f"r{i}", tokens, salt)
        hits, num_hit = m.get_computed_blocks(req)
        if not m.allocate_slots(req.request_id, req.num_tokens, num_hit, hits):
            for rid in live:  # make room, as finishing requests would
                m.free(rid)
            live.clear()
            hits, num_hit = m.get_computed_blocks(req)
            if not m.allocate_slots(req.request_id, req.num_tokens, num_hit, hits):
                continue  # longer than the pool: the scheduler would never admit it
        for j, blk in enumerate(hits):
            assert content[blk.block_id] == (
                blk.block_hash, salt, tuple(tokens[: (j + 1) * block_size]))
        assert num_hit < req.num_tokens and num_hit % block_size == 0
        req.num_computed_tokens = req.num_tokens
        m.cache_blocks(req)
        for j, bid in enumerate(m.get_block_ids(req.request_id)):
            key = m.block_pool.blocks[bid].block_hash
            if key is not None and content.get(bid, (None,))[0] != key:
                content[bid] = (key, salt, tuple(tokens[: (j + 1) * block_size]))
        if free_now:
            m.free(req.request_id)
        else:
            live.append(req.request_id)
        m.block_pool.check_invariants()


@pytest.fixture(scope="module")
def cached_llm():
    return LLM(block_size=16, max_model_len=512, kv_cache_tokens=4096, enable_prefix_caching=True)


def test_cached_outputs_equal_cold_outputs(cached_llm, text_ids, hf_greedy):
    cold = LLM(block_size=16, max_model_len=512, kv_cache_tokens=4096)
    for start, plen in ((0, 100), (50, 64), (7, 33)):
        prefix = text_ids[start : start + plen]
        for tail in ([5, 6, 7], text_ids[300:317], [42]):
            prompt = {"prompt_token_ids": prefix + tail}
            warm = cached_llm.generate(prompt, GREEDY)[0]
            ref = cold.generate(prompt, GREEDY)[0]
            assert warm.outputs[0].token_ids == ref.outputs[0].token_ids
    assert cached_llm.stats()["prefix_cache_hits"] > 0
    # And both equal transformers on one of them.
    out = cached_llm.generate({"prompt_token_ids": text_ids[:100] + [42]}, GREEDY)[0]
    assert out.num_cached_tokens == 96
    assert out.outputs[0].token_ids == hf_greedy(text_ids[:100] + [42], 8)
    assert_no_blocks_held(cached_llm)


def test_cache_salt_table(text_ids):
    """The seed's table: salt a, a, b, b, none -> cached tokens 0, full, 0, full, 0."""
    llm = LLM(block_size=16, max_model_len=512, kv_cache_tokens=4096, enable_prefix_caching=True)
    doc = text_ids[:200]
    cached = []
    for salt in ("tenant-a", "tenant-a", "tenant-b", "tenant-b", None):
        prompt = {"prompt_token_ids": doc} if salt is None else \
            {"prompt_token_ids": doc, "cache_salt": salt}
        cached.append(llm.generate(prompt, GREEDY)[0].num_cached_tokens)
    assert cached == [0, 192, 0, 192, 0]
    s = llm.stats()
    assert s["prefix_cache_queries"] == 5 * 200 and s["prefix_cache_hits"] == 2 * 192
    assert s["prefix_cache_hit_rate"] == pytest.approx(384 / 1000)
    assert_no_blocks_held(llm)


def test_caching_off_finds_nothing(text_ids):
    llm = LLM(block_size=16, max_model_len=512, kv_cache_tokens=4096, enable_prefix_caching=False)
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": text_ids[:100]}, GREEDY)[0]
        assert out.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_queries"] == 0


def test_preempted_requests_reuse_their_own_cached_blocks(text_ids, hf_greedy):
    llm = LLM(block_size=4, max_model_len=64, kv_cache_tokens=128, enable_prefix_caching=True)
    prompts = [text_ids[i : i + 30] for i in range(0, 48, 8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert llm.stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(p, 16)
    assert_no_blocks_held(llm)


def test_the_engine_keys_a_requests_blocks_when_it_is_made_and_as_tokens_are_appended(text_ids):
    """vLLM's Request calls its block hasher when it is created and whenever a token is
    appended (vllm/v1/request.py; get_request_block_hasher in vllm/v1/core/kv_cache_utils.py):
    the keys of every full block exist before anyone asks the cache."""
    llm = LLM(block_size=8, max_model_len=128, kv_cache_tokens=512)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": text_ids[:20]},
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    request = engine.requests["r"]
    assert len(request.block_hashes) == 20 // 8  # the prompt's full blocks, before any step
    while engine.has_unfinished_requests():
        engine.step()
        assert len(request.block_hashes) == request.num_tokens // 8
    assert len(request.block_hashes) == 26 // 8  # a token appended filled the third block
    cold = LLM(block_size=8, max_model_len=128, kv_cache_tokens=512, enable_prefix_caching=False)
    cold.llm_engine.add_request("r", {"prompt_token_ids": text_ids[:20]},
                                SamplingParams(max_tokens=2))
    assert cold.llm_engine.requests["r"].block_hashes == []  # no cache, no keys

"""Sliding-window layers on the real model (chapter 09): the packaged weights with a window on
every other layer, as `hf_overrides` sets it, token for token against transformers' own
windowed model of the same weights; the window's blocks given back while a request runs; the
hybrid prefix hit and its sparse retention; vLLM's capacity figures; what is refused."""

from __future__ import annotations

import functools

import pytest
import torch
from tests.helpers import assert_no_blocks_held

from kvlab import LLM, SamplingParams
from kvlab.kv_cache_interface import FullAttentionSpec, cdiv
from kvlab.model import windowed_reference

WINDOW, BLOCK = 32, 8
TYPES = ["sliding_attention", "full_attention"] * 15  # the packaged model's 30 layers
OVERRIDES = {"layer_types": TYPES, "sliding_window": WINDOW}


def hybrid(**kwargs) -> LLM:
    args = dict(hf_overrides=OVERRIDES, block_size=BLOCK, kv_cache_tokens=1024,
                max_model_len=256, debug_checks=True)
    return LLM(**{**args, **kwargs})


@pytest.fixture(scope="module")
def reference(loaded):
    model = windowed_reference(loaded, OVERRIDES)

    @functools.lru_cache(maxsize=None)
    def run(prompt: tuple[int, ...], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return lambda prompt, n: run(tuple(prompt), n)


def prompts(text_ids, lengths):
    return [text_ids[i * 37: i * 37 + n] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_windowed_tokens_equal_transformers(text_ids, reference, backend):
    """Prompts longer than the window; chunked prefill in small chunks; prefix caching on."""
    llm = hybrid(backend=backend, max_num_batched_tokens=24)
    ps = prompts(text_ids, [90, 45, 120])
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == reference(p, 30)
    assert_no_blocks_held(llm)


def test_the_window_changes_the_tokens(text_ids, hf_greedy):
    """The weights were trained without a window: past it, the output is another one."""
    (p,) = prompts(text_ids, [90])
    out = hybrid().generate({"prompt_token_ids": p},
                            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids != hf_greedy(p, 20)


def test_preempted_and_cached_and_chunked_runs_equal_transformers(text_ids, reference):
    """A pool too small for the burst (preemptions), a shared prefix (hits), small chunks."""
    llm = hybrid(kv_cache_tokens=256, max_num_batched_tokens=32)
    shared = text_ids[:70]
    ps = [shared + text_ids[100 + 11 * i: 100 + 11 * i + 9] for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == reference(p, 40)
    assert_no_blocks_held(llm)


def test_seeded_sampling_is_the_same_whatever_the_knobs(text_ids):
    ps = prompts(text_ids, [80, 50])
    sp = SamplingParams(max_tokens=25, temperature=0.8, seed=7, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in ps], sp)]
        for llm in (hybrid(enable_prefix_caching=False), hybrid(max_num_batched_tokens=16),
                    hybrid(kv_cache_tokens=256, async_scheduling=False))]
    assert runs[0] == runs[1] == runs[2]


def test_window_blocks_are_given_back_while_the_request_runs(text_ids):
    """Step by step: the full-attention group holds every block; the window group gives back
    each block wholly before the next token's window, the null block taking its place."""
    llm = hybrid(enable_prefix_caching=False, async_scheduling=False)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    full = next(g for g, group in enumerate(kv.kv_cache_groups)
                if isinstance(group.spec, FullAttentionSpec))
    window = 1 - full
    engine.add_request("r", {"prompt_token_ids": text_ids[:40]},
                       SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    seen_null, before = False, 0
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.requests.get("r")
        if req is None:
            break
        computed = req.num_computed_tokens
        held = kv.num_blocks_held("r")
        ids = kv.get_block_ids("r")
        assert held[full] == cdiv(computed, BLOCK) == len(ids[full])
        # Given back at this step's allocation: the blocks wholly before the window of the
        # step's first new token, at position `before` (the tokens computed until then).
        skipped = max(0, before - WINDOW + 1) // BLOCK
        assert held[window] == cdiv(computed, BLOCK) - skipped
        assert ids[window][:skipped] == [0] * skipped  # the null block stands in
        assert held[window] <= cdiv(WINDOW, BLOCK) + 1
        seen_null |= skipped > 0
        before = computed
    assert seen_null
    assert_no_blocks_held(llm)


def test_sparse_retention_pins_a_shared_prefix_on_the_second_request(text_ids):
    """vLLM 0.33.0's default: a window group keys only the window before the prompt's last
    token. A second request sharing a long system prompt finds the full-attention blocks but
    not the window's, so it hits nothing, and keys the window at the junction; a third hits."""
    system = text_ids[:64]  # 8 blocks, longer than the window
    tails = [text_ids[200 + 13 * i: 200 + 13 * i + 11] for i in range(3)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def cached(llm):
        return [llm.generate({"prompt_token_ids": system + t}, sp)[0].num_cached_tokens
                for t in tails]

    assert cached(hybrid()) == [0, 0, 64]
    assert cached(hybrid(prefix_cache_retention_interval=None)) == [0, 64, 64]
    # Full attention alone hits from the second request on.
    assert cached(LLM(block_size=BLOCK, kv_cache_tokens=1024, max_model_len=256)) == [0, 64, 64]
    # The same prompt again is a hit under sparse retention: its window before the last token
    # was kept (cached = (prompt - 1) in whole blocks).
    llm = hybrid()
    p = system + tails[0]
    first = llm.generate({"prompt_token_ids": p}, sp)[0]
    again = llm.generate({"prompt_token_ids": p}, sp)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, (len(p) - 1) // BLOCK * BLOCK)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_capacity_is_vllms_formula_and_the_hybrid_pool_has_twice_the_blocks():
    full = LLM(block_size=BLOCK, kv_cache_tokens=1024, max_model_len=256,
               max_num_batched_tokens=64)
    hyb = hybrid(max_num_batched_tokens=64)
    nf = full.stats()["num_blocks"]
    nh = hyb.stats()["num_blocks"]
    assert nh == 2 * nf  # two groups of 15 layers: a block costs half the bytes
    assert hyb.llm_engine.kv_cache.nbytes == full.llm_engine.kv_cache.nbytes
    per_full = 256 // BLOCK
    # Window group: the window's last tokens and two steps in flight (async), one more block.
    per_window = cdiv(min(WINDOW - 1 + 2 * 64, 256), BLOCK) + 1
    cap_f, cap_h = full.llm_engine.kv_cache_capacity(), hyb.llm_engine.kv_cache_capacity()
    assert cap_f["kv_cache_max_concurrency"] == nf / per_full
    assert cap_h["kv_cache_max_concurrency"] == nh / (per_full + per_window)
    assert cap_h["kv_cache_size_tokens"] == int(nh / (per_full + per_window) * 256)
    assert cap_h["line"].startswith("CPU KV cache size: ")


@pytest.mark.parametrize("kwargs, says", [
    (dict(backend="flex"), "backend='flex'"),
    (dict(kv_layout="contiguous", enable_prefix_caching=False), "kv_layout='contiguous'"),
    (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype='fp8_e4m3'"),
    (dict(parallel_sampling="fork"), "parallel_sampling='fork'"),
    (dict(hf_overrides={"layer_types": TYPES}), "sliding_window is not set"),
    (dict(hf_overrides={"layer_types": TYPES[:4], "sliding_window": 8}), "30 layers"),
    (dict(hf_overrides={"rope_theta": 1.0}), "kvlab applies"),
    (dict(hf_overrides={"layer_types": ["local"] * 30, "sliding_window": 8}), "layer_types"),
    (dict(prefix_cache_retention_interval=64), "prefix_cache_retention_interval"),
])
def test_what_kvlab_does_not_run_is_refused_with_what_to_change(kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        hybrid(**kwargs)


def test_beam_search_is_refused_and_the_engine_stays_usable(text_ids):
    from kvlab.beam_search import BeamSearchParams

    llm = hybrid()
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search([{"prompt_token_ids": text_ids[:10]}], BeamSearchParams(beam_width=2,
                                                                              max_tokens=4))
    assert_no_blocks_held(llm)
    out = llm.generate({"prompt_token_ids": text_ids[:10]},
                       SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_blocks_held(llm)


def test_seeded_sampling_draws_from_transformers_windowed_distribution(loaded, text_ids):
    """Seeded, with prefix caching and small chunks: every sampled token's logprob is the one
    transformers' windowed model gives that token after the same context (teacher-forced)."""
    ref = windowed_reference(loaded, OVERRIDES)
    llm = hybrid(max_num_batched_tokens=24)
    ps = prompts(text_ids, [70, 41])
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(max_tokens=20, temperature=0.9, seed=3, logprobs=1,
                                       ignore_eos=True))
    for p, o in zip(ps, outs):
        tokens = o.outputs[0].token_ids
        with torch.inference_mode():
            logits = ref(torch.tensor([p + tokens])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)
        for i, (token, lp) in enumerate(zip(tokens, o.outputs[0].logprobs)):
            assert abs(lp[token] - want[len(p) - 1 + i, token].item()) < 1e-3, (i, token)
    assert_no_blocks_held(llm)

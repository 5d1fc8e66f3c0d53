"""`long_prefill_token_threshold` and `long_prefill_token_threshold_adaptive`, vLLM 0.33.0's
knobs (vllm/config/scheduler.py; applied in vllm/v1/core/sched/scheduler.py, Scheduler.schedule;
flags in vllm/engine/arg_utils.py).

vLLM 0.33.0's one unit test of the threshold, test_schedule_concurrent_partial_requests, is
ported in test_vllm_conformance.py. The tests here pin the rest of what the source does: why
the knob exists (a request arriving during a long prefill gets in at once), the cap being
lifted for a request alone, the adaptive floor, the order of the cap and the no-chunking rule,
refused values, and, on the real model, that the cap changes when tokens are computed but never
which tokens come out. The model-free tests drive kvlab's Scheduler through the vLLM adapter.
"""

from __future__ import annotations

import dataclasses

import pytest
from tests.engine.vllm_adapter import SchedulerAdapter, create_requests, create_scheduler
from tests.helpers import assert_no_blocks_held

from kvlab import LLM, SamplingParams
from kvlab.config import EngineConfig


def _steps_until_scheduled(threshold: int) -> tuple[int, list[dict[str, int]]]:
    """A 640-token prompt prefills alone with a 64-token budget; after its first step an
    8-token request arrives. Returns how many steps the short one waited before it was first
    scheduled, and every step's num_scheduled_tokens up to then."""
    scheduler = create_scheduler(max_num_batched_tokens=64, max_model_len=1024,
                                 long_prefill_token_threshold=threshold)
    adapter = SchedulerAdapter(scheduler)
    (long,) = create_requests(num_requests=1, num_tokens=640, req_ids=["long"])
    (short,) = create_requests(num_requests=1, num_tokens=8, req_ids=["short"], starting_idx=1)
    scheduler.add_request(long)
    steps = []
    step = adapter.schedule()
    steps.append(step.num_scheduled_tokens)
    adapter.update(step)
    scheduler.add_request(short)
    waited = 0
    while True:
        step = adapter.schedule()
        steps.append(step.num_scheduled_tokens)
        adapter.update(step)
        if "short" in step.num_scheduled_tokens:
            return waited, steps
        waited += 1


def test_a_short_request_arriving_during_a_long_prefill_is_scheduled_next_step():
    """Without the threshold the long prefill takes the whole 64-token budget until its prompt
    is done, and the short request waits 9 steps; with long_prefill_token_threshold=32 the long
    one gets 32 tokens a step while another request is queued, and the short one is scheduled
    in the very next step, beside it."""
    waited, steps = _steps_until_scheduled(threshold=0)
    assert waited == 9
    assert [s.get("long") for s in steps] == [64] * 10 + [1]  # 640 / 64 steps, then a decode
    waited, steps = _steps_until_scheduled(threshold=32)
    assert waited == 0
    # Alone in the first step it is not capped; the step after, it shares with the newcomer.
    assert steps == [{"long": 64}, {"long": 32, "short": 8}]


def test_the_cap_is_lifted_for_a_request_alone():
    """The cap applies only while more than one request is running or waiting, counted before
    the step schedules anything (vLLM: num_running + num_waiting > 1): a lone prompt takes the
    whole budget; once a second request is queued both are capped; when the other one has
    finished, the survivor takes the whole budget again."""
    scheduler = create_scheduler(max_num_batched_tokens=64, max_model_len=1024,
                                 long_prefill_token_threshold=16)
    adapter = SchedulerAdapter(scheduler)
    a, b = create_requests(num_requests=2, num_tokens=300, max_tokens=1)
    scheduler.add_request(a)
    step = adapter.schedule()
    assert step.num_scheduled_tokens == {"0": 64}
    adapter.update(step)
    scheduler.add_request(b)
    for _ in range(4):  # both capped: 16 each of the budget of 64
        step = adapter.schedule()
        assert step.num_scheduled_tokens == {"0": 16, "1": 16}
        adapter.update(step)
    scheduler.finish_request(b, "abort")
    step = adapter.schedule()
    assert step.num_scheduled_tokens == {"0": 64}


def test_adaptive_threshold_is_floored_at_a_fair_share_of_the_budget():
    """long_prefill_token_threshold_adaptive raises the cap to max_num_batched_tokens //
    (running + waiting) when that is larger: three 800-token prompts under a 100-token cap and a
    1024-token budget each get 1024 // 3 = 341 tokens instead of 100; two get 512; with twenty
    queued the share (51) is below the cap, which stays 100. Requests still waiting for a seat
    count too (max_num_seqs=2 with four queued: a share of 256)."""
    def first_step(num_requests, adaptive, **knobs):
        scheduler = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=100,
                                     long_prefill_token_threshold_adaptive=adaptive, **knobs)
        for request in create_requests(num_requests=num_requests, num_tokens=800):
            scheduler.add_request(request)
        return SchedulerAdapter(scheduler).schedule().num_scheduled_tokens

    assert first_step(3, adaptive=False) == {"0": 100, "1": 100, "2": 100}
    assert first_step(3, adaptive=True) == {"0": 341, "1": 341, "2": 341}
    assert first_step(2, adaptive=True) == {"0": 512, "1": 512}
    got = first_step(20, adaptive=True)
    assert list(got.values()) == [100] * 10 + [24]  # 1024 = 10 * 100 + 24
    assert first_step(4, adaptive=True, max_num_seqs=2) == {"0": 256, "1": 256}
    # A lone request is never capped, adaptive or not.
    assert first_step(1, adaptive=True) == {"0": 800}


def test_a_waiting_request_is_capped_on_what_is_left_after_its_prefix_hit():
    """A waiting request is capped on what it still has to compute: vLLM computes
    num_new_tokens after the prefix-cache hit, then caps it. The second of two identical
    80-token prompts hits 64 tokens (4 full blocks; the last token is always computed), so of
    its 16 left it gets the threshold's 10; the first one's decode (one token) is not cut."""
    scheduler = create_scheduler(max_num_batched_tokens=256, long_prefill_token_threshold=10,
                                 enable_prefix_caching=True, block_size=16)
    adapter = SchedulerAdapter(scheduler)
    first, second = create_requests(num_requests=2, num_tokens=80, same_prompt=True)
    scheduler.add_request(first)
    step = adapter.schedule()
    assert step.num_scheduled_tokens == {"0": 80}  # alone: uncapped; its blocks are cached
    adapter.update(step)
    scheduler.add_request(second)
    step = adapter.schedule()
    # The hit (64), taken at admission, then the step's 10: schedule() advances the count, as
    # vLLM's _update_after_schedule does.
    assert second.num_computed_tokens == 64 + 10
    assert step.num_scheduled_tokens == {"0": 1, "1": 10}


def test_without_chunked_prefill_the_cap_still_cuts_a_prompt():
    """vLLM caps num_new_tokens before it applies enable_chunked_prefill=False's all-or-nothing
    rule to a waiting request, so a capped prompt is split anyway; the running loop has no such
    rule (a running request takes what is left of the budget), which kvlab follows for the
    requests the cap cut."""
    scheduler = create_scheduler(max_num_batched_tokens=256, max_model_len=256,
                                 enable_chunked_prefill=False, long_prefill_token_threshold=100)
    adapter = SchedulerAdapter(scheduler)
    for request in create_requests(num_requests=3, num_tokens=250, max_tokens=1):
        scheduler.add_request(request)
    step = adapter.schedule()
    # Two fit under the cap; the third's 100 do not fit the 56 left, and it is not cut.
    assert step.num_scheduled_tokens == {"0": 100, "1": 100}
    adapter.update(step)
    running = scheduler.running[0]
    assert scheduler._num_new_tokens(running, 7) == 7  # mid-prompt: what the budget leaves
    waiting = scheduler.waiting.peek_request()
    assert scheduler._num_new_tokens(waiting, 7) == 0  # waiting: all (capped) or nothing


def test_off_by_default_and_off_at_zero():
    """vLLM's defaults: 0 (no cap) and adaptive False; the adaptive switch alone changes
    nothing (it only raises a nonzero threshold)."""
    config = EngineConfig()
    assert (config.long_prefill_token_threshold, config.long_prefill_token_threshold_adaptive) \
        == (0, False)
    scheduler = create_scheduler(max_num_batched_tokens=64, max_model_len=1024,
                                 long_prefill_token_threshold_adaptive=True)
    for request in create_requests(num_requests=2, num_tokens=300):
        scheduler.add_request(request)
    assert SchedulerAdapter(scheduler).schedule().num_scheduled_tokens == {"0": 64}


@pytest.mark.parametrize("knobs, error, words", [
    ({"long_prefill_token_threshold": -1}, ValueError, "must be >= 0"),
    ({"long_prefill_token_threshold": True}, TypeError, "must be an int"),
    ({"long_prefill_token_threshold": 8.0}, TypeError, "must be an int"),
    ({"long_prefill_token_threshold": "8"}, TypeError, "must be an int"),
    ({"long_prefill_token_threshold": None}, TypeError, "must be an int"),
    ({"long_prefill_token_threshold_adaptive": 1}, TypeError, "True or False"),
    ({"long_prefill_token_threshold_adaptive": "yes"}, TypeError, "True or False"),
    ({"long_prefill_token_threshold": 65, "max_model_len": 64}, ValueError,
     "cannot be greater than max_model_len=64"),
])
def test_bad_values_are_refused_before_anything_is_loaded(monkeypatch, knobs, error, words):
    """Negative, non-int (bool and float included) thresholds, a non-bool adaptive switch, and
    a threshold above max_model_len (vLLM: SchedulerConfig.verify_max_model_len) are refused by
    EngineConfig, naming the knob, before a model is loaded or a block allocated; a config
    already built is left as it was by a refused replace()."""
    import kvlab.engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(kvlab.engine, "load_model", no_load)
    with pytest.raises(error, match=words):
        LLM(block_size=4, kv_cache_tokens=256, max_model_len=knobs.get("max_model_len", 128),
            **{k: v for k, v in knobs.items() if k != "max_model_len"})
    good = EngineConfig(max_model_len=knobs.get("max_model_len", 128))
    with pytest.raises(error, match=words):
        dataclasses.replace(good, **{k: v for k, v in knobs.items() if k != "max_model_len"})
    assert (good.long_prefill_token_threshold, good.long_prefill_token_threshold_adaptive) \
        == (0, False)


def test_a_threshold_above_the_models_context_is_refused_when_it_is_resolved():
    """With max_model_len left to the model, the threshold is checked against the length the
    config resolves to (here the 128 tokens of the KV budget), before the pool is allocated."""
    config = EngineConfig(long_prefill_token_threshold=200, kv_cache_tokens=128)
    with pytest.raises(ValueError, match="cannot be greater than max_model_len=128"):
        config.resolve(model_max_len=8192, default_kv_tokens=128)
    assert config.long_prefill_token_threshold == 200 and config.max_model_len is None


def test_serve_flags_map_onto_the_knobs():
    """`kvlab serve --long-prefill-token-threshold N --long-prefill-token-threshold-adaptive`
    (vLLM's flags, vllm/engine/arg_utils.py; the adaptive one a BooleanOptionalAction, as
    vLLM makes every bool field) set the two LLM knobs; unset, vLLM's defaults."""
    from kvlab.serve.cli import engine_kwargs, parser

    kwargs = engine_kwargs(parser().parse_args(["serve"]))
    assert (kwargs["long_prefill_token_threshold"],
            kwargs["long_prefill_token_threshold_adaptive"]) == (0, False)
    args = parser().parse_args("serve --long-prefill-token-threshold 512 "
                               "--long-prefill-token-threshold-adaptive".split())
    kwargs = engine_kwargs(args)
    assert (kwargs["long_prefill_token_threshold"],
            kwargs["long_prefill_token_threshold_adaptive"]) == (512, True)
    args = parser().parse_args("serve --no-long-prefill-token-threshold-adaptive".split())
    assert engine_kwargs(args)["long_prefill_token_threshold_adaptive"] is False
    kwargs = engine_kwargs(parser().parse_args(
        "serve --max-model-len 64 --kv-cache-tokens 256 --long-prefill-token-threshold 8".split()))
    assert EngineConfig(**kwargs).long_prefill_token_threshold == 8  # every key is a knob
    with pytest.raises(ValueError, match="cannot be greater than max_model_len=64"):
        EngineConfig(**engine_kwargs(parser().parse_args(
            "serve --max-model-len 64 --long-prefill-token-threshold 65".split())))


# ---- the real model -------------------------------------------------------------------------
_ENGINE = dict(block_size=4, kv_cache_tokens=1024, max_model_len=256, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _run(text_ids, **knobs):
    """A 160-token prompt alone for one step, then a 6-token one and a 40-token one arrive.
    Returns the greedy tokens, the step at which each request got its first token, and every
    step's num_scheduled_tokens."""
    llm = LLM(**_ENGINE, **knobs)
    engine = llm.llm_engine
    prompts = {"long": text_ids[:160], "short": text_ids[200:206], "mid": text_ids[300:340]}
    engine.add_request("long", {"prompt_token_ids": prompts["long"]}, GREEDY)
    tokens, first_token_step, schedules, step = {}, {}, [], 0
    while engine.has_unfinished_requests() or step == 0:
        if step == 1:
            for rid in ("short", "mid"):
                engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, GREEDY)
        outputs = engine.step()
        schedules.append(dict(engine.last_scheduler_output.num_scheduled_tokens))
        step += 1
        for out in outputs:
            first_token_step.setdefault(out.request_id, step)
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert_no_blocks_held(llm)
    return tokens, first_token_step, schedules


def test_greedy_tokens_with_the_threshold_equal_those_without(text_ids):
    """On the real model the threshold changes how prompts are cut into steps, never the
    tokens: the greedy outputs of all three requests are the same with
    long_prefill_token_threshold=8 (adaptive or not) as without. And it does what it is for:
    the short request, arriving during the long prefill, gets its first token in the step after
    it arrives, instead of after the long prompt's last chunk."""
    base_tokens, base_first, base_steps = _run(text_ids)
    assert base_first["short"] > 5  # the 160-token prompt takes 32 tokens a step until done
    for adaptive in (False, True):
        tokens, first, steps = _run(text_ids, long_prefill_token_threshold=8,
                                    long_prefill_token_threshold_adaptive=adaptive)
        assert tokens == base_tokens
        assert steps != base_steps
        # Scheduled in the call after it arrives (call 2); under async scheduling (the
        # default) its token is read one call later.
        assert first["short"] == 3
        # While others are queued nobody gets more than the cap: 8, or under the adaptive
        # rule at most max(8, 32 // the requests scheduled), these being among those queued.
        for s in steps:
            if len(s) > 1:
                cap = max(8, 32 // len(s)) if adaptive else 8
                assert max(s.values()) <= cap, steps

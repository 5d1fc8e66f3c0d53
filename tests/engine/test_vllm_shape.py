"""vLLM 0.33.0's scheduler behaviour and shape on the real engine: full-prompt admission,
reset_prefix_cache, PREEMPTED, a SchedulerOutput that carries the block tables, the invariants
asserted where state changes, and the debug flag that checks the pool after every step.
(vLLM's own unit tests, re-expressed without a model, are in test_vllm_conformance.py.)"""

from __future__ import annotations

import pytest
from tests.helpers import assert_no_blocks_held

from kvlab import LLM, SamplingParams
from kvlab.request import RequestStatus
from kvlab.scheduler import Scheduler

SP = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _capacity_workload(text_ids, n=8, prompt_len=40):
    return [{"prompt_token_ids": text_ids[i * 7 : i * 7 + prompt_len]} for i in range(n)]


@pytest.mark.slow
def test_full_prompt_admission_preempts_less_and_changes_no_token(text_ids):
    """scheduler_reserve_full_isl (vllm/config/scheduler.py, default True): with a 32-token
    chunk budget and a pool for about four requests, admitting on the first chunk lets more
    requests in than the pool can hold and some are preempted; admitting on the whole prompt
    does not over-admit. Tokens are the same either way."""
    knobs = dict(block_size=8, kv_cache_tokens=256, max_model_len=128,
                 max_num_batched_tokens=32)
    runs = {}
    for full in (True, False):
        llm = LLM(**knobs, scheduler_reserve_full_isl=full)
        outs = llm.generate(_capacity_workload(text_ids), SP)
        runs[full] = ([o.outputs[0].token_ids for o in outs], llm.stats()["num_preemptions"])
        assert_no_blocks_held(llm)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] > runs[True][1]


def test_a_preempted_request_says_preempted_until_readmitted(text_ids):
    llm = LLM(block_size=4, kv_cache_tokens=16, max_model_len=16)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": text_ids[:6]}, SP)
    engine.add_request("b", {"prompt_token_ids": text_ids[10:16]}, SP)
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        sched = engine.last_scheduler_output
        for r in sched.preempted:
            assert r.status == RequestStatus.PREEMPTED and r in engine.scheduler.waiting
            seen.add(r.request_id)
        for rid in sched.resumed_req_ids:
            assert engine.requests[rid].status in (RequestStatus.RUNNING,
                                                   RequestStatus.FINISHED)
    assert seen  # the pool is too small for both: someone was preempted


def test_reset_prefix_cache_makes_the_next_request_cold(text_ids):
    llm = LLM(block_size=16, max_model_len=256, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": text_ids[:100]}
    one = SamplingParams(max_tokens=1)
    assert llm.generate(prompt, one)[0].num_cached_tokens == 0
    assert llm.generate(prompt, one)[0].num_cached_tokens == 96
    assert llm.reset_prefix_cache()
    cold = llm.generate(prompt, one)[0]
    assert cold.num_cached_tokens == 0
    # Refused while a request holds blocks, accepted when it is preempted first.
    engine = llm.llm_engine
    engine.add_request("r", prompt, SP)
    engine.step()
    assert not llm.reset_prefix_cache()
    assert llm.reset_prefix_cache(reset_running_requests=True)
    assert engine.requests["r"].status == RequestStatus.PREEMPTED
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_blocks_held(llm)


def test_the_model_runner_reads_block_tables_from_the_scheduler_output(text_ids):
    """vLLM's runner gets block ids in the SchedulerOutput (vllm/v1/core/sched/output.py); so
    does kvlab's: it holds no KV cache manager, and a step runs from its output alone."""
    # No prefix cache: the second run of the prompt computes all of it again.
    llm = LLM(block_size=8, kv_cache_tokens=256, max_model_len=128, enable_prefix_caching=False)
    engine = llm.llm_engine
    assert not hasattr(engine.model_runner, "kv_cache_manager")
    want = llm.generate({"prompt_token_ids": text_ids[:20]}, SP)[0].outputs[0].token_ids
    engine.add_request("r", {"prompt_token_ids": text_ids[:20]}, SP)
    sched = engine.scheduler.schedule()
    assert sched.block_ids["r"] == engine.kv_cache_manager.get_block_ids("r")
    assert sched.num_scheduled_tokens == {"r": 20}
    assert [(n.req_id, n.num_computed_tokens) for n in sched.scheduled_new_reqs] == [("r", 0)]
    tables = engine.kv_cache_manager.req_to_blocks
    saved, engine.kv_cache_manager.req_to_blocks = tables, {}  # the runner must not look
    try:
        result = engine.model_runner.execute_model(sched)
    finally:
        engine.kv_cache_manager.req_to_blocks = saved
    assert result.sampled_token_ids["r"] == want[0]
    engine.scheduler.update_from_output(sched, result)
    engine.abort_request("r")
    assert_no_blocks_held(llm)


def test_schedule_asserts_its_budget_like_vllm(text_ids):
    class Overspends(Scheduler):
        def _num_new_tokens(self, request, budget, num_computed=None):
            return request.num_tokens - (num_computed or 0)  # ignores the budget

    llm = LLM(block_size=8, kv_cache_tokens=512, max_model_len=256, max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.scheduler = Overspends(engine.config, engine.kv_cache_manager)
    engine.add_request("r", {"prompt_token_ids": text_ids[:40]}, SP)
    with pytest.raises(AssertionError, match="over a budget of 16"):
        engine.scheduler.schedule()


def test_debug_checks_catch_a_broken_pool_at_the_step_that_broke_it(text_ids):
    llm = LLM(block_size=4, kv_cache_tokens=64, max_model_len=64, debug_checks=True)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": text_ids[:10]}, SP)
    engine.step()
    kv = engine.kv_cache_manager
    kv.block_pool.touch([kv.req_to_blocks["r"][0]])  # a reference no block table explains
    with pytest.raises(AssertionError, match="block tables hold it"):
        engine.step()
    plain = LLM(block_size=4, kv_cache_tokens=64, max_model_len=64)  # off by default
    assert not plain.llm_engine.config.debug_checks


def test_contiguous_layout_still_runs_with_full_prompt_admission(text_ids):
    paged = LLM(block_size=8, kv_cache_tokens=512, max_model_len=64)
    contiguous = LLM(block_size=8, kv_cache_tokens=512, max_model_len=64, kv_layout="contiguous")
    prompts = _capacity_workload(text_ids, n=6, prompt_len=30)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in paged.generate(prompts, sp)]
            == [o.outputs[0].token_ids for o in contiguous.generate(prompts, sp)])
    assert_no_blocks_held(contiguous)

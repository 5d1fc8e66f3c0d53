"""The scheduling policy behind the waiting queue (kvlab/request_queue.py), as vLLM 0.33.0's
(vllm/v1/core/sched/request_queue.py, and the victim choice in vllm/v1/core/sched/scheduler.py).

The queue and scheduler tests need no model (vLLM's own test_priority_scheduling_* tests are
re-expressed in test_vllm_conformance.py; the scheduler ones here pin what the 0.33.0 source
does beyond them). The last tests run the real engine: priority changes the order requests
run in, never their greedy tokens."""

from __future__ import annotations

import pytest
from tests.engine.vllm_adapter import (
    create_requests_with_priority, create_scheduler, runner_output,
)
from tests.helpers import assert_no_blocks_held, make_request

from kvlab import LLM, SamplingParams
from kvlab.config import EngineConfig
from kvlab.group_scheduler import GroupScheduler
from kvlab.kv_cache import KVCacheManager
from kvlab.request import RequestGroup, RequestStatus
from kvlab.request_queue import (
    FCFSRequestQueue, PriorityRequestQueue, SchedulingPolicy, create_request_queue,
)


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# ---- the queues ---------------------------------------------------------------------------------
def test_fcfs_queue_serves_arrival_order_and_prepends_to_the_front():
    """FCFS: add appends, pop and peek take the head, prepend puts a request at the very front,
    prepend_requests puts the last of its list first (vLLM's extendleft), and the deque calls
    still work beside the queue's own names."""
    a, b, c, d = (make_request(x, [1]) for x in "abcd")
    q = create_request_queue("fcfs")
    assert isinstance(q, FCFSRequestQueue)
    for r in (a, b, c):
        q.add_request(r)
    assert q.peek_request() is a and ids(q) == ["a", "b", "c"] and len(q) == 3
    assert q.pop_request() is a
    q.prepend_request(a)
    assert ids(q) == ["a", "b", "c"]
    q.remove_request(b)
    q.prepend_requests([b, d])
    assert ids(q) == ["d", "b", "a", "c"]
    q.remove_requests([d, c])
    assert ids(q) == ["b", "a"] and q[0] is b and a in q and d not in q
    q.popleft(), q.popleft()
    assert not q
    with pytest.raises(IndexError):
        q.peek_request()


def test_priority_queue_orders_by_priority_then_arrival_then_id():
    """Lower priority value first; equal priorities by earlier arrival; then by request id
    (vllm/v1/request.py Request.__lt__). Iterating lists that order and leaves the queue as
    it was."""
    reqs = [make_request("late-urgent", [1], priority=0, arrival_time=5.0),
            make_request("b", [1], priority=1, arrival_time=2.0),
            make_request("a", [1], priority=1, arrival_time=2.0),
            make_request("early", [1], priority=1, arrival_time=1.0),
            make_request("lazy", [1], priority=9, arrival_time=0.0)]
    q = create_request_queue(SchedulingPolicy.PRIORITY)
    assert isinstance(q, PriorityRequestQueue) and not q
    for r in reqs:
        q.add_request(r)
    order = ["late-urgent", "early", "a", "b", "lazy"]
    assert ids(q) == order and ids(q) == order and len(q) == 5
    assert q.peek_request().request_id == "late-urgent"
    assert [q.pop_request().request_id for _ in range(5)] == order
    with pytest.raises(IndexError):
        q.pop_request()
    with pytest.raises(IndexError):
        q.peek_request()


def test_priority_queue_has_no_front_a_preempted_request_takes_its_place():
    """prepend_request in a priority queue places the request by its key, as add_request does
    (vLLM: no concept of a front), so a preempted low-priority request does not jump the queue;
    remove takes one request out and the order of the rest holds."""
    hi, mid, lo = create_requests_with_priority(3, [0, 1, 2])
    q = PriorityRequestQueue()
    q.add_request(hi)
    q.add_request(mid)
    q.prepend_request(lo)
    assert ids(q) == ["0", "1", "2"]
    q.remove_request(mid)
    assert ids(q) == ["0", "2"] and mid not in q and lo in q
    with pytest.raises(ValueError):
        q.remove_request(mid)
    q.prepend_requests([mid])
    q.remove_requests([hi, lo])
    assert ids(q) == ["1"]


def test_an_unknown_policy_is_refused():
    """create_request_queue and EngineConfig accept vLLM's two policy names only."""
    with pytest.raises(ValueError):
        create_request_queue("lifo")
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="lifo")
    with pytest.raises(TypeError, match="policy"):
        EngineConfig(policy=1)
    assert EngineConfig().policy == "fcfs"


# ---- the scheduler (vLLM's own priority tests are ported in test_vllm_conformance.py) -----------
def _three_decoders(policy):
    """a (priority 0), b (priority 5), c (priority 0), admitted in that order, in a 3-block pool
    of 4-token blocks, at the step where b needs a second block and none is free."""
    scheduler = create_scheduler(policy=policy, num_blocks=4, block_size=4, max_model_len=12,
                                 max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b, c = (make_request(rid, [i + 1] * n, priority=p, arrival_time=float(i))
               for i, (rid, n, p) in enumerate([("a", 2, 0), ("b", 3, 5), ("c", 2, 0)]))
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, 7))
    scheduler.add_request(c)
    out = scheduler.schedule()
    assert ids(scheduler.running) == ["a", "b", "c"]
    scheduler.update_from_output(out, runner_output(out, 7))
    return scheduler


def test_under_priority_a_request_that_preempts_itself_lets_the_later_ones_run():
    """The running request that needs a block is itself the lowest priority: it is preempted
    and the requests after it, which rank above it, still run (vLLM continues). Under fcfs the
    newest running request is preempted instead and the one that needed the block runs."""
    out = _three_decoders("priority").schedule()
    assert out.num_scheduled_tokens == {"a": 1, "c": 1} and ids(out.preempted) == ["b"]
    out = _three_decoders("fcfs").schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and ids(out.preempted) == ["c"]


def test_fcfs_ignores_priority_as_vllm_does():
    """Under fcfs (the default) a request's priority changes nothing: vLLM 0.33.0's v1 engine
    accepts it and its FCFS queue and victim choice never read it."""
    scheduler = create_scheduler(max_num_seqs=1)
    for r in create_requests_with_priority(4, [3, 1, 2, 0]):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["0"]
    assert ids(scheduler.waiting) == ["1", "2", "3"]


def test_a_forking_request_preempted_after_it_was_scheduled_takes_its_fork_back():
    """Chapter 02's fork under priority (state set up by hand): a request that completes its
    prompt forks its sample, then is preempted in the same step for a higher-priority request;
    the fork is undone (the sample holds no block and waits to fork again), and the pool's
    bookkeeping holds."""
    config = EngineConfig(block_size=4, kv_cache_tokens=12, max_model_len=12,
                          max_num_batched_tokens=64, policy="priority")
    config = config.resolve(model_max_len=12, default_kv_tokens=12)
    kv = KVCacheManager(config.num_blocks, config.block_size, config.max_model_len)
    scheduler = GroupScheduler(config, kv)
    parent = make_request("0_p", [1] * 6, priority=5, arrival_time=0.0)
    child = make_request("1_p", [1] * 6, priority=5, arrival_time=0.0)
    parent.group = child.group = RequestGroup("p", 2)
    parent.fork_children = [child]
    urgent = make_request("q", [2] * 4, priority=0, arrival_time=1.0)
    urgent.output_token_ids = [9]  # decoding: its 5th token needs a second block
    for request, blocks, computed in ((parent, 1, 4), (urgent, 1, 4)):
        kv.allocate_slots(request.request_id, blocks * 4)
        request.num_computed_tokens = computed
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
    out = scheduler.schedule()  # parent: 2 tokens, a 2nd block, fork; urgent: no block left
    assert out.num_scheduled_tokens == {"q": 1} and ids(out.preempted) == ["0_p"]
    assert out.forked == {} and parent.fork_children == [child]
    assert child.status == RequestStatus.WAITING and child.num_computed_tokens == 0
    assert child not in scheduler.running and child not in scheduler.waiting
    assert kv.get_block_ids("1_p") == [] and kv.get_block_ids("0_p") == []
    kv.check_invariants()


# ---- the real engine ----------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# 8 blocks of 8 tokens for six requests of about 30 tokens: admission waits for blocks and
# running requests are preempted, so the policy decides who runs when.
TIGHT = dict(block_size=8, kv_cache_tokens=64, max_model_len=64, max_num_seqs=4)


def _prompts(text_ids):
    return [{"prompt_token_ids": text_ids[i * 9: i * 9 + 14 + 3 * i]} for i in range(6)]


def test_greedy_tokens_under_priority_equal_fcfs(text_ids):
    """The same requests under policy="priority" (reversed priorities, so the order of
    admission and of preemption differs from arrival order) give fcfs's greedy tokens, and the
    best-ranked request is the first admitted."""
    prompts = _prompts(text_ids)
    fcfs = LLM(**TIGHT)
    want = [o.outputs[0].token_ids for o in fcfs.generate(prompts, GREEDY)]
    llm = LLM(**TIGHT, policy="priority")
    engine = llm.llm_engine
    outs = llm.generate(prompts, GREEDY, priority=list(range(6, 0, -1)))
    assert [o.outputs[0].token_ids for o in outs] == want
    first = list(engine.step_trace)[0].request_ids
    assert first[0] == "gen-5"  # priority 1: admitted ahead of the five that arrived earlier
    assert fcfs.stats()["num_preemptions"] > 0 and llm.stats()["num_preemptions"] > 0
    assert_no_blocks_held(llm)


def test_priority_under_fcfs_changes_no_step(text_ids):
    """policy="fcfs" with priorities given runs the very same steps as without them."""
    prompts = _prompts(text_ids)
    runs = []
    for priority in (None, [5, 0, 3, 1, 4, 2]):
        llm = LLM(**TIGHT)
        outs = llm.generate(prompts, GREEDY, priority=priority)
        trace = [(r.request_ids, r.num_prefill_tokens) for r in llm.llm_engine.step_trace]
        runs.append(([o.outputs[0].token_ids for o in outs], trace))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("priority, error, words", [
    (1.5, TypeError, "priority must be an int"),
    ("1", TypeError, "priority must be an int"),
    (True, TypeError, "priority must be an int"),
    ([0, 1], ValueError, "2 priorities for 3 prompts"),
    ([0, None, 1], TypeError, "priority must be an int"),
])
def test_bad_priority_is_refused_before_anything_is_added(priority, error, words):
    """A priority that is not an int, or a list of the wrong length, is refused before any
    request is added: the engine is as it was and answers as before."""
    llm = LLM(block_size=8, kv_cache_tokens=256, max_model_len=64, policy="priority")
    prompts = [{"prompt_token_ids": [1, 2, 3]}] * 3
    with pytest.raises(error, match=words):
        llm.generate(prompts, GREEDY, priority=priority)
    with pytest.raises(TypeError, match="priority"):
        llm.llm_engine.add_request("x", prompts[0], GREEDY, priority=0.5)
    assert llm.request_counter == 0 and llm.llm_engine.num_requests_added == 0
    assert_no_blocks_held(llm)
    assert len(llm.generate(prompts, GREEDY, priority=[2, 1, 0])) == 3


def test_vllms_llm_keyword_scheduling_policy_is_the_policy():
    """vLLM's `LLM(scheduling_policy=...)` (EngineArgs' name) sets the same knob as
    SchedulerConfig's `policy`; two different values are refused before anything loads."""
    from kvlab import LLM

    assert LLM(max_model_len=64, kv_cache_tokens=256,
               scheduling_policy="priority").llm_engine.config.policy == "priority"
    with pytest.raises(ValueError, match="once"):
        LLM(policy="priority", scheduling_policy="fcfs")

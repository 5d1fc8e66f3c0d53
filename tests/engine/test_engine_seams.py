"""The engine's seams, as vLLM's: the scheduler class (and the KV cache manager's) chosen by the
config at construction (vllm/config/scheduler.py scheduler_cls), `EngineConfig.resolve()`
returning a new config, and observers that hear of every step (kvlab/step_log.py) while the
engine's own StepLog keeps what the notebooks and plots read."""

from __future__ import annotations

import dataclasses

import pytest
from tests.helpers import assert_no_blocks_held

from kvlab import LLM, SamplingParams
from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine, get_scheduler_cls
from kvlab.group_scheduler import GroupScheduler
from kvlab.kv_cache import ContiguousKVCacheManager, KVCacheManager, get_kv_cache_manager_cls
from kvlab.scheduler import Scheduler
from kvlab.step_log import StepLog, StepObserver

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SMALL = dict(block_size=4, kv_cache_tokens=64, max_model_len=32)


class CountingScheduler(GroupScheduler):
    """kvlab's default scheduler, counting the steps it scheduled (under async scheduling a call
    can schedule nothing: every running request's last token is already in flight)."""

    def __init__(self, config, kv_cache_manager) -> None:
        super().__init__(config, kv_cache_manager)
        self.num_schedules = 0

    def schedule(self):
        out = super().schedule()
        self.num_schedules += bool(out.scheduled)
        return out


class CountingManager(KVCacheManager):
    """The paged manager, counting the allocations it granted."""

    num_granted = 0

    def allocate_slots(self, *args, **kwargs) -> bool:
        ok = super().allocate_slots(*args, **kwargs)
        self.num_granted += ok
        return ok


def _prompts(text_ids):
    return [{"prompt_token_ids": text_ids[i * 5: i * 5 + 9]} for i in range(3)]


@pytest.mark.parametrize("scheduler_cls", [
    CountingScheduler, "tests.engine.test_engine_seams.CountingScheduler"])
def test_the_scheduler_class_is_chosen_at_construction(text_ids, scheduler_cls):
    """LLM(scheduler_cls=...) (a class, or its dotted path as vLLM takes it) is the class the
    engine builds and steps with; the tokens are the default scheduler's."""
    want = [o.outputs[0].token_ids for o in LLM(**SMALL).generate(_prompts(text_ids), GREEDY)]
    llm = LLM(**SMALL, scheduler_cls=scheduler_cls)
    scheduler = llm.llm_engine.scheduler
    assert type(scheduler) is CountingScheduler
    assert scheduler.kv_cache_manager is llm.llm_engine.kv_cache_manager
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(text_ids), GREEDY)] == want
    assert scheduler.num_schedules == llm.llm_engine.num_steps > 0
    assert_no_blocks_held(llm)


def test_the_default_scheduler_and_manager_are_kvlabs():
    """No class given: vLLM's scheduler with chapter 02's groups, and the layout's manager."""
    assert get_scheduler_cls(EngineConfig()) is GroupScheduler
    assert get_kv_cache_manager_cls(EngineConfig()) is KVCacheManager
    contiguous = EngineConfig(kv_layout="contiguous")
    assert get_kv_cache_manager_cls(contiguous) is ContiguousKVCacheManager


def test_the_kv_cache_manager_class_is_chosen_at_construction(text_ids):
    """LLM(kv_cache_manager_cls=...) is built with the layout's arguments, and both the engine
    and its scheduler hold that one manager."""
    llm = LLM(**SMALL, kv_cache_manager_cls=CountingManager, enable_prefix_caching=True)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert type(kv) is CountingManager and engine.scheduler.kv_cache_manager is kv
    assert kv.enable_prefix_caching and kv.num_blocks == 16 + 1 and kv.block_size == 4
    llm.generate(_prompts(text_ids), GREEDY)
    assert kv.num_granted > 0
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("knobs, error, words", [
    (dict(scheduler_cls=42), TypeError, "scheduler_cls must be a class"),
    (dict(scheduler_cls="Scheduler"), ValueError, "'module.Class' path"),
    (dict(scheduler_cls="kvlab.scheduler.NoSuchScheduler"), ValueError, "names no importable"),
    (dict(scheduler_cls="kvlab.no_such_module.Scheduler"), ValueError, "names no importable"),
    (dict(kv_cache_manager_cls="kvlab.kv_cache.make_kv_cache_manager"), TypeError,
     "kv_cache_manager_cls must be a class"),
])
def test_a_class_knob_that_names_no_class_is_refused_by_the_config(knobs, error, words):
    """EngineConfig refuses a scheduler_cls or kv_cache_manager_cls that is neither a class nor
    the 'module.Class' path of one."""
    with pytest.raises(error, match=words):
        EngineConfig(**knobs)


@pytest.mark.parametrize("knobs, words", [
    (dict(scheduler_cls=dict), "scheduler_cls must be a subclass of kvlab.scheduler.Scheduler"),
    (dict(scheduler_cls="kvlab.kv_cache.KVCacheManager"), "scheduler_cls must be a subclass"),
    (dict(kv_cache_manager_cls=Scheduler), "kv_cache_manager_cls must be a subclass"),
    (dict(kv_cache_manager_cls=KVCacheManager, kv_layout="contiguous"),
     "subclass of kvlab.kv_cache.ContiguousKVCacheManager"),
    (dict(kv_cache_manager_cls=ContiguousKVCacheManager), "kv_layout='contiguous'"),
])
def test_a_class_of_the_wrong_kind_is_refused_before_the_model_loads(monkeypatch, knobs, words):
    """A class that is not a scheduler (or not the layout's kind of manager) is refused when
    the engine is built, before the weights are loaded."""
    import kvlab.engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the classes were checked")

    monkeypatch.setattr(kvlab.engine, "load_model", no_load)
    with pytest.raises(TypeError, match=words):
        LLM(**knobs)


def test_resolve_returns_a_new_config_and_leaves_its_input_unchanged():
    """resolve() fills the derived knobs in a new config; the one it was called on keeps its
    Nones, so it can build another engine that resolves again, and resolving a resolved config
    changes nothing."""
    config = EngineConfig(block_size=8)
    before = dataclasses.asdict(config)
    resolved = config.resolve(model_max_len=4096, default_kv_tokens=1000)
    assert resolved is not config and dataclasses.asdict(config) == before
    assert (resolved.max_model_len, resolved.kv_cache_tokens, resolved.max_num_batched_tokens) == (
        1000, 1000, 2048)
    assert resolved.resolve(model_max_len=4096, default_kv_tokens=1000) == resolved
    by_bytes = EngineConfig(block_size=4, kv_cache_memory_bytes=4 * 1000 * 10)
    got = by_bytes.resolve(model_max_len=64, default_kv_tokens=1, kv_bytes_per_token=1000)
    # 10 blocks of 4 tokens in the bytes, one of them the null block: 36 tokens.
    assert got.kv_cache_tokens == 36 and by_bytes.kv_cache_tokens is None
    with pytest.raises(ValueError, match="both size the KV pool"):
        EngineConfig(kv_cache_memory_bytes=2**20, kv_cache_tokens=256)  # given both: refused


def test_an_engine_keeps_the_resolved_config_and_the_callers_is_untouched():
    """LLMEngine(config) resolves into its own config; the caller's config is the same after,
    and a second engine built from it resolves the same way."""
    config = EngineConfig(block_size=4, kv_cache_tokens=64)
    before = dataclasses.asdict(config)
    engine = LLMEngine(config)
    assert dataclasses.asdict(config) == before and config.max_model_len is None
    assert engine.config is not config and engine.config.max_model_len == 64
    assert LLMEngine(config).config == engine.config


class Recorder(StepObserver):
    """Everything an observer hears, in order."""

    def __init__(self) -> None:
        self.heard = []

    def on_schedule(self, engine, scheduler_output) -> None:
        self.heard.append(("schedule", len(scheduler_output.scheduled)))

    def on_step(self, engine, scheduler_output, start) -> None:
        self.heard.append(("step", engine.num_steps))

    def on_kv_events(self, engine, events) -> None:
        self.heard.append(("kv_events", len(events)))


def test_an_observer_hears_every_schedule_step_and_kv_event(text_ids):
    """An attached observer hears each schedule before its step, each step that ran (counted
    already), and the same KV cache events the engine's StepLog keeps; the engine's step_trace,
    last_scheduler_output and kv_events are its StepLog's."""
    llm = LLM(**SMALL, enable_prefix_caching=True)
    engine = llm.llm_engine
    recorder = Recorder()
    engine.add_observer(recorder)
    assert isinstance(engine.step_log, StepLog) and engine.observers[0] is engine.step_log
    llm.generate(_prompts(text_ids), GREEDY)
    steps = [h for h in recorder.heard if h[0] == "step"]
    assert steps == [("step", n) for n in range(1, engine.num_steps + 1)]
    assert len(engine.step_trace) == engine.num_steps
    assert [r.step for r in engine.step_trace] == list(range(1, engine.num_steps + 1))
    assert recorder.heard[0][0] == "schedule"
    # Async scheduling: step n + 1 is scheduled before step n is read, so by the time step n is
    # read at least n non-empty schedules were heard, and in all as many as steps.
    scheduled = 0
    for kind, n in recorder.heard:
        scheduled += kind == "schedule" and n > 0
        if kind == "step":
            assert scheduled >= n
    assert scheduled == engine.num_steps
    assert sum(n for kind, n in recorder.heard if kind == "kv_events") == engine.num_kv_events > 0
    assert engine.last_scheduler_output is engine.step_log.last_scheduler_output
    assert engine.kv_events is engine.step_log.kv_events

"""What an engine tells its observers about each step, and the engine's own record of its steps.

vLLM's engine reports a step to whoever listens in two ways: `LLMEngine.step` ends by handing
the step's statistics to its stat loggers (`vllm/v1/metrics/loggers.py`: `StatLoggerBase.record`,
through the `StatLoggerManager`), and the scheduler publishes the block pool's KV cache events
(`vllm/distributed/kv_events.py`: `EventPublisher.publish`, from `Scheduler.update_from_output`).
kvlab folds both into one small interface, `StepObserver`, so that `LLMEngine.step` stays the
four calls it is (schedule, execute_model, update_from_output, output processing) and whatever
watches it (plots, the tests, the workbook's explorer and exercises) hangs off the side:

- `on_schedule(engine, scheduler_output)`: after every `Scheduler.schedule()`, a step that
  schedules nothing included, before the model runs;
- `on_step(engine, scheduler_output, start)`: after a step that ran the model, once its result
  is read: the requests have advanced and stop strings have ended theirs (`engine.num_steps`
  counts it already); `time.perf_counter() - start` is the step's own schedule, forward and
  update (under async scheduling the next step ran between its forward and its update, and is
  left out), `engine.step_forward_time` its forward;
- `on_kv_events(engine, events)`: the block pool's KV cache events since the last delivery,
  oldest first, delivered before a step schedules (what aborts and resets did), after each step,
  and after `reset_prefix_cache`; `engine.num_steps` then is the step they belong to.

`StepLog` is the observer every engine attaches to itself first: the records that `LLMEngine`
exposes as `step_trace`, `last_scheduler_output`, `kv_events` and `num_kv_events`. Attach more
with `LLMEngine.add_observer`. Observers only read; the engine never looks at what they keep.
"""

from __future__ import annotations

import time
from collections import deque

from kvlab.kv_events import KVCacheEvent
from kvlab.metrics import StepRecord

# How many steps and events a StepLog keeps: the most recent only, so that a long-lived engine
# does not grow.
MAX_RECORDS = 100_000


class StepObserver:
    """The hooks an engine calls; each does nothing here. Subclass and override what you need."""

    def on_schedule(self, engine, scheduler_output) -> None:
        pass

    def on_step(self, engine, scheduler_output, start: float) -> None:
        pass

    def on_kv_events(self, engine, events: list[KVCacheEvent]) -> None:
        pass


class StepLog(StepObserver):
    """The engine's own record: one `StepRecord` per step that ran (for plots), the last
    step's `SchedulerOutput` (kept for reading only: the explorer draws its token budget,
    preemptions and copies; never fed back), and the KV cache events as (step, event)."""

    def __init__(self, maxlen: int = MAX_RECORDS) -> None:
        self.step_trace: deque[StepRecord] = deque(maxlen=maxlen)
        self.last_scheduler_output = None
        self.kv_events: deque[tuple[int, KVCacheEvent]] = deque(maxlen=maxlen)
        self.num_kv_events = 0  # ever logged: a reader remembers it to find what is new

    def on_schedule(self, engine, scheduler_output) -> None:
        self.last_scheduler_output = scheduler_output

    def on_step(self, engine, scheduler_output, start: float) -> None:
        scheduler, kv = engine.scheduler, engine.kv_cache_manager
        running = scheduler.running
        num_decode = scheduler_output.num_decode_tokens
        self.step_trace.append(StepRecord(
            step=engine.num_steps,
            request_ids=[r.request_id for r, _ in scheduler_output.scheduled],
            num_prefill_tokens=scheduler_output.total_num_scheduled_tokens - num_decode,
            num_decode_tokens=num_decode,
            num_running=len(running),
            num_waiting=len(scheduler.waiting),
            num_used_blocks=kv.block_pool.get_num_used_blocks(),
            num_cached_tokens=sum(r.num_computed_tokens for r in running),
            num_cow_copies=len(scheduler_output.cow_copies),
            step_time=time.perf_counter() - start,
            forward_time=engine.step_forward_time,  # this step's, not the last one run
        ))

    def on_kv_events(self, engine, events: list[KVCacheEvent]) -> None:
        for event in events:
            self.kv_events.append((engine.num_steps, event))
            self.num_kv_events += 1

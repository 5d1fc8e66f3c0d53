"""The real-model half of a check: a fresh small engine with the participant's piece plugged in,
run side by side with kvlab's own engine on the same requests.

A piece is plugged in by configuration, as vLLM plugs in a scheduler (`scheduler_cls`): the
engine is built with the participant's class (`LLM(scheduler_cls=..., kv_cache_manager_cls=...)`,
the class made by `with_attrs`), and each step's decision is recorded by an observer
(`ScheduleRecorder`, kvlab/step_log.py), not by patching the engine after it was built.

Each check builds its own engines (the weights are loaded once per process and shared, so this
costs about a second the first time and milliseconds after), so wrong code can never disturb an
engine the notebook holds. kvlab's own results are computed once per process and kept.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvlab.workbook.exercises._common import Mismatch, short
from kvlab.sampling import RequestOutputKind, SamplingParams
from kvlab.step_log import StepObserver

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
_REFERENCE_RUNS: dict[str, "Run"] = {}


@contextmanager
def one_thread():
    """A tiny model and a few requests gain nothing from threads, and on a machine whose cores
    are shared, torch's spinning worker threads make each step many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def _text_ids() -> tuple[int, ...]:
    from kvlab.bench import BENCH_TEXT
    from kvlab.model import load_model

    return tuple(load_model().tokenizer(BENCH_TEXT * 4).input_ids)


def prompt_ids(lengths, offset: int = 0) -> list[list[int]]:
    """Deterministic prompts of the given lengths, cut from one fixed English text."""
    ids = _text_ids()
    out, start = [], offset
    for n in lengths:
        out.append(list(ids[start : start + n]))
        start += 7
    return out


def new_engine(**llm_kwargs):
    """A fresh LLMEngine on the shared weights (the model is loaded once per process)."""
    from kvlab.engine import LLM

    return LLM(**llm_kwargs).llm_engine


def with_attrs(cls, **attrs):
    """A subclass of `cls` whose instances start with `attrs` (the participant's function as
    `impl`), to hand the engine as its scheduler_cls or kv_cache_manager_cls. A callable becomes
    a static method, so `self.impl(...)` calls it exactly as given."""
    body = {key: staticmethod(value) if callable(value) else value
            for key, value in attrs.items()}
    return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, **body})


@dataclass
class Run:
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # request -> samples' tokens
    cached: dict[str, int] = field(default_factory=dict)  # request -> num_cached_tokens
    trace: list[tuple[dict[str, int], list[str]]] = field(default_factory=list)


class ScheduleRecorder(StepObserver):
    """Records each step's decision: ({request: new tokens}, [who was preempted])."""

    def __init__(self, trace: list) -> None:
        self.trace = trace

    def on_schedule(self, engine, scheduler_output) -> None:
        self.trace.append(({r.request_id: n for r, n in scheduler_output.scheduled},
                           [r.request_id for r in scheduler_output.preempted]))


def run(engine, batches, max_steps: int = 400) -> Run:
    """Add each batch of (request_id, prompt, params) once the previous one has finished, and
    step until all are done. An engine that stops making progress fails, it does not hang."""
    result = Run()
    engine.add_observer(ScheduleRecorder(result.trace))
    for batch in batches:
        for request_id, prompt, params in batch:
            engine.add_request(request_id, prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            if steps == max_steps:
                left = [r.request_id for r in [*engine.scheduler.running,
                                               *engine.scheduler.waiting]]
                raise Mismatch("every request to finish",
                               f"after {max_steps} steps {short(left)} never finished: "
                               "the engine stopped making progress")
            try:
                outs = engine.step()
            except AssertionError as e:  # debug_checks: the pool's check after every step
                raise Mismatch("the KV cache's bookkeeping to hold after every step",
                               f"after step {engine.num_steps} it does not: {e}") from None
            for out in outs:
                if out.finished:
                    result.tokens[out.request_id] = [list(c.token_ids) for c in out.outputs]
                    result.cached[out.request_id] = out.num_cached_tokens
            steps += 1
    return result


def reference_run(key: str, make) -> Run:
    """kvlab's own result for a workload, computed once per process."""
    if key not in _REFERENCE_RUNS:
        with one_thread():
            _REFERENCE_RUNS[key] = make()
    return _REFERENCE_RUNS[key]


def reference_workload(key: str, engine_kwargs: dict, batches, must=None,
                       why: str = "") -> Run:
    """kvlab's own run of `batches()` in a fresh engine, once per process. `must(engine, run)`
    checks that the workload still exercises what the exercise is about (e.g. preemption)."""
    def make():
        engine = new_engine(**engine_kwargs)
        out = run(engine, batches())
        assert must is None or must(engine, out), why
        return out
    return reference_run(key, make)


def run_with(engine_kwargs: dict, batches, install=None, **pieces):
    """The same workload in a fresh engine built with the participant's piece: `pieces` are
    more LLM(...) arguments (scheduler_cls=..., kv_cache_manager_cls=...), and `install(engine)`
    plugs in what the engine takes after it is built (an attention backend). Returns
    (engine, run) for the comparisons and the bookkeeping check."""
    with one_thread():
        # debug_checks: the pool's full check after every step, so a broken piece is caught
        # at the step that broke it, not at the end of the run.
        engine = new_engine(**engine_kwargs, **pieces, debug_checks=True)
        if install is not None:
            install(engine)
        return engine, run(engine, batches())


def compare_tokens(expected: Run, got: Run, whose: str = "your code") -> None:
    for request_id, tokens in expected.tokens.items():
        mine = got.tokens.get(request_id)
        if mine != tokens:
            where = ""
            if mine is not None:
                for k, (a, b) in enumerate(zip(tokens, mine)):
                    if a != b:
                        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                     min(len(a), len(b)))
                        where = f" (sample {k}, first difference at token {first})"
                        break
            raise Mismatch(f"request {request_id!r} to generate {short(tokens, 90)}, as kvlab's "
                           "own engine does",
                           f"{short(mine, 90)} with {whose}{where}")


def compare_traces(expected: Run, got: Run, whose: str = "yours") -> None:
    """Step by step, the same requests with the same numbers of new tokens."""
    for step, (want, have) in enumerate(zip(expected.trace, got.trace), 1):
        if want != have:
            raise Mismatch(f"step {step}: kvlab's scheduler runs {want[0]}, preempts {want[1]}",
                           f"{whose} ran {have[0]}, preempted {have[1]}")
    if len(expected.trace) != len(got.trace):
        raise Mismatch(f"{len(expected.trace)} steps, as kvlab's scheduler takes",
                       f"{len(got.trace)} steps")


def check_bookkeeping(engine) -> None:
    """After a run: every block back in the free queue, and the pool's invariants hold."""
    pool = engine.kv_cache_manager.block_pool
    try:
        pool.check_invariants()
    except AssertionError as e:
        raise Mismatch("the block pool's bookkeeping to hold after the run",
                       f"it does not: {e}") from None
    if pool.get_num_free_blocks() != pool.num_usable_blocks:
        raise Mismatch(f"all {pool.num_usable_blocks} usable blocks free once every request finished",
                       f"{pool.get_num_free_blocks()} free: some blocks leaked")

"""The engine side of `kvlab serve` (vLLM's EngineClient, in one process): `AsyncEngine`.

One worker thread steps the engine while requests are unfinished; each HTTP request waits on an
asyncio queue for its outputs. Handlers never wait for the engine themselves: an add, an abort (a
client that hung up) or a cache reset is handed to the worker, which runs it between two steps,
so a request that arrives while others decode joins them at the next step (continuous batching
through the API). The worker never dies of a failed step: the requests that failed get a
`RequestFailed` (an HTTP 500, or, once streaming, an SSE error event), the engine has already
returned their blocks, and the others go on. `/health` reads `is_alive()` and `dead_reason`.

Admission (vLLM's `--max-num-queued-reqs`, `AsyncLLM.check_admission` in
vllm/v1/engine/async_llm.py): with a limit set, a request that would take the unfinished
sequences past it is refused with a 503 before it is handed to the worker, so it leaves nothing
behind. The count is kept on the event loop's thread, as vLLM's API server keeps it (the entries
of its OutputProcessor): a sequence counts from the moment its handler is admitted (handed to the
worker, not yet added, waiting or running) until its last output reaches the loop, its request
is aborted, or it fails. A request with `n` samples counts `n` (vLLM's child requests), each
sample leaving the count as it finishes; a completions request with several prompts counts
prompts x n, checked at once (vLLM checks prompt by prompt and aborts the ones it had admitted
when a later one is refused: the same 503, with no half-admitted request here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue as thread_queue
import threading
import time
import weakref

from kvlab.engine import LLM, EngineStepError
from kvlab.sampling import SamplingParams
from kvlab.step_log import StepObserver
from kvlab.serve.prometheus import ServerMetrics
from kvlab.serve.protocol import RequestFailed, check_max_num_queued_reqs, queue_overflow

logger = logging.getLogger(__name__)


class ScheduleStamps(StepObserver):
    """When each request was first scheduled, stamped as its step is decided, before the forward
    runs: vLLM's SCHEDULED event (vllm/v1/core/sched/scheduler.py stamps it as `schedule()`
    starts), from which its prefill and inference times run. The engine's own
    `first_scheduled_time` is stamped as the step's results come in, after the forward, which
    would put the first forward in the queue time and leave a one-step prefill at 0."""

    def __init__(self) -> None:
        self.first: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> stamp

    def on_schedule(self, engine, scheduler_output) -> None:
        now = time.perf_counter()
        for request, _ in scheduler_output.scheduled:
            self.first.setdefault(request, now)  # a preempted request keeps its first stamp

    def scheduled(self, sample) -> float | None:
        return self.first.get(sample, sample.metrics.first_scheduled_time)


class AsyncEngine:
    """An LLMEngine driven by one worker thread, fed from asyncio handlers.

    Only the worker touches the engine. A handler hands it a command (`submit`: add a request,
    abort one, reset the cache), which the worker runs before its next step, as vLLM's engine
    core drains its input queue before each step (`EngineCoreProc.run_busy_loop`,
    vllm/v1/engine/core.py). Handlers used to take
    the engine's lock themselves, and waited: the worker takes it again the moment a step ends
    (a lock is not a queue), so a request sent during a decode entered only when every running
    request had finished. `self.lock` is still held for each step and each batch of commands,
    for a test or a reader that needs the engine still. Each HTTP request has one queue, for
    all its engine requests (a completions request may send several prompts): `self.queues`
    maps each engine request to (that queue, its prompt's index). An entry is made in the same
    command as the request enters the engine (so the worker never sees one without the other)
    and leaves when its handler releases it (one dict operation, atomic).
    """

    def __init__(self, llm: LLM, max_num_queued_reqs: int | None = None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.lock = threading.Lock()
        self.queues: dict[str, asyncio.Queue] = {}
        # Commands for the worker, each with the future its caller waits on. `commands_lock`
        # orders a submit against the worker's death: a command is either queued before the
        # worker fails what is left, or refused.
        self.commands: thread_queue.SimpleQueue = thread_queue.SimpleQueue()
        self.commands_lock = threading.Lock()
        self.wakeup = threading.Event()
        self.stopped = False
        # Why the worker is not running (None while it runs): /health reports it, and once it is
        # set, no request is accepted. Set under the lock, so an add either happens before the
        # worker fails every queue on its way out, or is refused.
        self.dead_reason: str | None = "the engine loop has not started"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        self.ids = itertools.count()
        self.metrics: ServerMetrics | None = None  # set by build_app
        self.seen: set[str] = set()  # requests whose first output was delivered (for metrics)
        # Per request, for the per-request metrics once it finishes: its samples (the engine's
        # Requests, whose RequestMetrics hold the stamps) and when the worker queued it (vLLM's
        # QUEUED event, stamped as its engine core adds the request between two steps).
        self.samples: dict[str, tuple[list, float]] = {}
        self.stamps = ScheduleStamps()
        # Admission: the most unfinished sequences at once (None: no limit), and, per engine
        # request admitted and not yet over, the sample indices still unfinished, with their
        # total. Touched on the event loop's thread only (the worker posts its outputs there), so
        # a check and the admission it allows run with no await between them: no two handlers
        # can both take the last slot.
        self.max_num_queued_reqs = check_max_num_queued_reqs(max_num_queued_reqs)
        self.unfinished: dict[str, set[int]] = {}
        self.num_unfinished = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.dead_reason = None
        self.engine.add_observer(self.stamps)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        # The LLM outlives this server (a notebook may serve it again): stop watching its steps.
        if self.stamps in self.engine.observers:
            self.engine.observers.remove(self.stamps)

    def is_alive(self) -> bool:
        return self.dead_reason is None and self.thread.is_alive()

    # ---- the worker thread ----------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the engine loop was stopped"
        try:
            while not self.stopped:
                busy = self._step()
                if not busy:
                    self.wakeup.wait(0.05)
                    self.wakeup.clear()
        except BaseException as e:
            # Only something that is not an Exception (SystemExit, say) gets here: _step
            # survives every Exception. Logged and recorded for /health; the thread ends.
            reason = f"the engine loop died: {e!r}"
            logger.critical("kvlab engine loop died", exc_info=True)
        finally:
            with self.lock, self.commands_lock:
                self.dead_reason = reason
                self._fail(list(self.queues), reason, abort=True)
                while True:
                    try:
                        _fn, fut = self.commands.get_nowait()
                    except thread_queue.Empty:
                        break
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(RequestFailed(f"the engine is not running: {reason}"))

    def _run_commands(self) -> bool:
        """Run the queued commands (the lock held). Returns whether there were any."""
        ran = False
        while True:
            try:
                fn, fut = self.commands.get_nowait()
            except thread_queue.Empty:
                return ran
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as e:  # bad input, say: it is the caller's to raise
                fut.set_exception(e)

    def _step(self) -> bool:
        """One engine step, and its outputs delivered. Returns whether there was work."""
        with self.lock:
            ran = self._run_commands()
            steps = self.engine.num_steps  # did a step run the model? (iteration_tokens_total)
            try:
                busy = self.engine.has_unfinished_requests()
                outputs = self.engine.step() if busy else []
            except EngineStepError as e:
                # The model failed in this step. The engine has already ended the step's
                # requests (finish_reason "error", blocks back in the pool); the rest are intact.
                logger.error("engine step failed for %s", e.request_ids, exc_info=e.cause)
                self._fail(e.request_ids,
                           f"the engine failed while running this request: {e.cause!r}")
                return True
            except Exception as e:
                # A bug in the engine: nobody knows which requests it left half-updated, so every
                # request in flight is ended here (its blocks back to the pool) and failed.
                logger.exception("engine step raised; failing every request in flight")
                self._fail(list(self.queues),
                           f"the engine failed while running this request: {e!r}", abort=True)
                busy = False  # pause a moment: an engine that fails every step must not spin
            else:
                if self.metrics is not None and self.engine.num_steps > steps:
                    self.metrics.observe_step(self.engine.last_scheduler_output)
                for out in outputs:
                    if self.metrics is not None:
                        self._observe(out)
                    entry = self.queues.get(out.request_id)
                    if entry is not None:
                        self._deliver(out.request_id, entry, out)
            collector = self.engine.kv_cache_manager.block_pool.metrics_collector
            if collector is not None and self.metrics is not None:
                self.metrics.observe_evictions(collector.drain())
        return busy or ran

    def _observe(self, out) -> None:
        """The metrics of one delivered output; a finished request's per-request ones too."""
        first = out.request_id not in self.seen
        if first and not out.finished:
            self.seen.add(out.request_id)
        elif out.finished:
            self.seen.discard(out.request_id)
        self.metrics.observe_output(out, first)
        if out.finished and out.request_id in self.samples:
            samples, queued = self.samples.pop(out.request_id)
            self.metrics.observe_finished(samples, queued, self.stamps)

    def _fail(self, request_ids: list[str], message: str, abort: bool = False) -> None:
        """Hand a RequestFailed (500) to each request's handler; with `abort`, end the request in
        the engine first (returning its blocks). Called with the lock held. Each counts in
        vllm:request_success with finished_reason "error", as vLLM counts a request its engine
        failed."""
        for rid in request_ids:
            if abort and rid in self.engine.parents:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    logger.exception("could not abort %s", rid)
            if rid in self.samples:
                samples, queued = self.samples.pop(rid)
                if self.metrics is not None:
                    self.metrics.observe_finished(samples, queued, self.stamps,
                                                  finished_reason="error")
            entry = self.queues.get(rid)
            if entry is not None:
                self._deliver(rid, entry, RequestFailed(message))

    def _deliver(self, rid: str, entry: tuple[asyncio.Queue, int], item) -> None:
        """Put (prompt index, output or failure) on the queue of the HTTP request it belongs
        to, from the worker thread; on the loop, the samples it ends leave the admission count
        first (vLLM's OutputProcessor drops a finished request as it processes its output, however
        slowly its client reads)."""
        queue, index = entry

        def arrive() -> None:
            self._retire(rid, None if isinstance(item, RequestFailed) else item)
            queue.put_nowait((index, item))

        try:
            self.loop.call_soon_threadsafe(arrive)
        except RuntimeError:  # the event loop is closed: the server is going away
            pass

    # ---- admission (the event loop's thread) ----------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        """Sequences admitted and not finished (vLLM's AsyncLLM.get_num_unfinished_requests)."""
        return self.num_unfinished

    def check_admission(self, n: int, request_id: str) -> None:
        """Refuse (a 503, `protocol.queue_overflow`) a request of `n` sequences that would take
        the unfinished ones past `max_num_queued_reqs`; counted in vllm:admission_rejections."""
        limit = self.max_num_queued_reqs
        if limit is None or self.num_unfinished + n <= limit:
            return
        # An overload, not a fault: a debug line, as vLLM's.
        logger.debug("request queue full: refusing %s (current=%d, n=%d, max=%d)", request_id,
                     self.num_unfinished, n, limit)
        if self.metrics is not None:
            self.metrics.record_admission_rejection("max_num_queued_reqs")
        raise queue_overflow()

    def _admit(self, rids: list[str], n: int) -> None:
        for rid in rids:
            self.unfinished[rid] = set(range(n))
        self.num_unfinished += len(rids) * n

    def _retire(self, rid: str, out=None) -> None:
        """The samples of `rid` that `out` finished leave the count; all of them when `out` is
        None (aborted, failed, forgotten) or the request's last output. Idempotent."""
        left = self.unfinished.get(rid)
        if left is None:
            return
        before = len(left)
        if out is None or out.finished:
            left.clear()
        else:
            left.difference_update(o.index for o in out.outputs if o.finish_reason is not None)
        self.num_unfinished -= before - len(left)
        if not left:
            del self.unfinished[rid]

    # ---- the handlers' side ---------------------------------------------------------------------
    def submit(self, fn) -> concurrent.futures.Future:
        """Have the worker run `fn()` before its next step; the future holds its result or
        exception. Raises RequestFailed when the worker is not running."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.commands_lock:
            if self.dead_reason is not None:
                raise RequestFailed(f"the engine is not running: {self.dead_reason}")
            self.commands.put((fn, fut))
        self.wakeup.set()
        return fut

    async def add_requests(self, prompts: list, params: SamplingParams,
                           arrival_time: float | None = None, priority: int = 0) -> list[str]:
        """Queue one engine request per prompt (a completions request may send several: vLLM
        makes one engine request each, `{id}-{i}`); returns their ids. All are checked before
        any is added, so a bad one adds none. `arrival_time` is when the HTTP request came in
        (`time.perf_counter()`): the wait for the worker counts in every latency metric. Raises
        ValueError/TypeError on bad input and RequestFailed when the engine loop is not
        running, or (a 503) when admitting them would pass `max_num_queued_reqs`: then nothing
        was handed to the worker. The caller must `release` the ids it gets."""
        base = f"cmpl-{next(self.ids)}"
        rids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        # Checked and counted with no await in between (see `unfinished`).
        self.check_admission(len(rids) * params.n, base)
        self._admit(rids, params.n)
        queue: asyncio.Queue = asyncio.Queue()  # one per HTTP request, for all its prompts

        def add():
            parsed = [self.engine.validate_request(rid, p, params, priority)
                      for rid, p in zip(rids, prompts)]
            queued = time.perf_counter()
            for i, (rid, pp) in enumerate(zip(rids, parsed)):
                self.engine.add_parsed_request(rid, pp, params, priority=priority,
                                               arrival_time=arrival_time)
                self.queues[rid] = (queue, i)
                self.samples[rid] = (list(self.engine.parents[rid]), queued)

        def undo(fut) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved, so asyncio does not log it as forgotten
            self.release(rids)

        try:
            added = asyncio.wrap_future(self.submit(add))
        except RequestFailed:  # the worker is not running
            self.release(rids)
            raise
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            # The client left before the worker ran the add: once it has, undo it.
            added.add_done_callback(undo)
            raise
        except BaseException:
            self.release(rids)  # refused: nothing (or, had it failed half-way, the rest) stays
            raise
        return rids

    async def outputs(self, rids: list[str]):
        """Yield (prompt index, RequestOutput) for the requests `rids` (one HTTP request's), in
        the order the engine produced them, until every one has finished; raise RequestFailed if
        any fails."""
        queue = self.queues[rids[0]][0]
        unfinished = len(rids)
        while unfinished:
            index, out = await queue.get()
            if isinstance(out, RequestFailed):
                raise out
            if any(o.finish_reason == "error" for o in out.outputs):  # as vLLM's _raise_if_error
                raise RequestFailed("the engine failed while running this request")
            yield index, out
            if out.finished:
                unfinished -= 1

    def release(self, rids: list[str]) -> None:
        """Forget the requests; abort those still running (the client went away). Their
        sequences leave the admission count now, as an abort drops vLLM's at once."""
        running = []
        for rid in rids:
            self.queues.pop(rid, None)
            self.seen.discard(rid)
            self._retire(rid)
            # Fast path: a request no longer in `parents` has finished or failed, and nothing
            # can bring it back. Otherwise the worker aborts it before its next step (returning
            # its blocks); a worker that is not running has already aborted every request.
            if rid in self.engine.parents:
                running.append(rid)
        if not running:
            return

        def abort() -> None:
            for rid in running:
                self.samples.pop(rid, None)  # an aborted request adds no per-request metric
                if rid in self.engine.parents:
                    self.engine.abort_request(rid)
        try:
            self.submit(abort)
        except RequestFailed:
            pass

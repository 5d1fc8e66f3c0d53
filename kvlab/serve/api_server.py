"""`kvlab serve`: an OpenAI-compatible HTTP server over one engine, the bridge to vLLM.

Endpoints as vLLM's: `/v1/completions` and `/v1/chat/completions` (with `"stream": true` for
server-sent events), `/metrics` in Prometheus text, `/v1/models`, `/health`.

Request fields (the tables `SUPPORTED_FIELDS` and `UNSUPPORTED_FIELDS` below are the reference):

* Implemented: `prompt` (a string or token ids) or `messages`; `max_tokens` (chat also
  `max_completion_tokens`; default 16), `temperature`, `top_p`, `n`, `seed`, `stop` (a string or
  up to 4 strings), `stream` and `stream_options.include_usage`; vLLM's extras `top_k`,
  `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`, `skip_special_tokens` and
  `cache_salt` (refused in key mode, below). Logprobs as vLLM serves them: completions'
  `logprobs` (an int: top alternatives per token) and `echo` (the prompt, and with `logprobs`
  its tokens' logprobs, before the completion), chat's `logprobs` (a bool) and `top_logprobs`,
  and vLLM's `prompt_logprobs` (not with `stream`, as vLLM). A request asking for prompt
  logprobs computes its whole prompt: it does not read the prefix cache (vLLM's
  `skip_reading_prefix_cache`, vllm/sampling_params.py). `model`, when sent, must be the
  served name (else 404 "The model `x` does not exist.", as
  vllm/entrypoints/serve/engine/serving.py); `user` is a tag, accepted and unused.
* Refused with a 400 that names the field: every other OpenAI field (and a few vLLM extras) that
  kvlab does not implement, e.g. chat's `echo`, `suffix`, `frequency_penalty`,
  `logit_bias`, `tools`, `response_format`, `min_p`, unless sent at its "off" value (null, 0,
  false, empty, `best_of` equal to `n`, `response_format` {"type": "text"}); and any field name
  that is neither OpenAI's nor kvlab's. vLLM ignores unknown fields with a log warning; kvlab
  refuses them, so a workshop participant who types `max_token` sees the typo instead of a
  silently different answer.

Responses as vLLM's: a chat stream opens with one chunk per choice carrying `delta.role`
"assistant"; `finish_reason` and vLLM's `stop_reason` (the stop string or stop token id)
per choice, `usage` (with `prompt_tokens_details.cached_tokens` under
`--enable-prompt-tokens-details`). A streaming request asks the engine for
`RequestOutputKind.DELTA` (each output holds only the new text; the engine's incremental
detokenizer never splits a character and holds back a possible stop string) and a non-streaming
one for `FINAL_ONLY` (one output, when it is done), exactly as vLLM's serving layer does.

One worker thread steps the engine while requests are unfinished; each HTTP request waits on an
asyncio queue for its outputs. Handlers never wait for the engine themselves: an add, an abort or
a cache reset is handed to the worker, which runs it between two steps, so a request that
arrives while others decode joins them at the next step (continuous batching through the API). The worker never dies of a failed step: the requests that failed
get an HTTP 500 (or, once streaming, an SSE `data: {"error": ...}` event then `data: [DONE]`),
the engine has already returned their blocks, and the others go on. `/health` is 200 while the
worker runs and 503, with the reason, when it does not. A client that disconnects has its
request aborted at once, which returns its blocks, and costs one log line (a normal event, not an
error). Bad requests get a 400 with the reason, before anything touches the engine. `/metrics`
has vLLM's metric names (`kvlab.serve.prometheus`).

Threat model of `cache_salt`: by default the client chooses it, so it isolates only a client whose
salt is secret and unguessable; whoever sends the same salt shares its cached prefixes and can
probe them (`cached_tokens`, latency). Key mode (`--api-keys-file`/`KVLAB_API_KEYS`, `api_keys=`)
gives the choice to the server: /v1 needs `Authorization: Bearer <key>` (else 401), the key names
a tenant, its salt is HMAC-SHA256(server secret, tenant) (`kvlab.serve.tenants`). A client `cache_salt`
is then refused (400), not ignored: a silently different meaning is worse than a clear refusal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import itertools
from itertools import islice
import json
import logging
import queue as thread_queue
import threading
import time
import weakref

from aiohttp import web

from kvlab.engine import LLM, EngineStepError
from kvlab.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.outputs import Logprob
from kvlab.sampling import RequestOutputKind, SamplingParams
from kvlab.serve.prometheus import CONTENT_TYPE, ServerMetrics
from kvlab.serve.tenants import TenantKeys

logger = logging.getLogger(__name__)

# ---- request fields: the one table that the docs and the tests read -----------------------------
# Passed to SamplingParams under the same (vLLM's) names.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
                   "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                   "skip_special_tokens")
# model: must name the served model when sent (else 404, as vLLM); user: a tag, unused (vLLM
# ignores it too). prompt_logprobs: vLLM's extra (not with stream, as vLLM refuses).
_COMMON_FIELDS = (*SAMPLING_FIELDS, "stream", "stream_options", "cache_salt",
                  "model", "user", "logprobs", "prompt_logprobs")
# Every field kvlab implements, per endpoint.
SUPPORTED_FIELDS: dict[str, tuple[str, ...]] = {
    # logprobs: an int (top logprobs per token); echo: the prompt before the completion.
    "/v1/completions": ("prompt", "echo", *_COMMON_FIELDS),
    # OpenAI's current name for max_tokens in chat; it wins when both are sent (as in vLLM).
    # logprobs: a bool; top_logprobs: how many alternatives per token.
    "/v1/chat/completions": ("messages", "max_completion_tokens", "top_logprobs",
                             *_COMMON_FIELDS),
}
# The most top logprobs per token a request may ask for (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20
# OpenAI's request fields, and vLLM's extras, that kvlab does not implement, each with the values
# that mean "off". Those values are accepted (clients send defaults explicitly); any other value
# is refused with a 400 naming the field, never answered as if the field were not there.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    # OpenAI
    "best_of": (None,),  # also accepted when equal to n: one candidate per returned sample
    "echo": (None, False),  # chat only (vLLM's chat echo); completions has it
    "suffix": (None, ""),
    "top_logprobs": (None, 0),  # completions only: chat has it
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "store": (None, False),
    "metadata": (None, {}),  # labels for stored completions; kvlab stores nothing
    # vLLM's extras
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "repetition_penalty": (None, 1),
    "use_beam_search": (None, False),  # kvlab's beam search is offline only (LLM.beam_search)
    "length_penalty": (None, 1),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "structured_outputs": (None,),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "priority": (None, 0),
    "request_id": (None,),
}
MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")


class RequestFailed(Exception):
    """A request the server could not finish: sent to the client as an OpenAI-style error."""

    def __init__(self, message: str, status: int = 500, err_type: str = "InternalServerError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def body(self) -> dict:
        # vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def bad_request(message: str, param: str | None = None) -> RequestFailed:
    return RequestFailed(message, 400, "BadRequestError", param)


class AsyncEngine:
    """An LLMEngine driven by one worker thread, fed from asyncio handlers.

    Only the worker touches the engine. A handler hands it a command (`submit`: add a request,
    abort one, reset the cache), which the worker runs before its next step, as vLLM's engine
    core drains its input queue before each step (`EngineCoreProc.run_busy_loop`,
    vllm/v1/engine/core.py). Handlers used to take
    the engine's lock themselves, and waited: the worker takes it again the moment a step ends
    (a lock is not a queue), so a request sent during a decode entered only when every running
    request had finished. `self.lock` is still held for each step and each batch of commands,
    for a test or a reader that needs the engine still. A request's queue enters `self.queues`
    in the same command as the request enters the engine (so the worker never sees one without
    the other) and leaves it when its handler releases it (one dict operation, atomic).
    """

    def __init__(self, llm: LLM) -> None:
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

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.dead_reason = None
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

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
                for out in outputs:
                    queue = self.queues.get(out.request_id)
                    if self.metrics is not None:
                        first = out.request_id not in self.seen
                        if first and not out.finished:
                            self.seen.add(out.request_id)
                        elif out.finished:
                            self.seen.discard(out.request_id)
                        self.metrics.observe_output(out, first)
                    if queue is not None:
                        self._deliver(queue, out)
            collector = self.engine.kv_cache_manager.block_pool.metrics_collector
            if collector is not None and self.metrics is not None:
                self.metrics.observe_evictions(collector.drain())
        return busy or ran

    def _fail(self, request_ids: list[str], message: str, abort: bool = False) -> None:
        """Hand a RequestFailed (500) to each request's handler; with `abort`, end the request in
        the engine first (returning its blocks). Called with the lock held."""
        for rid in request_ids:
            if abort and rid in self.engine.parents:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    logger.exception("could not abort %s", rid)
            queue = self.queues.get(rid)
            if queue is not None:
                self._deliver(queue, RequestFailed(message))

    def _deliver(self, queue: asyncio.Queue, item) -> None:
        try:
            self.loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is going away
            pass

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

    async def add_request(self, prompt, params: SamplingParams) -> str:
        """Queue one request; returns its id. Raises ValueError/TypeError on bad input and
        RequestFailed when the engine loop is not running. The caller must `release` the id."""
        rid = f"cmpl-{next(self.ids)}"
        queue: asyncio.Queue = asyncio.Queue()

        def add():
            self.engine.add_request(rid, prompt, params)
            self.queues[rid] = queue

        def undo(fut) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved, so asyncio does not log it as forgotten
            self.release(rid)

        added = asyncio.wrap_future(self.submit(add))
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            # The client left before the worker ran the add: once it has, undo it.
            added.add_done_callback(undo)
            raise
        return rid

    async def outputs(self, rid: str):
        """Yield the request's RequestOutputs until it finishes; raise RequestFailed if it fails."""
        queue = self.queues[rid]
        while True:
            out = await queue.get()
            if isinstance(out, RequestFailed):
                raise out
            if any(o.finish_reason == "error" for o in out.outputs):  # as vLLM's _raise_if_error
                raise RequestFailed("the engine failed while running this request")
            yield out
            if out.finished:
                return

    def release(self, rid: str) -> None:
        """Forget the request; abort it if it is still running (the client went away)."""
        self.queues.pop(rid, None)
        self.seen.discard(rid)
        # Fast path: a request no longer in `parents` has finished or failed, and nothing can
        # bring it back. Otherwise the worker aborts it before its next step (returning its
        # blocks); a worker that is not running has already aborted every request it held.
        if rid in self.engine.parents:
            def abort() -> None:
                if rid in self.engine.parents:
                    self.engine.abort_request(rid)
            try:
                self.submit(abort)
            except RequestFailed:
                pass


ENGINE_KEY = web.AppKey("engine", AsyncEngine)
TENANT_KEY = web.RequestKey("tenant", str)  # the tenant of the request's key (key mode)


def check_fields(body: dict, endpoint: str) -> None:
    """Refuse (400) every field kvlab would otherwise silently not honour; name them all."""
    supported = SUPPORTED_FIELDS[endpoint]
    problems, first = [], None
    for key, value in body.items():
        if key in supported:
            continue
        if key in UNSUPPORTED_FIELDS:
            noops = UNSUPPORTED_FIELDS[key]
            n = body.get("n") if body.get("n") is not None else 1
            if _is_noop(value, noops) or (key == "best_of" and _is_noop(value, (n,))):
                continue
            allowed = " or ".join(json.dumps(v) for v in noops)
            if key == "best_of":
                allowed += " or the same as n"
            problems.append(f"'{key}' is not supported by kvlab (got {json.dumps(value)}): "
                            f"leave it out or send {allowed}")
        else:
            # vLLM ignores an unknown field with a warning in its log; kvlab refuses it, because a
            # workshop participant should see the typo, not a different answer.
            close = difflib.get_close_matches(key, [*supported, *UNSUPPORTED_FIELDS], n=1)
            hint = f": did you mean '{close[0]}'?" if close else ""
            problems.append(f"unknown field '{key}' for {endpoint} (neither OpenAI's API nor "
                            f"kvlab has it){hint}")
        first = first or key
    if problems:
        raise bad_request("; ".join(problems), param=first)


def _is_noop(value, noops: tuple) -> bool:
    """Whether `value` is one of `noops`, minding that False == 0 in Python: `"logprobs": 0`
    asks for logprobs, `"logprobs": false` does not."""
    for noop in noops:
        if noop is None or isinstance(noop, bool):
            if value is noop:
                return True
        elif isinstance(noop, (int, float)):
            if not isinstance(value, bool) and isinstance(value, (int, float)) and value == noop:
                return True
        elif value == noop:
            return True
    return False


def _check_count(body: dict, key: str) -> int | None:
    """An optional count of logprobs in [0, MAX_LOGPROBS] (vLLM's -1, "the whole
    vocabulary", is not served)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {json.dumps(value)}", param=key)
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"'{key}' must be between 0 and {MAX_LOGPROBS}, got {value}",
                          param=key)
    return value


def logprob_fields(body: dict, chat: bool, stream: bool) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for SamplingParams, with vLLM's rules
    (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py)."""
    prompt_logprobs = _check_count(body, "prompt_logprobs")
    if prompt_logprobs is not None and stream:
        raise bad_request("'prompt_logprobs' are not available when \"stream\": true",
                          param="prompt_logprobs")
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise bad_request("'logprobs' must be true or false in chat (the number of "
                              "alternatives is 'top_logprobs')", param="logprobs")
        top = _check_count(body, "top_logprobs")
        if top and not wanted:
            raise bad_request("'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        return (top or 0) if wanted else None, prompt_logprobs
    logprobs = _check_count(body, "logprobs")
    if prompt_logprobs is None and body.get("echo") and logprobs is not None:
        prompt_logprobs = logprobs  # echo with logprobs scores the prompt too (vLLM's rule)
    return logprobs, prompt_logprobs


def sampling_params(body: dict, chat: bool, stream: bool) -> SamplingParams:
    kwargs = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    if chat and body.get("max_completion_tokens") is not None:
        kwargs["max_tokens"] = body["max_completion_tokens"]
    kwargs.setdefault("max_tokens", 16)
    echo = body.get("echo")
    if not chat and echo is not None and not isinstance(echo, bool):
        raise bad_request("'echo' must be true or false", param="echo")
    kwargs["logprobs"], kwargs["prompt_logprobs"] = logprob_fields(body, chat, stream)
    stop = kwargs.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                          param="stop")
    # As vLLM's serving layer: a stream wants only what is new at each step; a plain request
    # wants one output at the end (no text decoded along the way unless stop strings need it).
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(**kwargs)


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage), with vLLM's rules for stream_options."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    if options and not stream:
        raise bad_request("'stream_options' can only be sent with \"stream\": true",
                          param="stream_options")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise bad_request(f"unknown field 'stream_options.{key}'", param="stream_options")
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'stream_options.{key}' must be true or false",
                              param="stream_options")
    if options.get("continuous_usage_stats"):  # vLLM's extra: usage in every chunk
        raise bad_request("'stream_options.continuous_usage_stats' is not supported by kvlab",
                          param="stream_options")
    # include_obfuscation (OpenAI) pads chunks against a side channel; kvlab never pads, and
    # either value gets the same text, so it is accepted.
    return stream, bool(options.get("include_usage"))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          prompt_tokens_details: bool) -> dict:
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    if prompt_tokens_details:  # vLLM reports cached tokens only when asked to
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


def sse(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


# ---- logprobs in OpenAI's shapes, as vLLM builds them ----------------------------------------
def _logprob(value) -> float:
    """A float (a generated token's) or a Logprob (a prompt token's); -inf as OpenAI's -9999."""
    return max(value.logprob if isinstance(value, Logprob) else value, -9999.0)


class TokenText:
    """Each token id's text, decoded once (the logprobs shapes name tokens by their text)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(text: TokenText, token_ids, entries, k: int, offset: int = 0) -> dict:
    """Completions' `logprobs` object: per token its text, its logprob (None for the first
    prompt token, which nothing predicts), the top k + 1 entries (the token's own first) and
    the character offset where it starts (vLLM's _create_completion_logprobs)."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token_id, entry in zip(token_ids, entries):
        token = text(token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(_logprob(entry[token_id]))
            out["top_logprobs"].append(
                {text(t): _logprob(v) for t, v in islice(entry.items(), k + 1)})
    return out


def chat_logprobs(text: TokenText, token_ids, entries, k: int) -> dict:
    """Chat's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}, the
    first k entries in the engine's order (the sampled token first), as vLLM's."""

    def item(token: str, value) -> dict:
        return {"token": token, "logprob": _logprob(value),
                "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [
        {**item(text(token_id), entry[token_id]),
         "top_logprobs": [item(text(t), v) for t, v in islice(entry.items(), k)]}
        for token_id, entry in zip(token_ids, entries)]}


def prompt_logprobs_json(text: TokenText, entries) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else
            {str(t): {"logprob": _logprob(v), "rank": v.rank, "decoded_token": text(t)}
             for t, v in e.items()} for e in entries]


def unauthorized(message: str) -> web.Response:
    """A 401 in kvlab's (OpenAI's) error shape; vLLM's middleware answers `{"error":
    "Unauthorized"}`. The message never quotes what the client sent."""
    response = RequestFailed(message, 401, "AuthenticationError").response()
    response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme the server expects
    return response


# Routes open without a key. /health is polled by load balancers and orchestrators, /metrics by a
# Prometheus scraper, neither of which holds a tenant's key; both show only aggregate counts,
# never a prompt, key or salt. vLLM leaves them open too (its middleware guards only paths under
# /v1, /v2, /inference, /cohere). The aggregate prefix-cache counters do show *when* some tenant
# hits its cache, so a real deployment keeps /metrics on an internal network. Every other path,
# unknown ones included, needs a key: a default-deny list, judged on the route aiohttp matched
# (not on the raw path string, which percent-encoding could disguise).
OPEN_ROUTES = ("/health", "/metrics")


def build_app(llm: LLM, model_name: str | None = None,
              enable_prompt_tokens_details: bool = False,
              api_keys: dict[str, str] | None = None,
              salt_secret: bytes | None = None,
              dev_mode: bool = False,
              kv_cache_metrics: bool = True,
              kv_cache_metrics_sample: float = 1.0) -> web.Application:
    """The server's aiohttp app. `api_keys` ({key: tenant}) turns on key mode, with the tenants'
    salts derived from `salt_secret` (a random one when None: see `kvlab.serve.tenants`). `dev_mode`
    adds vLLM's development routes (`VLLM_SERVER_DEV_MODE=1` in vLLM: `POST
    /reset_prefix_cache`, vllm/entrypoints/serve/dev/cache/api_router.py); off by default, as
    there: any client could wipe every tenant's cached prefixes. `kv_cache_metrics` times a
    `kv_cache_metrics_sample` fraction of KV blocks for the residency histograms (vLLM's
    `--kv-cache-metrics`, off by default there, sampling 0.01; on here, every block: the
    workshop's pools are small)."""
    if api_keys is None and salt_secret is not None:
        raise ValueError("salt_secret is only used with api_keys (key mode)")
    keys = TenantKeys(api_keys, salt_secret) if api_keys is not None else None
    engine = AsyncEngine(llm)
    name = model_name or llm.llm_engine.loaded.name
    engine.metrics = server_metrics = ServerMetrics(llm, name)
    pool = llm.llm_engine.kv_cache_manager.block_pool
    pool.metrics_collector = (KVCacheMetricsCollector(kv_cache_metrics_sample)
                              if kv_cache_metrics else None)
    token_text = TokenText(llm.get_tokenizer())

    @web.middleware
    async def authenticate(request: web.Request, handler):
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical in OPEN_ROUTES:
            return await handler(request)
        authorization = request.headers.get("Authorization")
        tenant = keys.tenant_for(authorization)
        if tenant is None:
            # Logged without the header: the path and the peer only.
            logger.warning("refused %s %s from %s: %s API key", request.method,
                           resource.canonical if resource is not None else "(no route)",
                           request.remote, "no" if not authorization else "an invalid")
            return unauthorized(
                "a valid API key is required: send the header 'Authorization: Bearer <key>'"
                if not authorization else "the API key is not valid")
        request[TENANT_KEY] = tenant
        return await handler(request)

    app = web.Application(middlewares=[authenticate] if keys is not None else [])
    if keys is not None:
        logger.info("key mode: %d API keys for %d tenants; salt secret %s", keys.num_keys,
                    keys.num_tenants, "given" if keys.secret_source == "given" else
                    "random (salts, and so cached prefixes, do not survive a restart)")

    async def on_startup(app):
        engine.start(asyncio.get_running_loop())

    async def on_cleanup(app):
        engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app[ENGINE_KEY] = engine

    async def read_body(request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError("the body is not valid JSON")
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    async def completions(request: web.Request) -> web.StreamResponse:
        return await serve(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await serve(request, chat=True)

    async def serve(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await read_body(request)
            check_fields(body, request.path)
            model = body.get("model")
            if model is not None and model != "" and model != name:
                # vLLM's answer (vllm/entrypoints/serve/engine/serving.py, _check_model).
                raise RequestFailed(f"The model `{model}` does not exist. Valid aliases: {name}.",
                                    404, "NotFoundError", "model")
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ValueError("'messages' must be a non-empty list")
                prompt = {"prompt_token_ids": llm.apply_chat_template(messages)}
            else:
                text = body.get("prompt")
                if isinstance(text, str):
                    prompt = {"prompt": text}
                elif isinstance(text, list):
                    prompt = {"prompt_token_ids": text}
                else:
                    raise ValueError("'prompt' must be a string or a list of token ids")
            if keys is not None:
                if body.get("cache_salt") is not None:
                    # The value is not quoted back: it may be someone else's salt.
                    raise bad_request(
                        "'cache_salt' cannot be sent to this server: it assigns each API key's "
                        "tenant its own salt (leave the field out)", param="cache_salt")
                prompt["cache_salt"] = keys.salt_for(request[TENANT_KEY])
            elif body.get("cache_salt") is not None:
                prompt["cache_salt"] = body["cache_salt"]
            stream, include_usage = stream_flags(body)
            params = sampling_params(body, chat, stream)
            rid = await engine.add_request(prompt, params)  # bad input surfaces here
        except (ValueError, TypeError, jinja_errors()) as e:
            return bad_request(str(e)).response()
        except RequestFailed as e:
            return e.response()
        try:
            if stream:
                return await stream_response(request, rid, chat, include_usage, body, params)
            return await full_response(rid, chat, body, params)
        except asyncio.CancelledError:
            # The client hung up (aiohttp cancels its handler): a normal event, one line; its
            # request is aborted below, which returns its blocks.
            logger.info("client went away during %s", rid)
            raise
        finally:
            engine.release(rid)  # aborts the request if the client went away

    def prompt_text(out) -> str:
        return out.prompt if out.prompt is not None else llm.get_tokenizer().decode(
            out.prompt_token_ids)

    async def full_response(rid: str, chat: bool, body: dict,
                            params: SamplingParams) -> web.Response:
        out = None
        try:
            async for out in engine.outputs(rid):  # FINAL_ONLY: one output, when it is done
                pass
        except RequestFailed as e:
            return e.response()
        echo = not chat and bool(body.get("echo"))
        k = params.logprobs
        plp = prompt_logprobs_json(token_text, out.prompt_logprobs)
        choices = []
        for o in out.outputs:
            logprobs = None
            if chat:
                if k is not None:
                    logprobs = chat_logprobs(token_text, o.token_ids, o.logprobs, k)
                piece = {"message": {"role": "assistant", "content": o.text}}
            else:
                text, ids, entries = o.text, o.token_ids, o.logprobs
                if echo:  # the prompt, then the completion (vLLM's echo)
                    text = prompt_text(out) + text
                    ids = [*out.prompt_token_ids, *ids]
                    entries = [*(out.prompt_logprobs or []), *(entries or [])]
                if k is not None:
                    logprobs = completion_logprobs(token_text, ids, entries, k)
                piece = {"text": text, "prompt_logprobs": plp}
            choices.append({"index": o.index, "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason, "logprobs": logprobs, **piece})
        completion = sum(len(o.token_ids) for o in out.outputs)
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": name, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion, out.num_cached_tokens,
                           enable_prompt_tokens_details),
            **({"prompt_logprobs": plp} if chat else {})})

    async def stream_response(request: web.Request, rid: str, chat: bool,
                              include_usage: bool, body: dict,
                              params: SamplingParams) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        try:
            return await write_stream(request, resp, rid, chat, include_usage, body, params)
        except ConnectionResetError:  # a write found the connection closed: the client left
            logger.info("client went away during %s", rid)
            return resp

    async def write_stream(request: web.Request, resp: web.StreamResponse, rid: str,
                           chat: bool, include_usage: bool, body: dict,
                           params: SamplingParams) -> web.StreamResponse:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        await resp.prepare(request)

        def chunk(index: int, finish_reason, stop_reason, piece: dict, logprobs=None) -> bytes:
            return sse({"id": rid, "object": kind, "created": created, "model": name,
                        "choices": [{"index": index, "finish_reason": finish_reason,
                                     "stop_reason": stop_reason, "logprobs": logprobs,
                                     **piece}]})

        if chat:
            # As OpenAI and vLLM: the stream opens with the role, one chunk per choice.
            for i in range(params.n):
                await resp.write(chunk(i, None, None, {"delta": {"role": "assistant",
                                                                 "content": ""}}))
        echo = not chat and bool(body.get("echo"))
        k = params.logprobs
        tokens: dict[int, int] = {}  # per choice index, for usage
        finished: set[int] = set()
        # Tokens whose text is held back (a partial stop string or character) wait here with
        # their logprobs, and go out with the text they make.
        pending: dict[int, tuple[list, list]] = {}
        offsets: dict[int, int] = {}  # per choice: characters sent so far (text_offset)
        out = None
        try:
            # DELTA: each output holds only the completions that changed in this step, each with
            # only its new text and token ids.
            async for out in engine.outputs(rid):
                for o in out.outputs:
                    tokens[o.index] = tokens.get(o.index, 0) + len(o.token_ids)
                    if o.index in finished:
                        continue
                    ids, entries = pending.setdefault(o.index, ([], []))
                    ids += o.token_ids
                    entries += o.logprobs or []
                    if not o.text and o.finish_reason is None:
                        continue  # e.g. a partial stop string or character held back
                    if o.finish_reason is not None:
                        finished.add(o.index)  # each choice's finish_reason is sent once
                    text = o.text
                    if echo and o.index not in offsets:  # the prompt goes out first
                        text = prompt_text(out) + text
                        ids[:0] = out.prompt_token_ids
                        entries[:0] = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                    logprobs = None
                    if k is not None:
                        logprobs = (chat_logprobs(token_text, ids, entries, k) if chat else
                                    completion_logprobs(token_text, ids, entries, k,
                                                        offsets.get(o.index, 0)))
                    offsets[o.index] = offsets.get(o.index, 0) + len(text)
                    pending[o.index] = ([], [])
                    piece = {"delta": {"content": text}} if chat else {"text": text}
                    await resp.write(chunk(o.index, o.finish_reason, o.stop_reason, piece,
                                           logprobs))
            if include_usage:
                await resp.write(sse({
                    "id": rid, "object": kind, "created": created, "model": name, "choices": [],
                    "usage": usage(len(out.prompt_token_ids), sum(tokens.values()),
                                   out.num_cached_tokens, enable_prompt_tokens_details)}))
        except RequestFailed as e:
            # The status line (200) is long gone: the error travels as an event, as in vLLM.
            await resp.write(sse(e.body()))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request: web.Request) -> web.Response:
        body = server_metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        # As vLLM's /health: 200 while the engine can serve, 503 once it cannot.
        if engine.is_alive():
            return web.Response(text="ok")
        reason = engine.dead_reason or "the engine loop thread is not running"
        return RequestFailed(reason, 503, "ServiceUnavailableError").response()

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        # vLLM's answer: {"success": bool}; False while requests hold blocks, unless
        # ?reset_running_requests=true, which preempts them first (they recompute).
        reset_running = request.query.get("reset_running_requests", "false").lower() in (
            "true", "1")

        ok = await asyncio.wrap_future(
            engine.submit(lambda: engine.engine.reset_prefix_cache(reset_running)))
        logger.info("reset_prefix_cache: %s", "done" if ok else "refused, blocks are in use")
        return web.json_response({"success": bool(ok)})

    if dev_mode:
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def jinja_errors():
    """The chat template's own errors (a malformed conversation) are the client's fault too."""
    try:
        from jinja2 import TemplateError

        return TemplateError
    except ImportError:  # pragma: no cover
        return ValueError


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, **app_kwargs) -> None:
    """Run until interrupted. Loopback by default: this is a workshop server, not a service."""
    web.run_app(build_app(llm, **app_kwargs), host=host, port=port, handler_cancellation=True)


class BackgroundServer:
    """The same server on a thread of its own, for a notebook or a test: `.url`, then `.stop()`.

    Jupyter already runs an event loop in the main thread, so the server gets its own loop.
    """

    # Every server of this process while it runs (its thread holds it): stop_all() ends them.
    _running: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, llm: LLM, port: int = 0, **app_kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.app = build_app(llm, **app_kwargs)
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        started = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.runner.setup())
                site = web.TCPSite(self.runner, "127.0.0.1", port)
                self.loop.run_until_complete(site.start())
            except BaseException as e:  # e.g. the port is taken: reported by the caller
                failed.append(e)
                return
            finally:
                started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="kvlab-server", daemon=True)
        self.thread.start()
        started.wait(60)
        if failed:
            raise failed[0]
        host, self.port = self.runner.addresses[0][:2]  # port 0: the OS picked a free one
        self.url = f"http://{host}:{self.port}"
        BackgroundServer._running.add(self)

    @property
    def engine(self) -> AsyncEngine:
        """The worker that steps the engine (for tests and notebooks: `.is_alive()`)."""
        return self.app[ENGINE_KEY]

    def stop(self) -> None:
        if not self.thread.is_alive():  # stopped already: a second stop() is a no-op
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        BackgroundServer._running.discard(self)
        # aiohttp caches every (handler, applications) middleware chain in one process-wide
        # lru_cache (aiohttp pull request #9158), which keeps a stopped server's application,
        # and through it the engine and the model's weights, alive. Forget them: a running
        # server's next request only builds its chain again. (A private name: look it up.)
        from aiohttp import web_app

        cached = getattr(web_app, "_cached_build_middleware", None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()

    @classmethod
    def stop_all(cls) -> None:
        """Stop every server this process still runs (a chapter's end: kvlab.workbook.session.release)."""
        for server in list(cls._running):
            server.stop()

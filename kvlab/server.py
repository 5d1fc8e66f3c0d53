"""`kvlab serve`: an OpenAI-compatible HTTP server over one engine, the bridge to vLLM.

Endpoints as vLLM's: `/v1/completions` and `/v1/chat/completions` (with `"stream": true` for
server-sent events), `cache_salt` in the request body, `usage.prompt_tokens_details.cached_tokens`
in the response (with `--enable-prompt-tokens-details`, as in vLLM), `/metrics` in Prometheus
text, `/v1/models`, `/health`.

One worker thread steps the engine while requests are unfinished; each HTTP request waits on an
asyncio queue for its outputs. A client that disconnects has its request aborted at once, which
returns its blocks. Bad requests get a 400 with the engine's own error message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

from aiohttp import web

from kvlab.engine import LLM
from kvlab.sampling import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos",
                   "stop_token_ids")


class AsyncEngine:
    """An LLMEngine driven by one worker thread, fed from asyncio handlers."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.lock = threading.Lock()  # the worker steps; handlers add and abort
        self.queues: dict[str, asyncio.Queue] = {}
        self.wakeup = threading.Event()
        self.stopped = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        self.ids = itertools.count()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while not self.stopped:
            with self.lock:
                busy = self.engine.has_unfinished_requests()
                outputs = self.engine.step() if busy else []
            for out in outputs:
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    self.loop.call_soon_threadsafe(queue.put_nowait, out)
            if not busy:
                self.wakeup.wait(0.05)
                self.wakeup.clear()

    async def generate(self, prompt, params: SamplingParams):
        """Yield RequestOutputs of one request until it finishes; abort it if we are cancelled
        (the client went away) or fail. Raises ValueError/TypeError on bad input."""
        rid = f"cmpl-{next(self.ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue

        def add():
            with self.lock:
                self.engine.add_request(rid, prompt, params)

        try:
            await self.loop.run_in_executor(None, add)
            self.wakeup.set()
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self.queues.pop(rid, None)
            with self.lock:
                if rid in self.engine.parents:
                    self.engine.abort_request(rid)


ENGINE_KEY = web.AppKey("engine", AsyncEngine)


def bad_request(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                        "code": 400}}, status=400)


def sampling_params(body: dict) -> SamplingParams:
    kwargs = {k: body[k] for k in SAMPLING_FIELDS if k in body and body[k] is not None}
    kwargs.setdefault("max_tokens", 16)
    return SamplingParams(**kwargs)


def usage(out, prompt_tokens_details: bool) -> dict:
    completion = sum(len(o.token_ids) for o in out.outputs)
    prompt = len(out.prompt_token_ids)
    counts = {"prompt_tokens": prompt, "completion_tokens": completion,
              "total_tokens": prompt + completion}
    if prompt_tokens_details:  # vLLM reports cached tokens only when asked to
        counts["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
    return counts


def build_app(llm: LLM, model_name: str | None = None,
              enable_prompt_tokens_details: bool = False) -> web.Application:
    engine = AsyncEngine(llm)
    name = model_name or llm.llm_engine.loaded.name
    app = web.Application()

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
            if "cache_salt" in body:
                prompt["cache_salt"] = body["cache_salt"]
            params = sampling_params(body)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ValueError("'stream' must be true or false")
            gen = engine.generate(prompt, params)
            first = await gen.__anext__()  # bad input surfaces here, before any byte is sent
        except (ValueError, TypeError, jinja_errors()) as e:
            return bad_request(str(e))
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not stream:
            out = first
            async for out in gen:
                pass
            choices = [
                {"index": o.index, "finish_reason": o.finish_reason, "logprobs": None,
                 **({"message": {"role": "assistant", "content": o.text}} if chat
                    else {"text": o.text})}
                for o in out.outputs
            ]
            return web.json_response({"id": out.request_id, "object": kind, "created": created,
                                      "model": name, "choices": choices,
                                      "usage": usage(out, enable_prompt_tokens_details)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = {}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        out = first
        try:
            while True:
                for o in out.outputs:
                    delta = o.text[len(sent.get(o.index, "")):]
                    sent[o.index] = o.text
                    if not delta and o.finish_reason is None:
                        continue
                    piece = {"delta": {"content": delta}} if chat else {"text": delta}
                    chunk = {"id": out.request_id, "object": kind + (".chunk" if chat else ""),
                             "created": created, "model": name,
                             "choices": [{"index": o.index, "finish_reason": o.finish_reason,
                                          **piece}]}
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if out.finished:
                    break
                out = await gen.__anext__()
            if include_usage:
                chunk = {"id": out.request_id, "object": kind, "created": created, "model": name,
                         "choices": [], "usage": usage(out, enable_prompt_tokens_details)}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            await gen.aclose()  # aborts the request if the client went away mid-stream
        return resp

    async def metrics(request: web.Request) -> web.Response:
        s = llm.stats()
        lines = []
        for key, kind, help_text in (
            ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache"),
            ("num_preemptions", "counter", "Requests preempted for lack of KV blocks"),
            ("num_running", "gauge", "Requests running"),
            ("num_waiting", "gauge", "Requests waiting"),
            ("num_used_blocks", "gauge", "KV blocks in use"),
            ("num_blocks", "gauge", "KV blocks in the pool"),
        ):
            metric = f"kvlab:{key}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}",
                      f"{metric} {s[key]}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

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

    def __init__(self, llm: LLM, port: int = 0, **app_kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(build_app(llm, **app_kwargs), handler_cancellation=True)
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

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

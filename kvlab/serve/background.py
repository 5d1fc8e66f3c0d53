"""`BackgroundServer`: the `kvlab serve` app on a thread of its own, for a notebook or a test.

Jupyter already runs an event loop in the main thread, so the server gets its own loop, on its
own thread; `.url` is where it listens (loopback, a free port by default), `.stop()` ends it.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from aiohttp import web

from kvlab.engine import LLM
from kvlab.serve.api_server import ENGINE_KEY, build_app
from kvlab.serve.engine_client import AsyncEngine


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

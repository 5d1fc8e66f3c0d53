"""`kvlab serve`: an OpenAI-compatible HTTP server over one engine, the bridge to vLLM.

Endpoints as vLLM's: `/v1/completions` and `/v1/chat/completions` (with `"stream": true` for
server-sent events), `/metrics` in Prometheus text, `/v1/models`, `/health`, `/tokenize`,
`/detokenize` and `/version`. This file is the aiohttp app: its routes, the handlers behind
them (methods of `ApiServer`), key mode's middleware, `build_app` and `serve`. The rest lives
beside it:

    protocol.py       the request fields, their checks, the OpenAI-style error
    serving.py        the two generating endpoints: outputs as JSON or a stream of events
    tokenization.py   /tokenize, /detokenize and /version
    engine_client.py  the worker thread that steps the engine (`AsyncEngine`)
    background.py     `BackgroundServer`: this server on a thread, for notebooks and tests

Bad requests get a 400 with the reason, before anything touches the engine; with
`--max-num-queued-reqs`, a request past that limit gets vLLM's 503 (`engine_client`), before
too. `/health` is 200 while the engine's worker runs and 503, with the reason, when it does not.
`/metrics` has vLLM's metric names (`kvlab.serve.prometheus`).

Threat model of `cache_salt`: by default the client chooses it, so it isolates only a client whose
salt is secret and unguessable; whoever sends the same salt shares its cached prefixes and can
probe them (`cached_tokens`, latency). Key mode (`--api-keys-file`/`KVLAB_API_KEYS`, `api_keys=`)
gives the choice to the server: /v1 needs `Authorization: Bearer <key>` (else 401), the key names
a tenant, its salt is HMAC-SHA256(server secret, tenant) (`kvlab.serve.tenants`). A client `cache_salt`
is then refused (400), not ignored: a silently different meaning is worse than a clear refusal.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from kvlab.engine import LLM
from kvlab.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.serve.engine_client import AsyncEngine
from kvlab.serve.prometheus import CONTENT_TYPE, ServerMetrics
from kvlab.serve.protocol import RequestFailed, check_max_num_queued_reqs, unauthorized
from kvlab.serve.serving import OpenAIServing
from kvlab.serve.tenants import TenantKeys
from kvlab.serve.tokenization import ServingTokenization

logger = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
TENANT_KEY = web.RequestKey("tenant", str)  # the tenant of the request's key (key mode)

# Routes open without a key. /health is polled by load balancers and orchestrators, /metrics by a
# Prometheus scraper, neither of which holds a tenant's key; both show only aggregate counts,
# never a prompt, key or salt. vLLM leaves them open too (its middleware guards only paths under
# /v1, /v2, /inference, /cohere). The aggregate prefix-cache counters do show *when* some tenant
# hits its cache, so a real deployment keeps /metrics on an internal network. Every other path,
# unknown ones included, needs a key: a default-deny list, judged on the route aiohttp matched
# (not on the raw path string, which percent-encoding could disguise). /version says only which
# kvlab runs. /tokenize and /detokenize stay behind the key (vLLM leaves them open): they cost
# the server work for whoever asks.
OPEN_ROUTES = ("/health", "/metrics", "/version")


class ApiServer:
    """The app's handlers and what they share: the engine, the serving layer, the metrics and,
    in key mode, the tenants' keys."""

    def __init__(self, engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics,
                 model_name: str, keys: TenantKeys | None = None) -> None:
        self.engine, self.serving, self.server_metrics = engine, serving, metrics
        self.model_name, self.keys = model_name, keys
        self.tokenization = ServingTokenization(serving.renderer, model_name)

    def add_routes(self, app: web.Application, dev_mode: bool = False) -> None:
        if dev_mode:
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenization.tokenize)
        app.router.add_post("/detokenize", self.tokenization.detokenize)
        app.router.add_get("/version", self.tokenization.version)

    async def on_startup(self, app: web.Application) -> None:
        self.engine.start(asyncio.get_running_loop())

    async def on_cleanup(self, app: web.Application) -> None:
        self.engine.stop()

    # ---- key mode -------------------------------------------------------------------------------
    @web.middleware
    async def authenticate(self, request: web.Request, handler):
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical in OPEN_ROUTES:
            return await handler(request)
        authorization = request.headers.get("Authorization")
        tenant = self.keys.tenant_for(authorization)
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

    def server_salt(self, request: web.Request) -> str | None:
        """The cache salt the server assigns this request's tenant (key mode), else None."""
        return self.keys.salt_for(request[TENANT_KEY]) if self.keys is not None else None

    # ---- the routes -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serving.create_completion(request, self.server_salt(request))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serving.create_chat_completion(request, self.server_salt(request))

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.server_metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": self.model_name, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        # As vLLM's /health: 200 while the engine can serve, 503 once it cannot.
        if self.engine.is_alive():
            return web.Response(text="ok")
        reason = self.engine.dead_reason or "the engine loop thread is not running"
        return RequestFailed(reason, 503, "ServiceUnavailableError").response()

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        # vLLM's answer: {"success": bool}; False while requests hold blocks, unless
        # ?reset_running_requests=true, which preempts them first (they recompute).
        reset_running = request.query.get("reset_running_requests", "false").lower() in (
            "true", "1")
        ok = await asyncio.wrap_future(
            self.engine.submit(lambda: self.engine.engine.reset_prefix_cache(reset_running)))
        logger.info("reset_prefix_cache: %s", "done" if ok else "refused, blocks are in use")
        return web.json_response({"success": bool(ok)})


def build_app(llm: LLM, model_name: str | None = None,
              enable_prompt_tokens_details: bool = False,
              api_keys: dict[str, str] | None = None,
              salt_secret: bytes | None = None,
              dev_mode: bool = False,
              kv_cache_metrics: bool = True,
              kv_cache_metrics_sample: float = 1.0,
              max_num_queued_reqs: int | None = None) -> web.Application:
    """The server's aiohttp app. `api_keys` ({key: tenant}) turns on key mode, with the tenants'
    salts derived from `salt_secret` (a random one when None: see `kvlab.serve.tenants`). `dev_mode`
    adds vLLM's development routes (`VLLM_SERVER_DEV_MODE=1` in vLLM: `POST
    /reset_prefix_cache`, vllm/entrypoints/serve/dev/cache/api_router.py); off by default, as
    there: any client could wipe every tenant's cached prefixes. `kv_cache_metrics` times a
    `kv_cache_metrics_sample` fraction of KV blocks for the residency histograms (vLLM's
    `--kv-cache-metrics`, off by default there, sampling 0.01; on here, every block: the
    workshop's pools are small). `max_num_queued_reqs` (vLLM's `--max-num-queued-reqs`,
    vllm/config/scheduler.py): the most unfinished sequences at once, a request of n samples
    counting n; past it a request gets a 503 (`kvlab.serve.engine_client`); None: no limit, as in
    vLLM. A negative one raises ValueError."""
    max_num_queued_reqs = check_max_num_queued_reqs(max_num_queued_reqs)
    if api_keys is None and salt_secret is not None:
        raise ValueError("salt_secret is only used with api_keys (key mode)")
    keys = TenantKeys(api_keys, salt_secret) if api_keys is not None else None
    engine = AsyncEngine(llm, max_num_queued_reqs)
    name = model_name or llm.llm_engine.loaded.name
    engine.metrics = server_metrics = ServerMetrics(llm, name)
    pool = llm.llm_engine.kv_cache_manager.block_pool
    pool.metrics_collector = (KVCacheMetricsCollector(kv_cache_metrics_sample)
                              if kv_cache_metrics else None)
    serving = OpenAIServing(llm, engine, name, enable_prompt_tokens_details)
    server = ApiServer(engine, serving, server_metrics, name, keys)

    app = web.Application(middlewares=[server.authenticate] if keys is not None else [])
    if max_num_queued_reqs is not None:
        logger.info("admission: at most %d unfinished requests (n > 1 counts n); more get a 503",
                    max_num_queued_reqs)
    if keys is not None:
        logger.info("key mode: %d API keys for %d tenants; salt secret %s", keys.num_keys,
                    keys.num_tenants, "given" if keys.secret_source == "given" else
                    "random (salts, and so cached prefixes, do not survive a restart)")
    app.on_startup.append(server.on_startup)
    app.on_cleanup.append(server.on_cleanup)
    app[ENGINE_KEY] = engine
    server.add_routes(app, dev_mode)
    return app


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, **app_kwargs) -> None:
    """Run until interrupted. Loopback by default: this is a workshop server, not a service."""
    web.run_app(build_app(llm, **app_kwargs), host=host, port=port, handler_cancellation=True)

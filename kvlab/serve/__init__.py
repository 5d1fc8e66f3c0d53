"""`kvlab serve`: the engine behind an OpenAI-compatible HTTP server, under vLLM's names.

Built on the engine (`kvlab/`), never the other way round. The parts, each readable alone:

    cli.py            `kvlab serve ...`: vLLM's flag names mapped onto `LLM(...)`
    api_server.py     the HTTP app: routes and their handlers, key mode; `build_app` and `serve`
    protocol.py       request fields, their checks and parsing; the OpenAI-style error
    serving.py        completions and chat completions: JSON bodies, streams, logprobs
    tokenization.py   /tokenize, /detokenize and /version, in vLLM's shapes
    engine_client.py  the worker thread that steps the engine: adds, aborts, cache resets
    background.py     `BackgroundServer`: the server on a thread, for notebooks and tests
    prometheus.py     `/metrics` under vLLM's metric names
    tenants.py        API keys -> tenants -> cache salts (key mode)
"""

from kvlab.serve.api_server import build_app, serve
from kvlab.serve.background import BackgroundServer

__all__ = ["BackgroundServer", "build_app", "serve"]

"""`kvlab serve`: the engine behind an OpenAI-compatible HTTP server, under vLLM's names.

Built on the engine (`kvlab/`), never the other way round. The parts, each readable alone:

    cli.py          `kvlab serve ...`: vLLM's flag names mapped onto `LLM(...)`
    api_server.py   the HTTP app: routes and their handlers; `serve` and `BackgroundServer`
    prometheus.py   `/metrics` under vLLM's metric names
    tenants.py      API keys -> tenants -> cache salts (key mode)
"""

from kvlab.serve.api_server import BackgroundServer, build_app, serve

__all__ = ["BackgroundServer", "build_app", "serve"]

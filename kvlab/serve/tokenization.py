"""`/tokenize`, `/detokenize` and `/version`: vLLM's tokenizer routes and its version route.

Shapes as vLLM 0.33.0's (vllm/entrypoints/serve/tokenize/protocol.py and serving.py):

    POST /tokenize    {"prompt": "...", "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true,
                       "add_special_tokens": false, "return_token_strs": false}
                   -> {"count", "max_model_len", "tokens", "token_strs" (null unless asked)}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}
    GET  /version     -> {"version": ...}

The chat form renders `messages` exactly as /v1/chat/completions does (content parts included:
`kvlab.serve.protocol.Renderer`), so a client can count a conversation's prompt tokens before
sending it. `model`, when sent, must be the served name (404 otherwise, as vLLM). Fields are
checked as the generating routes check theirs: an unknown one is refused by name.

`/version` reports kvlab's own version (vLLM's route reports vLLM's,
vllm/entrypoints/serve/instrumentator/basic.py): kvlab mirrors vLLM 0.33.0's API, but a client
that reads the version to decide what a server can do must not take kvlab for a vLLM release.
"""

from __future__ import annotations

import json

from aiohttp import web

import kvlab
from kvlab.serve.protocol import (
    Renderer,
    RequestFailed,
    bad_request,
    check_fields,
    check_model,
    check_token_ids,
    read_body,
)


def bool_field(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be true or false, got {json.dumps(value)}", param=key)
    return value


class ServingTokenization:
    """The tokenizer routes over the server's Renderer (vLLM's ServingTokenization)."""

    def __init__(self, renderer: Renderer, model_name: str) -> None:
        self.renderer, self.model_name = renderer, model_name

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request)
            check_fields(body, "/tokenize")
            check_model(body, self.model_name)
            ids = self.token_ids(body)
            strs = bool_field(body, "return_token_strs", False)
        except RequestFailed as e:
            return e.response()
        token_strs = self.renderer.tokenizer.convert_ids_to_tokens(ids) if strs else None
        return web.json_response({"count": len(ids), "max_model_len": self.renderer.max_model_len,
                                  "tokens": ids, "token_strs": token_strs})

    def token_ids(self, body: dict) -> list[int]:
        """The completion form's prompt or the chat form's conversation, tokenized."""
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("send exactly one of 'prompt' (the completion form) or "
                              "'messages' (the chat form)", param="prompt")
        if "prompt" in body:
            if "add_generation_prompt" in body:
                raise bad_request("'add_generation_prompt' belongs to the chat form (with "
                                  "'messages')", param="add_generation_prompt")
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise bad_request("'prompt' must be a string", param="prompt")
            return self.renderer.encode(prompt, bool_field(body, "add_special_tokens", True))
        # vLLM's chat-form defaults: the generation prompt, and no special tokens beyond those
        # the template writes.
        return self.renderer.render_chat(body["messages"],
                                         bool_field(body, "add_generation_prompt", True),
                                         bool_field(body, "add_special_tokens", False))

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request)
            check_fields(body, "/detokenize")
            check_model(body, self.model_name)
            if "tokens" not in body:
                raise bad_request("'tokens' is required", param="tokens")
            ids = check_token_ids(body["tokens"], "tokens", self.renderer.vocab_size,
                                  param="tokens")
        except RequestFailed as e:
            return e.response()
        return web.json_response({"prompt": self.renderer.tokenizer.decode(ids)})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": kvlab.__version__})

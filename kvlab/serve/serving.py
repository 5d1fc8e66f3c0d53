"""/v1/completions and /v1/chat/completions: a request into the engine, its outputs back in
OpenAI's shapes (vLLM's `OpenAIServingCompletion` and `OpenAIServingChat`, as one class).

Responses as vLLM's (vllm/entrypoints/openai/completion/serving.py and
vllm/entrypoints/openai/chat_completion/serving.py): a chat stream opens with one chunk per
choice carrying `delta.role` "assistant"; `finish_reason` and vLLM's `stop_reason` (the stop
string or stop token id) per choice, `usage` (with `prompt_tokens_details.cached_tokens` under
`--enable-prompt-tokens-details`), and with `stream_options.continuous_usage_stats` the usage of
its prompt and choice so far in every chunk. A completions request with several prompts is one
engine request per prompt; its choices are numbered `prompt_i * n + sample` and its usage sums
them (vLLM reports the last prompt's cached tokens; kvlab the sum, to match prompt_tokens).
A streaming request asks the engine for `RequestOutputKind.DELTA` (each output holds only the
new text; the engine's incremental detokenizer never splits a character and holds back a
possible stop string) and a non-streaming one for `FINAL_ONLY` (one output, when it is done),
exactly as vLLM's serving layer does (`kvlab.serve.protocol.sampling_params`).

A request's arrival is stamped here, as its HTTP handler starts, and handed to the engine
(`LLMEngine.add_request(arrival_time=...)`): a request that waits for the worker to finish a
step has waited, and its TTFT says so (vLLM's API server stamps it too, before its engine
sees the request: AsyncLLM.add_request in vllm/v1/engine/async_llm.py has
vllm/v1/engine/input_processor.py stamp `time.time()`).

A request that fails in the engine gets an HTTP 500, or, once streaming (the 200 is sent), an
SSE `data: {"error": ...}` event then `data: [DONE]`. A client that disconnects has its request
aborted at once, which returns its blocks, and costs one log line (a normal event, not an error).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from itertools import islice

from aiohttp import web

from kvlab.engine import LLM
from kvlab.outputs import Logprob
from kvlab.serve.engine_client import AsyncEngine
from kvlab.serve.protocol import (
    GenerationRequest,
    Renderer,
    RequestFailed,
    bad_request,
    parse_request,
    read_body,
)

logger = logging.getLogger(__name__)


class OpenAIServing:
    """The two generating endpoints over one AsyncEngine: parse, add, answer, release."""

    def __init__(self, llm: LLM, engine: AsyncEngine, model_name: str,
                 enable_prompt_tokens_details: bool = False) -> None:
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.renderer = Renderer.for_llm(llm)
        self.token_text = TokenText(llm.get_tokenizer())

    async def create_completion(self, request: web.Request,
                                server_salt: str | None = None) -> web.StreamResponse:
        return await self.generate(request, chat=False, server_salt=server_salt)

    async def create_chat_completion(self, request: web.Request,
                                     server_salt: str | None = None) -> web.StreamResponse:
        return await self.generate(request, chat=True, server_salt=server_salt)

    async def generate(self, request: web.Request, chat: bool,
                       server_salt: str | None) -> web.StreamResponse:
        """`server_salt`: the tenant's cache salt in key mode, None when the client picks it."""
        arrival = time.perf_counter()  # before the body is read: the client has sent it
        try:
            body = await read_body(request)
            req = parse_request(body, request.path, chat, self.model_name, self.renderer,
                                server_salt)
            rids = await self.engine.add_requests(req.prompts, req.params, arrival,
                                                  req.priority)
        except RequestFailed as e:
            return e.response()
        except (ValueError, TypeError) as e:
            # The engine's own checks, in kvlab's words; parse_request makes every one of them
            # first in the API's terms, so reaching this means it missed one.
            logger.warning("the engine refused a request that passed the protocol's checks: %s",
                           e)
            return bad_request(f"the engine refused the request: {e}").response()
        try:
            if req.stream:
                return await self.stream_response(request, rids, req)
            return await self.full_response(rids, req)
        except asyncio.CancelledError:
            # The client hung up (aiohttp cancels its handler): a normal event, one line; its
            # requests are aborted below, which returns their blocks.
            logger.info("client went away during %s", response_id(rids))
            raise
        finally:
            self.engine.release(rids)  # aborts the requests if the client went away

    def prompt_text(self, req: GenerationRequest, index: int, out) -> str:
        """The text of prompt `index` for echo: as sent, or its token ids decoded (vLLM's)."""
        if req.prompt_texts[index] is not None:
            return req.prompt_texts[index]
        return out.prompt if out.prompt is not None else self.llm.get_tokenizer().decode(
            out.prompt_token_ids)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return usage(prompt_tokens, completion_tokens, cached_tokens,
                     self.enable_prompt_tokens_details)

    def echoed(self, req: GenerationRequest, index: int, out, text: str, ids: list,
               entries: list) -> tuple[str, list, list]:
        """A completion's text, token ids and logprob entries with its prompt before them
        (vLLM's echo); with max_tokens 0, the prompt's alone (the token the engine sampled is
        not shown, though usage counts it, as vLLM's does)."""
        prompt_ids = list(out.prompt_token_ids)
        prompt_entries = list(out.prompt_logprobs or [None] * len(prompt_ids))
        prompt = self.prompt_text(req, index, out)
        if req.echo_only:
            return prompt, prompt_ids, prompt_entries
        return prompt + text, [*prompt_ids, *ids], [*prompt_entries, *(entries or [])]

    # ---- one JSON body, when the request is done -----------------------------------------------
    async def full_response(self, rids: list[str], req: GenerationRequest) -> web.Response:
        finals: list = [None] * len(rids)
        try:
            async for index, out in self.engine.outputs(rids):  # FINAL_ONLY: one each, at the end
                finals[index] = out
        except RequestFailed as e:
            return e.response()
        chat, k, token_text, n = req.chat, req.params.logprobs, self.token_text, req.params.n
        choices, completion = [], 0
        for index, out in enumerate(finals):
            plp = prompt_logprobs_json(token_text, out.prompt_logprobs)
            for o in sorted(out.outputs, key=lambda o: o.index):
                completion += len(o.token_ids)
                logprobs = None
                if chat:
                    if k is not None:
                        logprobs = chat_logprobs(token_text, o.token_ids, o.logprobs, k)
                    piece = {"message": {"role": "assistant", "content": o.text}}
                else:
                    text, ids, entries = o.text, o.token_ids, o.logprobs
                    if req.echo:
                        text, ids, entries = self.echoed(req, index, out, text, ids, entries)
                    if k is not None:
                        logprobs = completion_logprobs(token_text, ids, entries, k)
                    piece = {"text": text, "prompt_logprobs": plp}
                choices.append({"index": index * n + o.index, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason, "logprobs": logprobs, **piece})
        return web.json_response({
            "id": response_id(rids), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": choices,
            "usage": self.usage(sum(len(o.prompt_token_ids) for o in finals), completion,
                                sum(o.num_cached_tokens for o in finals)),
            **({"prompt_logprobs": prompt_logprobs_json(token_text, finals[0].prompt_logprobs)}
               if chat else {})})

    # ---- server-sent events, as the engine steps -----------------------------------------------
    async def stream_response(self, request: web.Request, rids: list[str],
                              req: GenerationRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        try:
            return await self.write_stream(request, resp, rids, req)
        except ConnectionResetError:  # a write found the connection closed: the client left
            logger.info("client went away during %s", response_id(rids))
            return resp

    async def write_stream(self, request: web.Request, resp: web.StreamResponse,
                           rids: list[str], req: GenerationRequest) -> web.StreamResponse:
        chat, k, token_text, n = req.chat, req.params.logprobs, self.token_text, req.params.n
        rid, created = response_id(rids), int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        prompt_lens = [len(p["prompt_token_ids"]) for p in req.prompts]
        await resp.prepare(request)

        def chunk(index: int, finish_reason, stop_reason, piece: dict, logprobs=None,
                  tokens_so_far: int | None = None) -> bytes:
            event = {"id": rid, "object": kind, "created": created, "model": self.model_name,
                     "choices": [{"index": index, "finish_reason": finish_reason,
                                  "stop_reason": stop_reason, "logprobs": logprobs, **piece}]}
            if req.continuous_usage:  # vLLM's continuous_usage_stats: this choice's so far
                event["usage"] = usage(prompt_lens[index // n], tokens_so_far or 0, 0, False)
            return sse(event)

        if chat:
            # As OpenAI and vLLM: the stream opens with the role, one chunk per choice.
            for i in range(n):
                await resp.write(chunk(i, None, None, {"delta": {"role": "assistant",
                                                                 "content": ""}}))
        tokens: dict[int, int] = {}  # per choice index, for usage
        cached = [0] * len(rids)  # per prompt, for usage
        finished: set[int] = set()
        # Tokens whose text is held back (a partial stop string or character) wait here with
        # their logprobs, and go out with the text they make.
        pending: dict[int, tuple[list, list]] = {}
        offsets: dict[int, int] = {}  # per choice: characters sent so far (text_offset)
        try:
            # DELTA: each output holds only the completions that changed in this step, each with
            # only its new text and token ids.
            async for index, out in self.engine.outputs(rids):
                cached[index] = out.num_cached_tokens
                for o in out.outputs:
                    i = index * n + o.index  # the choice's index (vLLM's numbering)
                    tokens[i] = tokens.get(i, 0) + len(o.token_ids)
                    if i in finished:
                        continue
                    ids, entries = pending.setdefault(i, ([], []))
                    ids += o.token_ids
                    entries += o.logprobs or []
                    if not o.text and o.finish_reason is None:
                        continue  # e.g. a partial stop string or character held back
                    if o.finish_reason is not None:
                        finished.add(i)  # each choice's finish_reason is sent once
                    text = o.text
                    if req.echo and i not in offsets:  # the prompt goes out first
                        text, ids, entries = self.echoed(req, index, out, text, ids, entries)
                    logprobs = None
                    if k is not None:
                        logprobs = (chat_logprobs(token_text, ids, entries, k) if chat else
                                    completion_logprobs(token_text, ids, entries, k,
                                                        offsets.get(i, 0)))
                    offsets[i] = offsets.get(i, 0) + len(text)
                    pending[i] = ([], [])
                    piece = {"delta": {"content": text}} if chat else {"text": text}
                    await resp.write(chunk(i, o.finish_reason, o.stop_reason, piece, logprobs,
                                           tokens[i]))
            if req.include_usage:
                await resp.write(sse({
                    "id": rid, "object": kind, "created": created, "model": self.model_name,
                    "choices": [],
                    "usage": self.usage(sum(prompt_lens), sum(tokens.values()), sum(cached))}))
        except RequestFailed as e:
            # The status line (200) is long gone: the error travels as an event, as in vLLM.
            await resp.write(sse(e.body()))
        await resp.write(b"data: [DONE]\n\n")
        return resp


def response_id(rids: list[str]) -> str:
    """The id an answer carries: its engine requests' common one (`cmpl-7` for `cmpl-7-0`...)."""
    return rids[0] if len(rids) == 1 else rids[0].rsplit("-", 1)[0]


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

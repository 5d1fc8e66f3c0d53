"""The OpenAI protocol of `kvlab serve`: which request fields exist, how a body is checked and
turned into prompts and `SamplingParams`, and the error every refusal is sent as.

Request fields (the tables `SUPPORTED_FIELDS` and `UNSUPPORTED_FIELDS` below are the reference):

* Implemented: `prompt` (a string, a list of strings, token ids, or a list of token-id lists:
  one choice per prompt and sample, `index = prompt_i * n + sample`, as
  vllm/entrypoints/openai/completion/serving.py) or `messages` (each `content` a string or a
  list of OpenAI text parts, `[{"type": "text", "text": ...}]`, joined with newlines as vLLM
  joins them for a template that takes strings; image, audio and file parts are refused: the
  model reads text only); `max_tokens` (chat also `max_completion_tokens`; default 16; 0 only
  with `echo`, which then returns the prompt alone, vLLM's echo without generation),
  `temperature`, `top_p`, `n`, `seed`, `stop` (a string or up to 4 strings), `stream` and
  `stream_options` (`include_usage`, and vLLM's `continuous_usage_stats`: usage in every
  chunk); vLLM's extras `top_k`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
  `skip_special_tokens` and `cache_salt` (refused in key mode: `kvlab.serve.api_server`).
  Logprobs as vLLM serves them: completions' `logprobs` (an int: top alternatives per token)
  and `echo` (the prompt, and with `logprobs` its tokens' logprobs, before the completion),
  chat's `logprobs` (a bool) and `top_logprobs`, and vLLM's `prompt_logprobs` (not with
  `stream`, as vLLM). A request asking for prompt logprobs computes its whole prompt: it does not
  read the prefix cache (vLLM's `skip_reading_prefix_cache`, vllm/sampling_params.py). `model`,
  when sent, must be the served name (else 404 "The model `x` does not exist.", as
  vllm/entrypoints/serve/engine/serving.py); `user` is a tag, accepted and unused.
* Refused with a 400 that names the field: every other OpenAI field (and a few vLLM extras) that
  kvlab does not implement, e.g. chat's `echo`, `suffix`, `frequency_penalty`,
  `logit_bias`, `tools`, `response_format`, `min_p`, unless sent at its "off" value (null, 0,
  false, empty, `best_of` equal to `n`, `response_format` {"type": "text"}); and any field name
  that is neither OpenAI's nor kvlab's. vLLM ignores unknown fields with a log warning; kvlab
  refuses them, so a workshop participant who types `max_token` sees the typo instead of a
  silently different answer.

Prompts are tokenized here, in the HTTP layer (vLLM renders them in its API server too, with
the model's tokenizer and chat template: vllm/renderers/hf.py), so every check, the prompt's
length and token ids included, runs before anything touches the engine: a bad request costs the
engine nothing. Errors take vLLM's ErrorResponse shape: {"error": {"message", "type", "param",
"code"}}, `param` naming the field in the API's terms.
"""

from __future__ import annotations

import difflib
import json
import numbers
from dataclasses import dataclass

from aiohttp import web

from kvlab.sampling import RequestOutputKind, SamplingParams

# ---- request fields: the one table that the docs and the tests read -----------------------------
# Passed to SamplingParams under the same (vLLM's) names.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
                   "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                   "skip_special_tokens")
# model: must name the served model when sent (else 404, as vLLM); user: a tag, unused (vLLM
# ignores it too). prompt_logprobs: vLLM's extra (not with stream, as vLLM refuses).
_COMMON_FIELDS = (*SAMPLING_FIELDS, "stream", "stream_options", "cache_salt",
                  "model", "user", "logprobs", "prompt_logprobs", "priority")
# Every field kvlab implements, per endpoint.
SUPPORTED_FIELDS: dict[str, tuple[str, ...]] = {
    # logprobs: an int (top logprobs per token); echo: the prompt before the completion.
    "/v1/completions": ("prompt", "echo", *_COMMON_FIELDS),
    # OpenAI's current name for max_tokens in chat; it wins when both are sent (as in vLLM).
    # logprobs: a bool; top_logprobs: how many alternatives per token.
    "/v1/chat/completions": ("messages", "max_completion_tokens", "top_logprobs",
                             *_COMMON_FIELDS),
    # vLLM's tokenizer routes (vllm/entrypoints/serve/tokenize/protocol.py): `prompt` (the
    # completion form) or `messages` (the chat form, with add_generation_prompt).
    "/tokenize": ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                  "return_token_strs"),
    "/detokenize": ("model", "tokens"),
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
    "request_id": (None,),
}
MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")
# Chat content parts (vllm/renderers/chat_utils/chat_message.py): the text ones, each with the key
# that holds its text, and those that carry media, which a text-only model cannot read.
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
                  "refusal": "refusal"}
MEDIA_PART_TYPES = ("image_url", "input_image", "image", "image_embeds", "input_audio",
                    "audio_url", "audio", "video_url", "video", "file", "input_file")
# Message keys besides role and content: `name` (a participant's name: accepted, and unused by
# the chat template, whatever its value: None here), and those an OpenAI client sends back from
# an earlier answer (a chat completion's `message` object), accepted at their "off" values.
MESSAGE_NOOPS = {"name": None, "refusal": (None,), "tool_calls": (None, []),
                 "function_call": (None,), "audio": (None,), "annotations": (None, [])}


# ---- errors -------------------------------------------------------------------------------------
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


def unauthorized(message: str) -> web.Response:
    """A 401 in kvlab's (OpenAI's) error shape; vLLM's middleware answers `{"error":
    "Unauthorized"}`. The message never quotes what the client sent."""
    response = RequestFailed(message, 401, "AuthenticationError").response()
    response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme the server expects
    return response


# vLLM's QueueOverflowError (vllm/exceptions.py): a GracefulHTTPError, which vLLM's
# create_error_response (vllm/entrypoints/serve/exception_handling/error_response.py) answers
# with its own status, the status's phrase as `type` and no `param`. The message is the wire
# string vLLM sends, kept identical so that a client (or a load balancer's rule) that reads it
# reads kvlab's the same way.
QUEUE_OVERFLOW_MESSAGE = ("The engine is currently busy and cannot accept new requests. "
                          "Please try again later or on a different instance.")


def queue_overflow() -> RequestFailed:
    """The 503 a request gets when admitting it would pass `--max-num-queued-reqs`: an overload,
    not a failure, so the client may retry here later or at another server."""
    return RequestFailed(QUEUE_OVERFLOW_MESSAGE, 503, "Service Unavailable")


def check_max_num_queued_reqs(value) -> int | None:
    """vLLM's `max_num_queued_reqs` (vllm/config/scheduler.py): None (no limit) or an int >= 0
    (0 refuses every request). Raises ValueError otherwise, naming the flag."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"--max-num-queued-reqs (max_num_queued_reqs) must be an integer >= 0, "
                         f"or unset for no limit; got {value!r}")
    return int(value)


def jinja_errors():
    """The chat template's own errors (a malformed conversation) are the client's fault too."""
    try:
        from jinja2 import TemplateError

        return TemplateError
    except ImportError:  # pragma: no cover
        return ValueError


# ---- the model's side of parsing: tokenizer and chat template -----------------------------------
class Renderer:
    """The tokenizer and chat template as the HTTP layer uses them, with the limits a prompt is
    checked against (vLLM's API server renders prompts the same way before its engine sees
    them: vllm/renderers/hf.py)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len

    @classmethod
    def for_llm(cls, llm) -> "Renderer":
        engine = llm.llm_engine
        return cls(llm.get_tokenizer(), engine.vocab_size, engine.config.max_model_len)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(self, messages, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
        """The conversation's token ids. The template is rendered to text, then tokenized
        without special tokens (the template writes its own), as vLLM's chat route does; a
        template's refusal (roles out of order, say) is the client's 400."""
        conversation = parse_messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
        except jinja_errors() as e:
            raise bad_request(f"the model's chat template refused these messages: {e}",
                              param="messages")
        return self.encode(text, add_special_tokens=add_special_tokens)


# ---- a request, parsed --------------------------------------------------------------------------
@dataclass
class GenerationRequest:
    """What the serving layer needs of a checked /v1/completions or /v1/chat/completions body."""

    chat: bool
    # The engine's prompt inputs, one per prompt: {"prompt_token_ids", "cache_salt"?}.
    prompts: list[dict]
    prompt_texts: list[str | None]  # each prompt's text when it was sent as text (for echo)
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage in every chunk too
    echo: bool  # completions' echo: the prompt goes out before the completion
    echo_only: bool  # echo with max_tokens 0: the prompt alone (vLLM's echo without generation)
    # vLLM's `priority` extra (vllm/entrypoints/openai/completion/protocol.py): the order under
    # --scheduling-policy priority, lower first; no effect under fcfs, as in vLLM.
    priority: int = 0


async def read_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("the body is not valid JSON")
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != "" and model != model_name:
        # vLLM's answer (vllm/entrypoints/serve/engine/serving.py, _check_model).
        raise RequestFailed(f"The model `{model}` does not exist. Valid aliases: {model_name}.",
                            404, "NotFoundError", "model")


def parse_request(body: dict, endpoint: str, chat: bool, model_name: str, renderer: Renderer,
                  server_salt: str | None) -> GenerationRequest:
    """Check `body` and turn it into a GenerationRequest. `server_salt` is the tenant's salt in
    key mode (the client may then not send one), None otherwise. Raises RequestFailed (a 400
    naming the field, or the 404 for another model)."""
    check_fields(body, endpoint)
    check_model(body, model_name)
    if chat:
        if "messages" not in body:
            raise bad_request("'messages' is required", param="messages")
        texts = [None]
        ids = [renderer.render_chat(body["messages"])]
    else:
        texts, ids = parse_prompts(body.get("prompt"), renderer)
    salt = cache_salt(body, server_salt)
    prompts = [{"prompt_token_ids": t, **({"cache_salt": salt} if salt else {})} for t in ids]
    stream, include_usage, continuous_usage = stream_flags(body)
    params, echo_only = sampling_params(body, chat, stream)
    return GenerationRequest(chat=chat, prompts=prompts, prompt_texts=texts, params=params,
                             stream=stream, include_usage=include_usage,
                             continuous_usage=continuous_usage,
                             echo=not chat and bool(body.get("echo")), echo_only=echo_only,
                             priority=priority_field(body))


def priority_field(body: dict) -> int:
    value = body.get("priority", 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request("'priority' must be an integer", param="priority")
    return value


def cache_salt(body: dict, server_salt: str | None) -> str | None:
    salt = body.get("cache_salt")
    if server_salt is not None:
        if salt is not None:
            # The value is not quoted back: it may be someone else's salt.
            raise bad_request(
                "'cache_salt' cannot be sent to this server: it assigns each API key's "
                "tenant its own salt (leave the field out)", param="cache_salt")
        return server_salt
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("'cache_salt' must be a non-empty string (leave it out for no salt)",
                          param="cache_salt")
    return salt


# ---- the checks ---------------------------------------------------------------------------------
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


def _is_token_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def parse_prompts(value, renderer: Renderer) -> tuple[list[str | None], list[list[int]]]:
    """Completions' `prompt` in any of OpenAI's four forms: (texts, token ids), one per prompt,
    each checked against the vocabulary and max_model_len."""
    if value is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        items = value
    elif isinstance(value, list) and value and all(_is_token_id(x) for x in value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(x, list) for x in value):
        items = value
    elif isinstance(value, list) and not value:
        raise bad_request("'prompt' is empty", param="prompt")
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids "
                          "or a list of lists of token ids", param="prompt")
    texts, ids = [], []
    for i, item in enumerate(items):
        name = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"'{name}' is empty", param="prompt")
            tokens = renderer.encode(item)
        else:
            tokens = check_token_ids(item, name, renderer.vocab_size)
        if not tokens:
            raise bad_request(f"'{name}' has no tokens", param="prompt")
        if len(tokens) >= renderer.max_model_len:
            raise bad_request(
                f"'{name}' has {len(tokens)} tokens; this server's max_model_len is "
                f"{renderer.max_model_len}, which leaves no room to generate: shorten it",
                param="prompt")
        texts.append(item if isinstance(item, str) else None)
        ids.append(tokens)
    return texts, ids


def check_token_ids(value, name: str, vocab_size: int, param: str = "prompt") -> list[int]:
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise bad_request(f"'{name}' must be a list of token ids (integers)", param=param)
    for t in value:
        if not 0 <= t < vocab_size:
            raise bad_request(f"'{name}' holds token id {t}, outside the vocabulary "
                              f"[0, {vocab_size})", param=param)
    return [int(t) for t in value]


def parse_messages(messages) -> list[dict]:
    """Chat `messages` as the template takes them: {"role", "content": str} each, a content
    given as parts joined with newlines (vLLM's rule for a template that takes strings)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'",
                              param="messages")
        for key, value in message.items():
            if key in ("role", "content"):
                continue
            if key not in MESSAGE_NOOPS:
                raise bad_request(f"unknown field '{where}.{key}' (a message has 'role', "
                                  "'content' and optionally 'name')", param="messages")
            noops = MESSAGE_NOOPS[key]
            if noops is not None and not _is_noop(value, noops):
                raise bad_request(f"'{where}.{key}' is not supported by kvlab (tools and audio "
                                  "are not served): leave it out", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"'{where}.role' must be a non-empty string", param="messages")
        conversation.append({"role": role, "content": message_text(message.get("content"),
                                                                   where)})
    return conversation


def message_text(content, where: str) -> str:
    if content is None:  # an assistant message may have none (OpenAI allows null)
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or a list of content parts",
                          param="messages")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"'{at}' must be a content part such as "
                              '{"type": "text", "text": "..."}', param="messages")
        kind = part.get("type", "text")
        if kind in MEDIA_PART_TYPES:
            raise bad_request(f"'{at}' is an '{kind}' part: kvlab serves a text-only model, "
                              "so only text parts are accepted", param="messages")
        if kind not in TEXT_PART_KEYS:
            raise bad_request(f"'{at}' has an unknown type {json.dumps(kind)} (text parts are "
                              '{"type": "text", "text": "..."})', param="messages")
        text = part.get(TEXT_PART_KEYS[kind])
        if not isinstance(text, str):
            raise bad_request(f"'{at}.{TEXT_PART_KEYS[kind]}' must be a string",
                              param="messages")
        texts.append(text)
    return "\n".join(texts)


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


def max_tokens_field(body: dict, chat: bool, echo: bool) -> tuple[int, bool]:
    """(max_tokens for the engine, echo_only). 0 is accepted only with echo: vLLM then runs the
    prompt, samples one token and returns the prompt alone (its CompletionRequest's
    echo_without_generation), which is how scoring clients ask for a text's loglikelihood."""
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = body.get(key)
    if value is None:
        return 16, False
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {json.dumps(value)}", param=key)
    if value == 0 and echo:
        return 1, True
    if value < 1:
        raise bad_request(f"'{key}' must be at least 1, got {value} (0 is accepted only with "
                          "\"echo\": true, which returns the prompt alone)", param=key)
    return value, False


def sampling_params(body: dict, chat: bool, stream: bool) -> tuple[SamplingParams, bool]:
    """(SamplingParams, echo_only) for a checked body."""
    kwargs = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    echo = body.get("echo")
    if not chat and echo is not None and not isinstance(echo, bool):
        raise bad_request("'echo' must be true or false", param="echo")
    kwargs["max_tokens"], echo_only = max_tokens_field(body, chat, not chat and bool(echo))
    kwargs["logprobs"], kwargs["prompt_logprobs"] = logprob_fields(body, chat, stream)
    stop = kwargs.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                          param="stop")
    # As vLLM's serving layer: a stream wants only what is new at each step; a plain request
    # wants one output at the end (no text decoded along the way unless stop strings need it).
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**kwargs), echo_only
    except (TypeError, ValueError) as e:
        # SamplingParams' own checks, each message opening with the field's (vLLM's) name.
        message = str(e)
        field = next((f for f in SAMPLING_FIELDS if message.startswith(f)), None)
        raise bad_request(message, param=field)


def stream_flags(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage), with vLLM's rules for stream_options
    (vllm/entrypoints/serve/utils/api_utils.py, should_include_usage: usage in every chunk only
    when the last chunk carries it too)."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
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
    # include_obfuscation (OpenAI) pads chunks against a side channel; kvlab never pads, and
    # either value gets the same text, so it is accepted.
    include_usage = bool(options.get("include_usage"))
    return stream, include_usage, include_usage and bool(options.get("continuous_usage_stats"))

"""Checking what callers pass in, before any engine state changes.

A prompt is a str, {"prompt": str} or {"prompt_token_ids": [int, ...]}, optionally with
"cache_salt": str, as in vLLM's offline API.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


@dataclass(frozen=True)
class ParsedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None


def parse_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int) -> ParsedPrompt:
    """Validate one prompt and tokenize it; raise TypeError/ValueError saying what to change."""
    cache_salt = None
    if isinstance(prompt, str):
        text, token_ids = prompt, None
    elif isinstance(prompt, dict):
        unknown = set(prompt) - set(PROMPT_KEYS)
        if unknown:
            raise ValueError(f"unknown prompt keys {sorted(unknown)}; allowed: {PROMPT_KEYS}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"'prompt' must be a str, got {type(text).__name__}")
        if "cache_salt" in prompt:
            cache_salt = prompt["cache_salt"]
            if not isinstance(cache_salt, str):
                raise TypeError(f"'cache_salt' must be a str, got {type(cache_salt).__name__}")
            if not cache_salt:
                raise ValueError("'cache_salt' must not be empty (omit it for no salt)")
    else:
        raise TypeError(
            f"a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {type(prompt).__name__}"
        )

    if token_ids is None:
        if not text:
            raise ValueError("the prompt is empty")
        token_ids = tokenizer(text).input_ids
    else:
        if not isinstance(token_ids, (list, tuple)):
            raise TypeError(f"'prompt_token_ids' must be a list of ints, got {type(token_ids).__name__}")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"'prompt_token_ids' must hold ints, found {t!r}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {vocab_size})")
        token_ids = [int(t) for t in token_ids]
    if not token_ids:
        raise ValueError("the prompt has no tokens")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens; max_model_len={max_model_len} leaves no "
            "room to generate: shorten the prompt or raise max_model_len"
        )
    return ParsedPrompt(text, token_ids, cache_salt)

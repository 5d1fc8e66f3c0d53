"""Incremental detokenization and stop strings: token ids in, streamable text out.

The design follows vLLM's `vllm/v1/engine/detokenizer.py` (classes `IncrementalDetokenizer`,
`FastIncrementalDetokenizer`, `SlowIncrementalDetokenizer` and `check_stop_strings`) and the
offset algorithm of `vllm/tokenizers/detokenizer_utils.py` (`detokenize_incrementally`).

Why not simply `tokenizer.decode(output_ids)` after every step?
  * Cost. Re-decoding the whole output each step is O(n) per token and O(n^2) per request. Here
    each step decodes only a small window around the new token, so a step costs O(new tokens).
  * Characters do not line up with tokens. A byte-level BPE (GPT-2, Llama 3, SmolLM2) or a
    byte-fallback SentencePiece model may spell one character with several tokens: "🙂" is the
    four UTF-8 bytes F0 9F 99 82 and can arrive as two or three tokens. Decoding after the first
    of them gives a broken byte sequence, which decodes to U+FFFD ("�"). Streaming that "�" and
    later "taking it back" is impossible, so an incremental detokenizer must *wait* until a
    character is complete before emitting it.
  * Context matters. Some decoders treat the start of the text specially: SentencePiece's
    Metaspace decoder drops the "▁" (space) of the very first token, so `decode([▁world])` is
    "world" while the same token after "Hello" is " world". Decoding a new token on its own
    would lose that space, so it is always decoded after a little left context (the prompt's
    last tokens for the first output token).

Two interchangeable detokenizers implement the `_decode_next` step:
  * `FastIncrementalDetokenizer`: for transformers tokenizers backed by a Rust
    `tokenizers.Tokenizer`. The Rust `tokenizers.decoders.DecodeStream` does the windowing,
    primed with the prompt ids so the first output token gets its context.
  * `SlowIncrementalDetokenizer`: pure Python, for anything else with `convert_ids_to_tokens`
    and `convert_tokens_to_string`. It keeps two offsets into a short list of token strings:
        tokens[prefix_offset:read_offset]  the context: already emitted, decoded again only so
                                           the next token is not decoded "at the start of text";
        tokens[read_offset:]               not emitted yet (the new token, plus any earlier ones
                                           still waiting for the rest of their character).
    Each step decodes tokens[prefix_offset:] and emits what it adds to the decoded context, unless
    that ends in "�" (a character still incomplete: wait for more tokens). After emitting, the
    window slides: the old read_offset becomes the prefix_offset and read_offset moves to the end.

The shared base class adds what vLLM's `BaseIncrementalDetokenizer` adds on top:
  * stop strings, checked only over the text new this step plus the `len(stop) - 1` characters
    before it that a stop string could straddle (so again O(new tokens), not O(output));
  * the stop buffer: while a request runs, `get_next_output_text` holds back the last
    `len(longest stop string) - 1` characters when stop strings are excluded from the output.
    Those characters could be the beginning of a stop string ("STO" of "STOP"); streaming them
    and then discovering the stop string would mean retracting text a client already printed.

One deliberate difference from vLLM: when a request finishes with a character still incomplete
(say `max_tokens` cut an emoji in half), vLLM silently drops those bytes. Here
`get_next_output_text(finished=True, ...)` flushes them as a one-shot decode would ("�"), so the
streamed text always equals `detokenize(tokenizer, output_token_ids)` when no stop string or stop
token cut the output, and offline and streaming requests agree.
"""

from __future__ import annotations

from bisect import bisect_left

import tokenizers
import tokenizers.decoders

__all__ = [
    "FastIncrementalDetokenizer",
    "IncrementalDetokenizer",
    "SlowIncrementalDetokenizer",
    "backend_tokenizer",
    "detokenize",
]

# The message tokenizers' DecodeStream raises when a decoder's output is not monotonic (see
# vLLM issue #17448); the stream is then restarted without context rather than failing the request.
_INVALID_PREFIX_ERR = "Invalid prefix encountered"

# The slow path primes its window with the prompt's last tokens: this many serve as left context
# for the first output token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET), plus two spare
# in case some of them are special tokens that skip_special_tokens removes.
_PROMPT_CONTEXT_TOKENS = 5
_PROMPT_SPARE_TOKENS = 2


def backend_tokenizer(tokenizer) -> tokenizers.Tokenizer | None:
    """The Rust `tokenizers.Tokenizer` behind `tokenizer` (or `tokenizer` itself), else None."""
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    for name in ("_tokenizer", "backend_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, tokenizers.Tokenizer):
            return backend
    return None


def detokenize(tokenizer, token_ids, skip_special_tokens: bool = True) -> str:
    """Decode a whole output once (for a request whose text is needed only at the end).

    Gives exactly the text the incremental detokenizers build step by step: for a fast tokenizer
    it calls the same Rust decoder DecodeStream uses, and it never applies transformers'
    `clean_up_tokenization_spaces` (incremental decoding cannot: the cleanup rewrites text
    across token boundaries after the fact, and vLLM does not apply it either).
    """
    ids = list(token_ids)
    backend = backend_tokenizer(tokenizer)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _drop_last_chars(parts: list[str], n: int) -> None:
    """Remove the last `n` characters from a text held as a list of pieces, in O(pieces touched)."""
    while n > 0 and parts:
        last = parts.pop()
        if len(last) > n:
            parts.append(last[: len(last) - n])
            return
        n -= len(last)


class IncrementalDetokenizer:
    """Turns one request's generated ids into text, step by step, and watches for stop strings.

    Create with `from_request`; call `update` once per engine step with the ids that step
    produced; read the text with `get_next_output_text` (or `output_text`).

    The text is kept as a list of pieces rather than one growing string: `text += piece` copies
    the whole text every step, which would make a step O(output length) again.
    """

    def __init__(self, params) -> None:
        stop = getattr(params, "stop", None)
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        self.stop: list[str] = list(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.include_stop_str_in_output = bool(getattr(params, "include_stop_str_in_output", False))
        self.skip_special_tokens = bool(getattr(params, "skip_special_tokens", True))

        # How many trailing characters to hold back from a running stream (see the module doc).
        # When the stop string is included in the output nothing is ever retracted, so no buffer.
        max_stop_len = max((len(s) for s in self.stop), default=0)
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max_stop_len - 1
        else:
            self.stop_buffer_length = 0
        # A stop string completed by new text starts at most this far back into the old text.
        self._stop_overlap = max(max_stop_len - 1, 0)

        self._token_ids: list[int] = []
        self._chunks: list[str] = []  # the output text, in pieces ("".join is output_text)
        self._text_len = 0
        self._unsent: list[str] = []  # the text after what delta=True calls have returned
        self._unsent_len = 0
        self._tail = ""  # the last `_stop_overlap` characters of the text, for straddling matches
        self._finished = False  # a stop string matched, or the request was flushed as finished

    @classmethod
    def from_request(
        cls, tokenizer, prompt_token_ids: list[int], params, *, use_fast: bool | None = None
    ) -> IncrementalDetokenizer:
        """The detokenizer for a new request: the DecodeStream one when `tokenizer` has a Rust
        backend, else the pure-Python offset one. `use_fast=False` forces the Python one (for
        tests and for comparing the two); `use_fast=True` requires a Rust backend."""
        if use_fast is None:
            use_fast = backend_tokenizer(tokenizer) is not None
        if use_fast:
            return FastIncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, params)

    # -- what subclasses provide --------------------------------------------------------------

    def _decode_next(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still incomplete)."""
        raise NotImplementedError

    def _flush_pending(self) -> str:
        """The text of tokens still held back, decoded as they are (incomplete bytes as "�")."""
        raise NotImplementedError

    # -- the engine's interface ---------------------------------------------------------------

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids

    def num_output_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def output_text(self) -> str:
        if len(self._chunks) > 1:  # join lazily, only when somebody asks for the whole text
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Detokenize this step's ids, then look for a stop string. Returns the one matched.

        `stop_terminated`: the last id ended the request as a stop token (EOS, stop_token_ids).
        Its text is left out of the output unless include_stop_str_in_output, but the id stays in
        `output_token_ids`, as in vLLM.
        """
        if self._finished:
            raise RuntimeError("update() after the request finished (stop string or flush)")
        if not new_token_ids:
            return None
        ids = list(new_token_ids)
        skipped_stop_token = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token = ids.pop()  # not decoded at all, but kept in output_token_ids

        first_new = len(self._token_ids)
        # offsets[i]: the text length once the first i new tokens are decoded. With several
        # tokens in one step (speculative decoding, a test feeding chunks) it says which token
        # completed a stop string, so the ids after it can be dropped.
        offsets = [self._text_len]
        pieces: list[str] = []
        length = self._text_len
        for token_id in ids:
            self._token_ids.append(token_id)
            piece = self._decode_next(token_id)
            if piece:
                pieces.append(piece)
                length += len(piece)
            offsets.append(length)
        if skipped_stop_token is not None:
            self._token_ids.append(skipped_stop_token)
            offsets.append(length)

        new_text = "".join(pieces)
        if not new_text:
            return None
        self._append_text(new_text)
        if not self.stop:
            return None

        match = self._find_stop(new_text)
        if match is None:
            return None
        stop_str, start = match
        end = start + len(stop_str)
        # Keep ids up to the one whose text completed the stop string; the rest never "happened".
        num_kept = bisect_left(offsets, end, lo=1)
        del self._token_ids[first_new + num_kept :]
        keep = end if self.include_stop_str_in_output else start
        cut = self._text_len - keep
        _drop_last_chars(self._chunks, cut)
        # The cut never reaches text already streamed: with the stop string excluded, the stop
        # buffer held back every character a stop string could start at (see the module doc).
        _drop_last_chars(self._unsent, cut)
        self._unsent_len = max(self._unsent_len - cut, 0)
        self._text_len = keep
        self._finished = True
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text (delta=False) or only what is new since the last delta=True call.

        While not finished, the stop buffer's characters are held back. `finished=True` releases
        them, and first flushes any bytes of a character that will now never be completed.
        """
        if finished and not self._finished:
            self._finished = True
            rest = self._flush_pending()
            if rest:
                self._append_text(rest)
        hold = 0 if finished else self.stop_buffer_length
        if not delta:
            text = self.output_text
            return text[: max(len(text) - hold, 0)] if hold else text
        n = self._unsent_len - hold
        if n <= 0:
            return ""
        unsent = "".join(self._unsent)
        out, rest = unsent[:n], unsent[n:]
        self._unsent = [rest] if rest else []
        self._unsent_len = len(rest)
        return out

    # -- helpers ------------------------------------------------------------------------------

    def _append_text(self, text: str) -> None:
        self._chunks.append(text)
        self._unsent.append(text)
        self._text_len += len(text)
        self._unsent_len += len(text)

    def _find_stop(self, new_text: str) -> tuple[str, int] | None:
        """The stop string that completes earliest in the new text, and where it starts.

        Searches only `tail + new_text`, where tail is the few old characters a stop string could
        straddle. The earliest *end* wins, so feeding several tokens at once stops exactly where
        feeding them one by one would; ties go to the stop string listed first (as vLLM).
        """
        window = self._tail + new_text
        base = self._text_len - len(window)  # where window[0] sits in the whole text
        best: tuple[str, int] | None = None
        best_end = len(window) + 1
        for stop_str in self.stop:
            # Start late enough that the match ends inside the new text (older text was searched
            # by earlier steps already).
            i = window.find(stop_str, max(len(self._tail) - len(stop_str) + 1, 0))
            if i != -1 and i + len(stop_str) < best_end:
                best, best_end = (stop_str, base + i), i + len(stop_str)
        if self._stop_overlap:
            self._tail = window[-self._stop_overlap :]
        return best


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """Incremental decoding by the Rust `tokenizers.decoders.DecodeStream`.

    DecodeStream runs the prefix/read offset algorithm (see SlowIncrementalDetokenizer) in Rust:
    `step(tokenizer, id)` returns the new text, or None while a character is incomplete (or the
    token adds nothing, e.g. a skipped special token). Priming it with the prompt ids gives the
    first output token its left context.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params) -> None:
        super().__init__(params)
        backend = backend_tokenizer(tokenizer)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no Rust tokenizers backend")
        self.tokenizer: tokenizers.Tokenizer = backend
        prompt = [int(i) for i in prompt_token_ids]
        # Looked up on the module at call time, as vLLM does, so a patched DecodeStream is used.
        self._stream = tokenizers.decoders.DecodeStream(
            ids=prompt, skip_special_tokens=self.skip_special_tokens
        )
        # For the flush at the end: the ids DecodeStream has not turned into text yet, and the
        # last id before them that it did (the left context to decode them after).
        self._pending_ids: list[int] = []
        self._context_id: int | None = prompt[-1] if prompt else None

    def _decode_next(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self.tokenizer, token_id)
        except (OverflowError, TypeError):
            return ""  # not a valid token id (negative, too large): it decodes to nothing
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            # The decoder produced text that does not extend what it produced before, which
            # breaks DecodeStream's "subtract the prefix" step. Restart without context.
            self._stream = tokenizers.decoders.DecodeStream(
                skip_special_tokens=self.skip_special_tokens
            )
            piece = self._stream.step(self.tokenizer, token_id)
        if piece is None:
            self._pending_ids.append(token_id)
            return ""
        self._pending_ids.clear()
        self._context_id = token_id
        return piece

    def _flush_pending(self) -> str:
        if not self._pending_ids:
            return ""
        skip = self.skip_special_tokens
        if self._context_id is None:
            return self.tokenizer.decode(self._pending_ids, skip_special_tokens=skip)
        head = self.tokenizer.decode([self._context_id], skip_special_tokens=skip)
        full = self.tokenizer.decode(
            [self._context_id, *self._pending_ids], skip_special_tokens=skip
        )
        if full.startswith(head):
            return full[len(head) :]
        return self.tokenizer.decode(self._pending_ids, skip_special_tokens=skip)


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Incremental decoding in Python with the prefix/read offsets (see the module doc).

    Needs `convert_ids_to_tokens(ids, skip_special_tokens=...)` and
    `convert_tokens_to_string(tokens)`, i.e. the two halves of transformers' own `decode`.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params) -> None:
        super().__init__(params)
        self.tokenizer = tokenizer
        # Only the prompt's last few tokens matter: they are the context of the first output token.
        tail = list(prompt_token_ids)[-(_PROMPT_CONTEXT_TOKENS + _PROMPT_SPARE_TOKENS) :]
        self._tokens: list[str] = [t for i in tail if (t := self._to_token(i)) is not None]
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)
        self._prefix_text = self._to_text(self._tokens[self._prefix_offset :])

    def _to_token(self, token_id: int) -> str | None:
        """The token string, or None when it adds no text (skipped special token, invalid id)."""
        if token_id < 0:
            return None
        tokens = self.tokenizer.convert_ids_to_tokens(
            [token_id], skip_special_tokens=self.skip_special_tokens
        )
        if isinstance(tokens, str):
            tokens = [tokens]
        return tokens[0] if tokens and tokens[0] is not None else None

    def _to_text(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def _decode_next(self, token_id: int) -> str:
        token = self._to_token(token_id)
        if token is None:
            return ""
        self._tokens.append(token)
        # Decode context + everything not yet emitted; only this short window, never the output.
        text = self._to_text(self._tokens[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            # Nothing new, or the last character still misses bytes: keep the tokens pending.
            return ""
        piece = text[len(self._prefix_text) :]
        # Slide the window: what was just emitted becomes the context for the next token, and
        # older tokens are forgotten, so the window (and memory) stays a few tokens long.
        del self._tokens[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        self._prefix_text = self._to_text(self._tokens)
        return piece

    def _flush_pending(self) -> str:
        if self._read_offset >= len(self._tokens):
            return ""
        text = self._to_text(self._tokens[self._prefix_offset :])
        if text.startswith(self._prefix_text):
            return text[len(self._prefix_text) :]
        return self._to_text(self._tokens[self._read_offset :])

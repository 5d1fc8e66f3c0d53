"""kvlab.detokenizer: incremental text equals a one-shot decode, and stop strings behave as vLLM's.

Tokenizer only (no model forward). Every behaviour is checked on both paths: the Rust
DecodeStream one ("fast") and the pure-Python prefix/read offset one ("slow", reached through a
tokenizer object that has no Rust backend, as a Python-only tokenizer would be).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvlab.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    detokenize,
)
from kvlab.model import load_model

MODES = ("fast", "slow")
TEXTS = [
    "Hello world, how are you today? Fine, thanks.",
    "🙂👍🏽",
    "family: 👨‍👩‍👧 and 👩🏾‍💻!",
    "漢字かな混じり文",
    "Mixed: café, naïve, 漢字 🙂 — «quotes» ½ ∑ x² 👍🏽done",
]
ALPHABET = "ab Z.,\n\t é漢字かな🙂👍🏽\u200d👨👩👧½∑—«»"
HYPOTHESIS = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class PythonTokenizer:
    """A tokenizer without a Rust backend (no `_tokenizer` / `backend_tokenizer`): it decodes the
    way transformers' Python tokenizers do, convert_ids_to_tokens then convert_tokens_to_string."""

    def __init__(self, tok, record: list[int] | None = None):
        self._tok = tok
        self.record = record  # lengths of the token lists converted to text, when given

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return self._tok.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens):
        if self.record is not None:
            self.record.append(len(tokens))
        return self._tok.convert_tokens_to_string(tokens)

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return self._tok.convert_tokens_to_string(
            self.convert_ids_to_tokens(list(ids), skip_special_tokens=skip_special_tokens)
        )


@pytest.fixture(scope="module")
def tok():
    return load_model().tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def params(**kw):
    return SimpleNamespace(**kw)


def tokenizer_for(tok, mode: str):
    return tok if mode == "fast" else PythonTokenizer(tok)


def make(tok, mode, prompt=(), **kw) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer.from_request(tokenizer_for(tok, mode), list(prompt), params(**kw))
    cls = FastIncrementalDetokenizer if mode == "fast" else SlowIncrementalDetokenizer
    assert isinstance(d, cls)
    return d


def chunked(ids, sizes=None, seed=None):
    """`ids` split into chunks: one id each, or random sizes 1..4 from `seed`."""
    if seed is None:
        return [[i] for i in ids]
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(d, chunks, stop_terminated_last=False):
    """Feed `chunks`, collecting delta=True text after every step and at the finish.

    Checks on the way what a streaming client relies on: the streamed text only grows (it is
    always a prefix of the text so far, nothing is retracted) and it never shows a "\\ufffd" the
    final text does not have. Returns (deltas, stop string matched or None)."""
    deltas, matched = [], None
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        matched = d.update(chunk, stop_terminated_last and last)
        finished = last or matched is not None
        deltas.append(d.get_next_output_text(finished=finished, delta=True))
        assert d.output_text.startswith("".join(deltas))
        if matched is not None:
            break
    if not chunks:
        deltas.append(d.get_next_output_text(finished=True, delta=True))
    final = d.output_text
    assert "".join(deltas) == final
    if "\ufffd" not in final:
        assert not any("\ufffd" in x for x in deltas)
    return deltas, matched


# -- deltas add up to the one-shot decode --------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_deltas_concatenate_to_decode(tok, mode, text, seed):
    ids = encode(tok, text)
    d = make(tok, mode)
    deltas, matched = stream(d, chunked(ids, seed=seed))
    assert matched is None
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=True)
    assert d.output_text == detokenize(tokenizer_for(tok, mode), ids) == text
    assert d.output_token_ids == ids


@pytest.mark.parametrize("mode", MODES)
def test_multibyte_characters_wait_until_complete(tok, mode):
    ids = encode(tok, "👍🏽")
    assert len(ids) > 2  # several byte-level tokens per character: the point of the test
    d = make(tok, mode)
    deltas = []
    for i in ids:
        d.update([i], False)
        deltas.append(d.get_next_output_text(finished=False, delta=True))
    assert "".join(deltas) == "👍🏽"
    assert "" in deltas  # some tokens completed no character and emitted nothing
    assert all(x in ("", "👍", "🏽") for x in deltas)


@pytest.mark.parametrize("mode", MODES)
@HYPOTHESIS
@given(text=st.text(alphabet=ALPHABET, max_size=40), seed=st.integers(0, 2**16))
def test_property_random_strings(tok, mode, text, seed):
    ids = encode(tok, text)
    d = make(tok, mode, prompt=encode(tok, "Say:"))
    deltas, _ = stream(d, chunked(ids, seed=seed))
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == d.output_text == expected == detokenize(tokenizer_for(tok, mode), ids)


@pytest.mark.parametrize("mode", MODES)
@HYPOTHESIS
@given(data=st.data())
def test_property_random_token_ids(tok, mode, data):
    # Special tokens 0-2 plus the ordinary vocabulary (3-16 are added tokens the Rust decoder
    # counts as special but transformers' convert_ids_to_tokens does not: not our concern here).
    token = st.one_of(st.integers(0, 2), st.integers(17, len(tok) - 1))
    ids = data.draw(st.lists(token, max_size=30))
    assume("\ufffd" not in tok.decode(ids, skip_special_tokens=True))  # decodes to valid text
    seed = data.draw(st.integers(0, 2**16))
    d = make(tok, mode)
    deltas, _ = stream(d, chunked(ids, seed=seed))
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=True)
    assert d.output_text == detokenize(tokenizer_for(tok, mode), ids)


@pytest.mark.parametrize("mode", MODES)
@HYPOTHESIS
@given(data=st.data())
def test_property_any_token_ids(tok, mode, data):
    # No filter: ids 17..999 are mostly bare bytes and pieces, so many sequences hold broken
    # UTF-8. Deltas still add up to the one-shot decode ("\ufffd" and all), and no "\ufffd" is
    # streamed for a character that a later token completes.
    token = st.one_of(st.integers(17, 999), st.integers(17, len(tok) - 1))
    ids = data.draw(st.lists(token, max_size=30))
    d = make(tok, mode)
    deltas, _ = stream(d, chunked(ids, seed=data.draw(st.integers(0, 2**16))))
    assert "".join(deltas) == d.output_text == detokenize(tokenizer_for(tok, mode), ids)


@pytest.mark.parametrize("mode", MODES)
def test_cut_character_is_flushed_at_finish_like_a_one_shot_decode(tok, mode):
    ids = encode(tok, "ok 👍🏽")[:-1]  # max_tokens cut the skin tone modifier in half
    d = make(tok, mode)
    running = []
    for i in ids:
        d.update([i], False)
        running.append(d.get_next_output_text(finished=False, delta=True))
    assert "".join(running) == "ok 👍"  # the incomplete character is never streamed
    tail = d.get_next_output_text(finished=True, delta=True)
    assert "".join(running) + tail == d.output_text == detokenize(tok, ids)
    assert tail.startswith("\ufffd")


# -- context from the prompt ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("out", [" 42, 🙂 done", "!", " 漢字"])
def test_prompt_priming(tok, mode, out):
    prompt, ids = encode(tok, "The answer is"), encode(tok, out)
    d = make(tok, mode, prompt=prompt)
    deltas, _ = stream(d, chunked(ids))
    whole, head = tok.decode(prompt + ids), tok.decode(prompt)
    assert whole.startswith(head)
    assert "".join(deltas) == whole[len(head) :] == out


@pytest.fixture(scope="module")
def metaspace_tok():
    """A tiny SentencePiece-style tokenizer whose decoder drops the space of the first token:
    there, the first output token's space only survives with the prompt as context."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "!": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


@pytest.mark.parametrize("mode", MODES)
def test_prompt_priming_keeps_the_leading_space(metaspace_tok, mode):
    t = metaspace_tok
    assert t.decode([3, 4]) == "world!" and t.decode([2, 3, 4]) == "Hello world!"
    primed = IncrementalDetokenizer.from_request(t, [2], params(), use_fast=mode == "fast")
    primed.update([3], False)
    primed.update([4], False)
    assert primed.get_next_output_text(finished=True, delta=True) == " world!"
    unprimed = IncrementalDetokenizer.from_request(t, [], params(), use_fast=mode == "fast")
    unprimed.update([3, 4], False)
    assert unprimed.output_text == "world!" == detokenize(t, [3, 4])


# -- stop strings --------------------------------------------------------------------------------

SENTENCE = "Hello world, how are you?"  # Hello| world|,| how| are| you|?


def run_stop(tok, mode, text, stop, include=False, seed=None):
    ids = encode(tok, text)
    d = make(tok, mode, stop=stop, include_stop_str_in_output=include)
    _, matched = stream(d, chunked(ids, seed=seed))
    return d, ids, matched


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [None, 3])
def test_stop_inside_one_token(tok, mode, seed):
    d, ids, matched = run_stop(tok, mode, SENTENCE, ["orl"], seed=seed)
    assert matched == "orl"
    assert d.output_text == "Hello w"
    assert d.output_token_ids == ids[:2]  # " world" completed the match; later ids dropped


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [None, 3])
def test_stop_straddling_two_tokens(tok, mode, seed):
    d, ids, matched = run_stop(tok, mode, SENTENCE, ["lo wo"], seed=seed)
    assert matched == "lo wo"
    assert d.output_text == "Hel"
    assert d.output_token_ids == ids[:2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("include", [False, True])
def test_several_stops_earliest_completion_wins(tok, mode, include):
    ids = encode(tok, SENTENCE)
    for stop, want, kept in [
        (["you", "how", "world"], "world", 2),  # listed last, but completes first
        (["world", "ld"], "world", 2),  # both complete with " world": the first listed wins
        (["ld", "world"], "ld", 2),
        (["are", ", how"], ", how", 4),
    ]:
        d = make(tok, mode, stop=stop, include_stop_str_in_output=include)
        assert d.update(ids, False) == want  # all ids in one step, as speculative decoding would
        upto = SENTENCE.index(want) + (len(want) if include else 0)
        assert d.output_text == SENTENCE[:upto]
        assert d.output_token_ids == ids[:kept]
        one_by_one = make(tok, mode, stop=stop, include_stop_str_in_output=include)
        _, matched = stream(one_by_one, chunked(ids))
        assert matched == want
        assert one_by_one.output_text == d.output_text
        assert one_by_one.output_token_ids == d.output_token_ids


@pytest.mark.parametrize("mode", MODES)
def test_include_stop_str_in_output(tok, mode):
    d, ids, matched = run_stop(tok, mode, SENTENCE, ["orl"], include=True)
    assert matched == "orl"
    assert d.output_text == "Hello worl"
    assert d.output_token_ids == ids[:2]
    d, ids, matched = run_stop(tok, mode, SENTENCE, [" how"], include=True, seed=5)
    assert d.output_text == "Hello world, how"
    assert d.output_token_ids == ids[:4]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [None, 7, 8])
def test_partial_stop_string_is_never_streamed(tok, mode, seed):
    text = "The STOP sign. STOP now and more"
    ids = encode(tok, text)
    d = make(tok, mode, stop=["STOP now"])
    assert d.stop_buffer_length == len("STOP now") - 1
    streamed = ""
    for chunk in chunked(ids, seed=seed):
        matched = d.update(chunk, False)
        streamed += d.get_next_output_text(finished=matched is not None, delta=True)
        if matched is None:
            # The last len("STOP now") - 1 characters are held back while the request runs.
            assert len(streamed) == max(len(d.output_text) - d.stop_buffer_length, 0)
            assert d.get_next_output_text(finished=False, delta=False) == streamed
        assert "STOP n" not in streamed
        if matched is not None:
            break
    assert matched == "STOP now"
    assert streamed == d.output_text == "The STOP sign. "


@pytest.mark.parametrize("mode", MODES)
def test_held_back_text_is_flushed_when_finished(tok, mode):
    ids = encode(tok, "Hello wor")
    d = make(tok, mode, stop=["world!"])
    assert d.update(ids, False) is None
    assert d.get_next_output_text(finished=False, delta=True) == "Hell"  # 5 chars held back
    assert d.get_next_output_text(finished=False, delta=False) == "Hell"
    assert d.get_next_output_text(finished=True, delta=True) == "o wor"
    assert d.get_next_output_text(finished=True, delta=True) == ""
    assert d.get_next_output_text(finished=True, delta=False) == "Hello wor"


@pytest.mark.parametrize("mode", MODES)
def test_no_buffer_when_stop_string_is_included(tok, mode):
    d = make(tok, mode, stop=["world!"], include_stop_str_in_output=True)
    assert d.stop_buffer_length == 0
    d.update(encode(tok, "Hello wor"), False)
    assert d.get_next_output_text(finished=False, delta=True) == "Hello wor"


@pytest.mark.parametrize("mode", MODES)
def test_stop_param_forms(tok, mode):
    ids = encode(tok, SENTENCE)
    for stop in (None, [], ()):
        d = make(tok, mode, stop=stop)
        assert d.update(ids, False) is None and d.output_text == SENTENCE
    d = make(tok, mode, stop="how")  # a single string
    assert d.update(ids, False) == "how"
    assert d.output_text == "Hello world, "
    with pytest.raises(ValueError):
        make(tok, mode, stop=[""])
    with pytest.raises(RuntimeError):
        d.update(ids, False)  # the request already finished


# -- stop tokens and special tokens --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_eos(tok, mode, skip, include):
    eos = tok.eos_token_id
    ids = encode(tok, "Hi there") + [eos]
    d = make(tok, mode, skip_special_tokens=skip, include_stop_str_in_output=include)
    d.update(ids[:-2], False)
    assert d.update(ids[-2:], True) is None
    assert d.output_token_ids == ids  # the stop token stays in the ids
    eos_text = tok.convert_ids_to_tokens(eos) if include and not skip else ""
    assert d.get_next_output_text(finished=True, delta=False) == "Hi there" + eos_text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_ordinary_stop_token(tok, mode, include):
    ids = encode(tok, "Hi there.")  # "." used as a stop_token_ids entry
    d = make(tok, mode, include_stop_str_in_output=include)
    deltas, _ = stream(d, chunked(ids), stop_terminated_last=True)
    assert d.output_token_ids == ids
    assert "".join(deltas) == d.output_text == ("Hi there." if include else "Hi there")


@pytest.mark.parametrize("mode", MODES)
def test_skip_special_tokens(tok, mode):
    ids = [1] + encode(tok, "user\nHi") + [2] + encode(tok, " done")
    kept = make(tok, mode, skip_special_tokens=False)
    deltas, _ = stream(kept, chunked(ids))
    assert "".join(deltas) == "<|im_start|>user\nHi<|im_end|> done"
    assert kept.output_text == tok.decode(ids, skip_special_tokens=False)
    assert kept.output_text == detokenize(tokenizer_for(tok, mode), ids, skip_special_tokens=False)
    skipped = make(tok, mode)
    deltas, _ = stream(skipped, chunked(ids, seed=4))
    assert "".join(deltas) == "user\nHi done" == tok.decode(ids, skip_special_tokens=True)


# -- dispatch and cost ---------------------------------------------------------------------------


def test_dispatch(tok):
    new = IncrementalDetokenizer.from_request
    assert isinstance(new(tok, [], params()), FastIncrementalDetokenizer)
    assert isinstance(new(tok.backend_tokenizer, [], params()), FastIncrementalDetokenizer)
    assert isinstance(new(tok, [], params(), use_fast=False), SlowIncrementalDetokenizer)
    assert isinstance(new(PythonTokenizer(tok), [], params()), SlowIncrementalDetokenizer)
    with pytest.raises(TypeError):
        new(PythonTokenizer(tok), [], params(), use_fast=True)


def test_slow_path_decodes_a_short_window_not_the_whole_output(tok):
    record: list[int] = []
    ids = encode(tok, " ".join(TEXTS) * 20)
    prompt = encode(tok, "A long prompt. " * 50)
    d = IncrementalDetokenizer.from_request(PythonTokenizer(tok, record), prompt, params())
    for i in ids:
        d.update([i], False)
    assert len(ids) > 500
    assert d.get_next_output_text(finished=True, delta=False) == tok.decode(ids)
    assert max(record) <= 10  # a few tokens of context + the pending ones, whatever the length

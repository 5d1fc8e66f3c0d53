"""Chapter 04's prefill rate: the fastest of a few repeats per length, so that one busy moment
does not drag the rate down, and the fastest decode-only step. A stand-in engine replays set
step times, so no model runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlab.bench import scheduling


class _FakeLLM:
    """Replays step times: each generate() appends its steps to the trace, a prefill step of
    the prompt's length, then (max_tokens - 1) decode steps."""

    prefill_times: dict[int, list[float]] = {}  # length -> forward times, consumed in order

    def __init__(self, *args, **kwargs):
        self.llm_engine = SimpleNamespace(num_steps=0, step_trace=[])

    def get_tokenizer(self):
        return None

    def _step(self, prefill: int, decode: int, step_time: float, forward_time: float) -> None:
        engine = self.llm_engine
        engine.num_steps += 1
        engine.step_trace.append(SimpleNamespace(
            step=engine.num_steps, num_prefill_tokens=prefill, num_decode_tokens=decode,
            step_time=step_time, forward_time=forward_time))

    def generate(self, prompt, params):
        n = len(prompt["prompt_token_ids"])
        if params.max_tokens == 1:
            t = self.prefill_times[n].pop(0)
            self._step(n, 0, t + 0.001, t)
        else:
            self._step(n, 0, 0.5, 0.5)
            for i in range(params.max_tokens - 1):
                self._step(0, 1, 0.030 + 0.002 * (i % 3), 0.028)


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(scheduling, "LLM", _FakeLLM)
    monkeypatch.setattr(scheduling, "make_prompts", lambda tok, k, lo, hi: [[7] * lo] * k)
    return _FakeLLM


def test_each_length_keeps_its_fastest_repeat(fake_engine):
    # 100 tokens: warm-up 9 s, then 0.2 s, a busy 0.9 s and 0.2 s; 300 tokens: 0.6, 0.6, 0.6.
    fake_engine.prefill_times = {100: [9.0, 0.2, 0.9, 0.2], 300: [0.6, 0.6, 0.6]}
    rate = scheduling.prefill_rate((100, 300), repeats=3)
    assert rate["points"] == [(100, 0.2), (300, 0.6)]  # the busy repeat and the warm-up dropped
    assert rate["tokens_per_s"] == 500.0  # 400 tokens in 0.8 s
    assert rate["decode_step_s"] == pytest.approx(0.030)  # the fastest decode-only step


def test_one_repeat_is_the_old_measurement_and_zero_is_refused(fake_engine):
    fake_engine.prefill_times = {128: [1.0, 0.25]}
    rate = scheduling.prefill_rate((128,), repeats=1)
    assert rate["points"] == [(128, 0.25)] and rate["tokens_per_s"] == 512.0
    with pytest.raises(ValueError, match="at least 1"):
        scheduling.prefill_rate((128,), repeats=0)

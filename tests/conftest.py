"""Shared fixtures: the packaged model (loaded once per session) and transformers references."""

from __future__ import annotations

import functools

import pytest
import torch

from kvlab import load_model
from kvlab.bench import BENCH_TEXT


@pytest.fixture(scope="session")
def loaded():
    return load_model()


@pytest.fixture(scope="session")
def text_ids(loaded):
    """A long deterministic token sequence to slice prompts from."""
    return loaded.tokenizer(BENCH_TEXT * 12).input_ids


@pytest.fixture(scope="session")
def hf_greedy(loaded):
    """transformers `generate` (greedy, exactly n new tokens) on the same weights, memoised."""

    @functools.lru_cache(maxsize=None)
    def run(prompt: tuple[int, ...], n: int) -> list[int]:
        with torch.inference_mode():
            out = loaded.hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=loaded.tokenizer.eos_token_id,
            )
        return out[0, len(prompt):].tolist()

    return lambda prompt, n: run(tuple(prompt), n)

"""Chapter 00: generation without a KV cache and with one, on the same weights.

Without a cache, every new token runs the model over the whole sequence so far (prompt and
every token generated), because the keys and values of the past are thrown away after each
forward. With one, the first forward (the prefill) keeps every layer's keys and values, and
each later forward (a decode) computes one token and attends to the kept ones. Both use
transformers' own model, greedy, so the only difference is the cache: the tokens must be
identical, and the time per token tells the cost of recomputing.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings

import torch


@contextlib.contextmanager
def _quiet_cache_argument():
    """transformers 5.24 warns that `past_key_values` is renamed `cache` (removal in 5.40);
    older 5.x, the GPU machine's 5.17 among them, know only the old name, so it stays, and the
    notice (a FutureWarning and one log line) is kept out of the notebook."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)


def _greedy(model, prompt_ids: list[int], max_tokens: int, use_cache: bool):
    """Greedy tokens, each token's seconds and how many positions its forward computed."""
    seq = torch.tensor([prompt_ids])
    tokens, seconds, positions = [], [], []
    cache = None
    with torch.inference_mode(), _quiet_cache_argument():
        for _ in range(max_tokens):
            t0 = time.perf_counter()
            if use_cache:
                step = seq if cache is None else seq[:, -1:]  # the prefill, then one token
                out = model(step, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
            else:
                step = seq  # everything, again
                out = model(step, use_cache=False)
            nxt = int(out.logits[0, -1].argmax())
            seconds.append(time.perf_counter() - t0)
            positions.append(step.shape[1])
            tokens.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return tokens, seconds, positions


def with_and_without_cache(loaded, prompt_ids: list[int], max_tokens: int) -> dict:
    """Both runs on `loaded.hf_model`, one after the other (run alone: another torch job on
    the same cores slows either run). Returns, per run ("no cache", "KV cache"): tokens,
    seconds per token and positions computed per token; and the ratio of the last eight
    tokens' median time to the first eight's (a median, so one slow step moves nothing)."""
    if max_tokens < 16:
        raise ValueError(f"max_tokens must be at least 16 (two groups of eight), got {max_tokens}")
    model = loaded.hf_model
    _greedy(model, prompt_ids[:4], 2, True)  # warm-up: first-call allocations
    runs = {}
    for name, use_cache in (("no cache", False), ("KV cache", True)):
        tokens, seconds, positions = _greedy(model, prompt_ids, max_tokens, use_cache)
        # Token 0 is the prefill in both runs; the growth is read from the decodes after it.
        first = statistics.median(seconds[1:9])
        last = statistics.median(seconds[-8:])
        runs[name] = {"tokens": tokens, "seconds": seconds, "positions": positions,
                      "first_ms": 1000 * first, "last_ms": 1000 * last,
                      "growth": last / first, "total_s": sum(seconds),
                      "positions_computed": sum(positions)}
    return runs

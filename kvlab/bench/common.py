"""What every benchmark shares: prompts, the timing protocol, transformers as a peer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

BENCH_TEXT = (
    "The KV cache stores the keys and values of every past token so that each new token attends "
    "to them without recomputing. Serving engines such as vLLM split it into fixed-size blocks, "
    "share blocks between sequences, and schedule requests at every step. "
)


def make_prompts(tokenizer, num_prompts: int, min_len: int, max_len: int) -> list[list[int]]:
    """Distinct prompts with lengths spread evenly over [min_len, max_len] (deterministic)."""
    base = tokenizer(BENCH_TEXT * (max_len // 20 + 2)).input_ids
    prompts = []
    for i in range(num_prompts):
        length = min_len + (max_len - min_len) * i // max(num_prompts - 1, 1)
        start = (7 * i) % 40  # different offsets, so no two prompts are the same
        prompts.append(base[start : start + length])
    return prompts


@dataclass
class Timing:
    name: str
    median_s: float
    min_s: float
    max_s: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s


def time_runs(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first-call allocations and kernel selection are not the steady state
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def transformers_generate(hf_model, prompts: list[list[int]], max_tokens: int, pad_id: int):
    """Greedy `generate` on a left-padded batch: static batching, transformers' default path."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    dev = hf_model.device
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id,
        )
    return [row[width:].tolist() for row in out]


def mixed_workload(tokenizer, num_requests: int, input_lens=(64, 128), output_lens=(96, 128)):
    """Prompts and greedy SamplingParams with lengths spread over the two ranges, shuffled
    against each other (deterministic): the mixed-length workload of chapters 03 and 07."""
    from kvlab.sampling import SamplingParams

    n = num_requests
    spread = lambda lo, hi, i, k: lo + (hi - lo) * ((k * i) % n) // max(n - 1, 1)  # noqa: E731
    lens_in = [spread(*input_lens, i, 5) for i in range(n)]
    lens_out = [spread(*output_lens, i, 3) for i in range(n)]
    base = make_prompts(tokenizer, n, max(input_lens), max(input_lens))
    prompts = [p[:k] for p, k in zip(base, lens_in)]
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in lens_out]
    return prompts, params, lens_out

"""`SamplingParams` and the sampler that turns logits into next tokens.

Defined in notebook 00 (greedy and seeded sampling); `n` and beam search are the subject of 02.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from kvlab.config import check_bool, check_int


@dataclass
class SamplingParams:
    """How to pick each next token, with vLLM's names and defaults where they make sense offline.

    temperature 0 is greedy (argmax); top_k -1 or 0 and top_p 1.0 switch those filters off; a
    seed makes a request's random stream reproducible whatever else runs beside it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, minimum=1)
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, minimum=-1)
        check_int("seed", self.seed, minimum=0, allow_none=True)
        check_int("n", self.n, minimum=1)
        check_bool("ignore_eos", self.ignore_eos)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for tok in self.stop_token_ids:
            check_int("stop_token_ids[i]", tok, minimum=0)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if value != value:  # NaN compares unequal to itself
        raise ValueError(f"{name} must not be NaN")


def sample(
    logits: torch.Tensor,  # (B, V) logits of the last position of each sequence
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row. Greedy rows take the argmax; the others sample with their own
    generator, so a seeded request draws the same tokens whatever batch it shares."""
    tokens = logits.argmax(dim=-1).tolist()  # greedy for every row, in one call
    for i, sp in enumerate(params):
        if not sp.greedy:
            tokens[i] = _sample_row(logits[i], sp, generators[i])
    return tokens


def _sample_row(logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator) -> int:
    logits = logits.float() / sp.temperature  # (V,)
    if sp.top_k > 0 and sp.top_k < logits.numel():
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[mass_before >= sp.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))

"""`SamplingParams` and the `Sampler` that turns one step's logits into next tokens.

Defined in notebook 00 (greedy and seeded sampling); `n` and beam search are the subject of 02.

Two vLLM files are mirrored here, in our own words:

* `vllm/sampling_params.py`: the knobs, their defaults and their validation rules (the
  temperature clamp, seed == -1 meaning "no seed", stop strings, logprobs, output kinds).
* `vllm/v1/sample/sampler.py` and `vllm/v1/sample/ops/topk_topp_sampler.py`: how a whole batch
  is sampled at once. Every row's temperature, top-k and top-p become tensors, the filters are
  masks over the (B, V) logits, and the draw is the "exponential trick" (argmax of probs / q
  with q ~ Exp(1)), which, unlike `torch.multinomial`, needs no host round trip. The only
  per-row Python work is drawing q for rows that bring their own seeded generator.
"""

from __future__ import annotations

import enum
import math
import numbers
import warnings
from dataclasses import dataclass, field

import torch

from kvlab.config import check_bool, check_int

# From `vllm/sampling_params.py`: a temperature below _SAMPLING_EPS means greedy; a positive one
# below _MIN_TEMPERATURE (vLLM calls it _MAX_TEMP) is raised to it, because logits / 1e-40
# overflow float32 to inf, and softmax of inf - inf is NaN.
_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2

# The seeds vLLM's OpenAI server accepts: a signed 64-bit int (`Field(ge=_INT64_MIN,
# le=_INT64_MAX)` in vllm/entrypoints/openai/completion/protocol.py). kvlab checks the same range
# offline, so a seed too large fails here, not as an overflow deep inside a step.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request holds, as in `vllm/sampling_params.py`.

    CUMULATIVE: every output holds everything generated so far (the default).
    DELTA: each output holds only what is new since the previous one (streaming).
    FINAL_ONLY: no intermediate outputs; one output when the request finishes. Offline
    `LLM.generate` uses FINAL_ONLY: nobody is watching the tokens arrive.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick each next token, with vLLM's names and defaults where they make sense offline.

    temperature below 1e-5 (0 in practice) is greedy (argmax); top_k -1 or 0 and top_p 1.0
    switch those filters off; a seed makes a request's random stream reproducible whatever else
    runs beside it. Rules follow `vllm/sampling_params.py`.

    The dataclass is mutable, so validation lives in `verify()`, which `__post_init__` runs and
    the engine runs again before it queues a request: `sp.temperature = -1` after construction
    is caught there, before any state changes. `verify()` is idempotent (it may normalise values,
    e.g. clamp a tiny temperature or turn seed -1 into None, but a second run changes nothing).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # A signed 64-bit int, or None; -1 also means None (vLLM's rule). Sample i of n draws from
    # seed + i, which torch.Generator.manual_seed accepts: its range is [-2**63, 2**64 - 1]
    # (negative seeds are taken modulo 2**64), so 2**63 - 1 + i cannot overflow for any
    # realistic n. Beware: a CPU generator (mt19937) keeps only the low 32 bits of its seed, so
    # on CPU seeds s and s + 2**32 give the same stream; CUDA's Philox keeps all 64.
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # Strings that end generation when they appear in the text (not included unless
    # include_stop_str_in_output). A str, a list of non-empty str, or None; stored as a list.
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # drop special tokens (e.g. <|im_end|>) from the text
    detokenize: bool = True  # False: token ids only, no text (then stop strings cannot work)
    # Top logprobs to return per generated token, besides the sampled token's own (so up to
    # logprobs + 1 entries); 0 returns the sampled token's alone; None returns none.
    logprobs: int | None = None
    # Logprobs of every prompt token but the first (what the model predicted at each position),
    # with the top `prompt_logprobs` ids beside it; None: none. Chapter 05: such a request
    # computes its whole prompt, so it does not read the prefix cache (below).
    prompt_logprobs: int | None = None
    # vLLM's rule (vllm/sampling_params.py, __post_init__): None means "skip when prompt
    # logprobs are asked for", since a prefix-cache hit leaves its positions without logits.
    # It may still write the cache: the blocks it computes are keyed for others.
    skip_reading_prefix_cache: bool | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every field; raise TypeError/ValueError naming the field and the fix."""
        check_int("max_tokens", self.max_tokens, minimum=1)
        _check_real("temperature", self.temperature)
        if math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.temperature > 2:  # vLLM's range: vllm/sampling_params.py refuses more
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if 0 < self.temperature < _MIN_TEMPERATURE:
            # vLLM logs the same warning and clamps: dividing logits by a temperature this small
            # overflows to inf (NaN after softmax). So every positive temperature ends up >= 0.01
            # and samples (nearly greedily); only 0 is below _SAMPLING_EPS, i.e. greedy.
            warnings.warn(
                f"temperature {self.temperature} is less than {_MIN_TEMPERATURE}, which may "
                f"cause NaN or inf in tensors; raised it to {_MIN_TEMPERATURE} (as vLLM does). "
                "Use temperature=0 for greedy decoding.",
                stacklevel=3,
            )
            self.temperature = _MIN_TEMPERATURE
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, minimum=-1)
        check_int("seed", self.seed, allow_none=True)
        if self.seed == -1:  # vLLM: -1 means "no seed"
            self.seed = None
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(
                f"seed must be a signed 64-bit int in [-2**63, 2**63 - 1] or None, got {self.seed}"
            )
        check_int("n", self.n, minimum=1)
        check_bool("ignore_eos", self.ignore_eos)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for tok in self.stop_token_ids:
            check_int("stop_token_ids[i]", tok, minimum=0)
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = _normalise_stop(self.stop)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        check_bool("detokenize", self.detokenize)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text); "
                             "set detokenize=True or use stop_token_ids")
        check_int("logprobs", self.logprobs, minimum=0, allow_none=True)
        check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, allow_none=True)
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        check_bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(
                "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                f"got {type(self.output_kind).__name__} {self.output_kind!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")


def _normalise_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a str, a list of str or None, got {stop!r}")
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop must contain only str, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError("stop must not contain an empty string")
    return list(stop)


@dataclass
class SamplerOutput:
    """One step's result, already on the host."""

    token_ids: list[int]  # one per row
    # Per row: None unless that row's params.logprobs is set; else {token_id: logprob} with the
    # sampled token first, then the top-`logprobs` ids by rank (vLLM's order; the dict holds
    # logprobs + 1 entries, or logprobs when the sampled token is among the top).
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Samples one token for every row of a (B, V) logits tensor, with one host transfer.

    `vllm/v1/sample/sampler.py` in miniature:

    1. Logprobs, if any row asks, are log_softmax of the raw float32 logits (vLLM's default
       `logprobs_mode="raw_logprobs"`): what the model thinks, before temperature or filters.
    2. Greedy rows take the argmax of the raw logits.
    3. The other rows are divided by their temperature, masked by top-k and top-p
       (`vllm/v1/sample/ops/topk_topp_sampler.py`), softmaxed, and drawn with the exponential
       trick: argmax(p_i / q_i) with q_i ~ Exp(1) i.i.d. picks i with probability p_i (the
       Gumbel-max trick in another form). It is plain elementwise work and an argmax; vLLM
       uses it instead of `torch.multinomial` because that one synchronises GPU and host.
    4. q for all rows without a generator is one `exponential_` call on the sampler's own
       generator (engine state, never the global RNG); a row with its own seeded generator
       overwrites its q row from that generator, so its tokens do not depend on its neighbours.
    5. Tokens and logprobs go to the host in a single `.tolist()`.

    Every tensor is created with an explicit device (the one `logits` lives on), so the
    sampler works under `torch.set_default_device("meta")`.
    """

    def __init__(self, device: torch.device | str, seed: int) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # (B, V) logits of the last position of each sequence
        params: list[SamplingParams],
        generators: list[torch.Generator | None],  # per row; a row's own seeded stream or None
    ) -> SamplerOutput:
        _check_batch(logits, params, generators)
        if logits.shape[0] == 0:
            return SamplerOutput([], [])
        raw = logits.float()  # may be `logits` itself: never modified in place
        tokens = raw.argmax(dim=-1)  # the greedy answer for every row (cheap)
        greedy = [sp.greedy for sp in params]
        if not all(greedy):
            probs = self._random_probs(raw, params, greedy)
            sampled = self._draw(probs, [None if g else gen for g, gen in zip(greedy, generators)])
            if any(greedy):
                is_greedy = torch.tensor(greedy, dtype=torch.bool, device=raw.device)
                tokens = torch.where(is_greedy, tokens, sampled)
            else:
                tokens = sampled
        return self._to_host(raw, tokens, params)

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The (B, V) distribution each row is drawn from: after temperature, top-k and top-p;
        one-hot at the argmax for greedy rows. For teaching and tests; `__call__` never builds
        the one-hots."""
        raw = logits.float()
        greedy = [sp.greedy for sp in params]
        probs = self._random_probs(raw, params, greedy)
        if any(greedy):
            one_hot = torch.zeros_like(probs).scatter_(1, raw.argmax(dim=-1, keepdim=True), 1.0)
            is_greedy = torch.tensor(greedy, dtype=torch.bool, device=raw.device)
            probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
        return probs

    @staticmethod
    def _random_probs(raw: torch.Tensor, params: list[SamplingParams], greedy: list[bool]):
        """Temperature, then top-k, then top-p, all rows at once; greedy rows pass through with
        temperature 1 and no filter (their result is thrown away by the caller)."""
        device, vocab = raw.device, raw.shape[1]
        # Clamp again here (verify() already did) so a field changed after verify() cannot make
        # inf: 1e-40 becomes 0.01, exactly as verify() would make it.
        temps = [1.0 if g else max(float(sp.temperature), _MIN_TEMPERATURE)
                 for sp, g in zip(params, greedy)]
        scaled = raw / torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)

        # top-k rows: k in [1, V) (0, -1 and k >= V mean "off"). The params live on the host, so
        # the largest k is known without asking the device (vLLM's apply_top_k_only has to call
        # k.max(), a sync it allows only on CPU).
        random_rows = [i for i, g in enumerate(greedy) if not g]
        k_rows = [i for i in random_rows if 0 < params[i].top_k < vocab]
        if k_rows:
            ks = [params[i].top_k for i in k_rows]
            _mask_top_k(scaled, _index(k_rows, device),
                        torch.tensor(ks, dtype=torch.long, device=device), max(ks))
        # top-p rows: p < 1. Only these rows pay for the full-vocabulary sort.
        p_rows = [i for i in random_rows if params[i].top_p < 1]
        if p_rows:
            ps = [float(params[i].top_p) for i in p_rows]
            _mask_top_p(scaled, _index(p_rows, device),
                        torch.tensor(ps, dtype=torch.float32, device=device))
        return scaled.softmax(dim=-1)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): row i picks token j with probability probs[i, j]."""
        q = torch.empty_like(probs)
        if any(g is None for g in generators):
            # One call for every row without a generator (greedy rows' q is drawn and unused;
            # that is cheaper than gathering the rows that need it). As in vLLM's random_sample.
            q.exponential_(generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None:  # the only per-row work: a seeded row's own stream
                q[i].exponential_(generator=gen)
        # Exp(1) can round to exactly 0 in float32; 0 / 0 would be NaN, which argmax would pick
        # even for a filtered token. The smallest normal float keeps masked tokens at 0.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return probs.div(q).argmax(dim=-1)

    @staticmethod
    def _to_host(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]):
        """Everything the host needs, in one transfer."""
        lp_rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if not lp_rows:
            return SamplerOutput(tokens.tolist(), [None] * len(params))  # the one transfer
        device, (num_rows, vocab) = raw.device, raw.shape
        rows = _index(lp_rows, device)
        k = min(max(params[i].logprobs for i in lp_rows), vocab)
        logprobs = raw.index_select(0, rows).log_softmax(dim=-1)  # raw_logprobs, float32
        top_vals, top_ids = logprobs.topk(k, dim=-1)  # (R, k), best first
        chosen = logprobs.gather(1, tokens.index_select(0, rows).unsqueeze(1))  # (R, 1)
        # One tensor, one `.tolist()`: token ids are exact in float64 (vocabularies are far
        # below 2**53) and so are float32 logprobs.
        packed = torch.cat([tokens.double(), chosen.double().flatten(),
                            top_ids.double().flatten(), top_vals.double().flatten()])
        host = packed.tolist()  # the one transfer
        token_ids = [int(t) for t in host[:num_rows]]
        chosen_lp = host[num_rows : num_rows + len(lp_rows)]
        ids_start = num_rows + len(lp_rows)
        vals_start = ids_start + len(lp_rows) * k
        out: list[dict[int, float] | None] = [None] * num_rows
        for r, i in enumerate(lp_rows):
            entry = {token_ids[i]: chosen_lp[r]}  # sampled first, as vLLM's gather_logprobs
            for j in range(min(params[i].logprobs, k)):
                entry.setdefault(int(host[ids_start + r * k + j]), host[vals_start + r * k + j])
            out[i] = entry
        return SamplerOutput(token_ids, out)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[dict]:
    """Per row of (R, V) logits: {target: Logprob, then the top k ids: Logprob}, the target
    first (vLLM's order for prompt logprobs), each with its rank (1 = the model's favourite).
    Only requests that ask for prompt logprobs pay for this: the plain path never calls it."""
    from kvlab.outputs import Logprob

    logprobs = logits.float().log_softmax(dim=-1)  # raw logprobs, float32: (R, V)
    tgt = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, tgt)  # (R, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (R,)
    k = min(k, logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], tgt[:, :0])
    host = torch.cat([chosen.double(), ranks.double().unsqueeze(1), top_ids.double(),
                      top_vals.double()], dim=1).tolist()  # one transfer
    out = []
    for target, row in zip(targets, host):
        entry = {target: Logprob(row[0], int(row[1]))}
        for j in range(k):
            entry.setdefault(int(row[2 + j]), Logprob(row[2 + k + j], j + 1))
        out.append(entry)
    return out


def _mask_top_k(scaled: torch.Tensor, rows: torch.Tensor, ks: torch.Tensor, max_k: int) -> None:
    """Set to -inf every logit below its row's k-th largest. Ties at the k-th value are kept
    (the mask is `< kth`), so a row may keep more than k tokens, as vLLM's does."""
    sub = scaled.index_select(0, rows)
    kth = sub.topk(max_k, dim=-1).values.gather(1, (ks - 1).unsqueeze(1))  # (R, 1)
    scaled.index_copy_(0, rows, sub.masked_fill(sub < kth, float("-inf")))


def _mask_top_p(scaled: torch.Tensor, rows: torch.Tensor, ps: torch.Tensor) -> None:
    """Keep the smallest prefix of tokens, by descending probability, whose mass reaches p;
    always at least the top token. Same rule as vLLM's apply_top_k_top_p_pytorch, which sorts
    ascending and drops tokens whose cumulative mass is <= 1 - p."""
    sub = scaled.index_select(0, rows)
    sorted_probs, order = sub.softmax(dim=-1).sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # 0 for the top token: never dropped
    drop_sorted = mass_before >= ps.unsqueeze(1)
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # back to vocab order
    scaled.index_copy_(0, rows, sub.masked_fill(drop, float("-inf")))


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _check_batch(logits, params, generators) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(
            f"need one SamplingParams and one generator (or None) per logits row: "
            f"{logits.shape[0]} rows, {len(params)} params, {len(generators)} generators"
        )


def sample(
    logits: torch.Tensor,  # (B, V) logits of the last position of each sequence
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row (kept for older callers; the engine uses a `Sampler`).

    Rows with a generator draw from it, so a seeded request draws the same tokens whatever batch
    it shares. Rows without one draw from a throwaway Sampler seeded from torch's global RNG,
    as this function always did; an engine should own a `Sampler` instead.
    """
    seed = int(torch.randint(0, 2**62, (1,), device="cpu"))  # CPU tensor: no device sync
    return Sampler(logits.device, seed)(logits, params, generators).token_ids

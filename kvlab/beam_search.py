"""Beam search on paged KV: beams share their common past through forked block tables.

Defined in notebook 02. Each step every live beam proposes its best continuations; the best
`beam_width` survive. A survivor forks its parent's block table (ref counts +1, nothing copied);
a beam nobody continues frees its blocks at once; the shared last block is copied only when a
beam writes into it (copy-on-write, in `KVCacheManager.allocate_slots`).

Selection and stopping follow transformers' `generate(num_beams=...)` step for step (top
2 x beam_width candidates, finished hypotheses scored by cum_logprob / generated_len **
length_penalty, the same early-stop heuristic), so the best sequence is the one transformers
finds on the same weights.
"""

from __future__ import annotations

import itertools
import numbers
import time
from dataclasses import dataclass, field

import torch

from kvlab.config import check_bool, check_int
from kvlab.metrics import RequestMetrics
from kvlab.request import Request, RequestStatus
from kvlab.sampling import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False  # True: EOS is never chosen, every beam runs to max_tokens
    length_penalty: float = 1.0  # finished score = cum_logprob / generated_len ** length_penalty

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, minimum=1)
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_bool("ignore_eos", self.ignore_eos)
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, numbers.Real):
            raise TypeError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as vLLM returns them
    text: str  # the generated part, decoded
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty: what the ranking uses
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _PromptState:
    prompt_ids: list[int]
    max_length: int  # prompt + max_tokens, capped at max_model_len
    beams: list[Request]  # live beams, best first
    scores: list[float]  # their cum_logprobs
    finished: list[tuple[float, list[int], float, str]] = field(default_factory=list)
    improvable: bool = True  # transformers' early-stop heuristic
    done: bool = False


def beam_search(engine, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for every prompt, all prompts' beams batched into each forward pass."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    cfg = engine.config
    kv = engine.kv_cache_manager
    parsed = [engine.validate_request("beam-search", p, SamplingParams()) for p in prompts]
    for p in parsed:
        # Fewest blocks beam search can live with: the shared prompt plus one block per beam.
        need = kv.num_blocks_for(len(p.token_ids)) + params.beam_width
        if need > kv.num_blocks:
            raise ValueError(
                f"beam_width={params.beam_width} with a {len(p.token_ids)}-token prompt needs at "
                f"least {need} KV blocks; the pool has {kv.num_blocks}: lower beam_width or "
                "raise kv_cache_tokens"
            )
    engine.num_requests_added += 1
    ids = (f"__beam{engine.num_requests_added}-{k}" for k in itertools.count())
    greedy = SamplingParams(max_tokens=params.max_tokens, temperature=0)
    created: list[str] = []  # every beam id, so that an error anywhere still frees every block

    def new_beam(tokens: list[int], prompt_len: int) -> Request:
        beam = Request(next(ids), None, tokens[:prompt_len], greedy, engine.eos_token_ids,
                       RequestMetrics(arrival_time=0.0))
        created.append(beam.request_id)
        beam.output_token_ids = tokens[prompt_len:]
        beam.status = RequestStatus.RUNNING
        return beam

    states = [
        _PromptState(p.token_ids, min(len(p.token_ids) + params.max_tokens, cfg.max_model_len),
                     [new_beam(list(p.token_ids), len(p.token_ids))], [0.0])
        for p in parsed
    ]
    live = lambda: [b for s in states if not s.done for b in s.beams]  # noqa: E731
    try:
        while not all(s.done for s in states):
            start, cow_before = time.perf_counter(), kv.num_cow_copies
            scheduled = [(b, b.num_tokens - b.num_computed_tokens) for b in live()]
            num_decode = sum(1 for b, n in scheduled if b.output_token_ids)
            for beam, _ in scheduled:
                if not kv.allocate_slots(beam.request_id, beam.num_tokens, beam.num_computed_tokens):
                    raise RuntimeError(
                        "beam search ran out of KV blocks: lower beam_width or max_tokens, or "
                        "raise kv_cache_tokens (every block has been returned)"
                    )
            done, logits = engine.model_runner.execute_model(scheduled)
            for beam, n in scheduled:
                beam.num_computed_tokens += n
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # (live beams, V)
            row = 0
            for s in states:
                if s.done:
                    continue
                rows = logprobs[row : row + len(s.beams)]
                row += len(s.beams)
                _advance(s, rows, params, engine, kv, new_beam)
            engine.record_step(scheduled, num_decode, start, cow_before, running=live(),
                               num_waiting=0)
    finally:
        for rid in created:  # freeing is idempotent: beams already freed are skipped
            kv.free(rid)

    tok = engine.tokenizer
    return [
        BeamSearchOutput([
            BeamSearchSequence(list(s.prompt_ids) + gen, tok.decode(gen, skip_special_tokens=True),
                               cum, score, reason)
            for score, gen, cum, reason in s.finished
        ])
        for s in states
    ]


def _advance(s: _PromptState, logprobs: torch.Tensor, params: BeamSearchParams, engine, kv,
             new_beam) -> None:
    """One beam-search step for one prompt: pick survivors, fork or free their KV."""
    width = params.beam_width
    eos = sorted(engine.eos_token_ids)
    prompt_len = len(s.prompt_ids)
    cur_len = s.beams[0].num_tokens  # every live beam has the same length
    if params.ignore_eos and eos:
        logprobs[:, eos] = float("-inf")
    vocab = logprobs.shape[-1]
    acc = (logprobs + torch.tensor(s.scores)[:, None]).flatten()  # (beams * V,)
    # Twice the width (more with several EOS ids): enough survivors even if some just ended.
    k = min(max(2, 1 + len(eos)) * width, acc.numel())
    top_scores, top_idx = torch.topk(acc, k)
    cands = [(float(sc), int(i) // vocab, int(i) % vocab) for sc, i in zip(top_scores, top_idx)]
    at_limit = cur_len + 1 >= s.max_length
    hits = [at_limit or (not params.ignore_eos and t in engine.eos_token_ids) for _, _, t in cands]

    # Finished hypotheses: only candidates ranked in the top `width` may finish.
    if s.improvable:
        gen_len = cur_len + 1 - prompt_len
        for rank, ((sc, b, t), hit) in enumerate(zip(cands, hits)):
            if hit and rank < width:
                reason = "length" if t not in engine.eos_token_ids or params.ignore_eos else "stop"
                tokens = s.beams[b].output_token_ids + [t]
                s.finished.append((sc / gen_len**params.length_penalty, tokens, sc, reason))
        s.finished.sort(key=lambda f: f[0], reverse=True)
        del s.finished[width:]

    survivors = [c for c, hit in zip(cands, hits) if not hit][:width]
    if at_limit or not survivors:
        s.done = True
        for b in s.beams:
            kv.free(b.request_id)
        s.beams, s.scores = [], []
        return

    # New beams. A parent continued several ways forks (shares its blocks); the first way reuses
    # the parent itself; a parent nobody continues is freed now, not at the end.
    by_parent: dict[int, list[tuple[float, int]]] = {}
    for sc, b, t in survivors:
        by_parent.setdefault(b, []).append((sc, t))
    for b, parent in enumerate(s.beams):
        if b not in by_parent:
            kv.free(parent.request_id)  # first, so its blocks can serve the forks below
    new_beams = []
    for b, parent in enumerate(s.beams):
        ways = by_parent.get(b, [])
        for sc, t in ways[1:]:
            child = new_beam(parent.prompt_token_ids + parent.output_token_ids + [t], prompt_len)
            child.num_computed_tokens = parent.num_computed_tokens
            if not kv.fork(parent.request_id, child.request_id):
                raise RuntimeError("beam search ran out of KV blocks while forking a beam "
                                   "(every block has been returned)")
            new_beams.append((sc, child))
        if ways:
            parent.output_token_ids.append(ways[0][1])
            new_beams.append((ways[0][0], parent))
    new_beams.sort(key=lambda x: x[0], reverse=True)
    s.beams = [b for _, b in new_beams]
    s.scores = [sc for sc, _ in new_beams]

    # transformers' heuristic (early_stopping=False): stop once the best live beam, scored at
    # the current length, cannot beat the worst finished hypothesis.
    if len(s.finished) == width:
        best_possible = s.scores[0] / (cur_len + 1 - prompt_len) ** params.length_penalty
        s.improvable = s.improvable and best_possible > s.finished[-1][0]
    if not s.improvable:
        s.done = True
        for b in s.beams:
            kv.free(b.request_id)
        s.beams, s.scores = [], []

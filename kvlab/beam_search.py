"""Beam search on paged KV: beams share their common past through forked block tables.

Defined in notebook 02. Each step every live beam proposes its best continuations; the best
`beam_width` survive. A survivor forks its parent's block table (ref counts +1, nothing copied);
a beam nobody continues frees its blocks at once; the shared last block is copied only when a
beam writes into it (copy-on-write, in `KVCacheManager.allocate_slots`). That is the
PagedAttention paper's design (and vLLM v0's); vLLM v1 builds beam search on top of ordinary
generation instead (`vllm/entrypoints/llm.py`, `LLM.beam_search`), sharing through the prefix
cache.

Beams are requests like any other: the scheduler gives them seats (a search holds
`beam_width`), token budget and blocks, and may preempt them. A beam asks for its top logprobs
instead of a sampled token; `BeamSearchGroup` collects them and, once every live beam of the
search has reported, chooses the survivors; the scheduler applies the choice (drop, fork,
extend). `LLM.beam_search` only adds the search and steps the engine, as `generate` does.

Selection and stopping follow transformers' `generate(num_beams=...)` step for step (top
2 x beam_width candidates, finished hypotheses scored by cum_logprob / generated_len **
length_penalty, the same early-stop heuristic), so the best sequence is the one transformers
finds on the same weights.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass, field

import torch

from kvlab.config import check_bool, check_int
from kvlab.detokenizer import detokenize
from kvlab.metrics import RequestMetrics
from kvlab.request import Request, RequestGroup
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
class BeamStep:
    """One selection, for the scheduler to apply."""

    drop: list[Request] = field(default_factory=list)  # beams nobody continues: free them
    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (parent, new beam)
    extend: list[tuple[Request, int]] = field(default_factory=list)  # (beam, its next token)


class BeamSearchGroup:
    """The beams of one prompt and the choice between them (transformers' rules)."""

    def __init__(self, group_id: str, prompt_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int], max_model_len: int, now: float) -> None:
        self.group_id = group_id
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.eos = sorted(eos_token_ids)
        self.eos_token_ids = eos_token_ids
        self.max_length = min(len(prompt_ids) + params.max_tokens, max_model_len)
        self.seats = RequestGroup(group_id, params.beam_width)
        # Enough top logprobs per beam that the global top 2 x width (more with several EOS
        # ids) is among them, even after EOS is masked out.
        width = params.beam_width
        self.num_candidates = max(2, 1 + len(self.eos)) * width
        self.beam_params = SamplingParams(max_tokens=params.max_tokens, temperature=0,
                                          ignore_eos=True,
                                          logprobs=self.num_candidates + len(self.eos),
                                          detokenize=False)
        self.now = now
        self.ids = (f"{group_id}-beam{k}" for k in itertools.count())
        first = self._new_beam([])
        self.beams: list[Request] = [first]  # live beams, best first
        self.scores: list[float] = [0.0]  # their cum_logprobs
        self.reported: dict[str, dict[int, float]] = {}
        self.finished: list[tuple[float, list[int], float, str]] = []
        self.improvable = True  # transformers' early-stop heuristic
        self.done = False
        self.error: str | None = None

    def _new_beam(self, output_ids: list[int]) -> Request:
        beam = Request(next(self.ids), None, list(self.prompt_ids), self.beam_params,
                       self.eos_token_ids, RequestMetrics(arrival_time=self.now),
                       parent_id=self.group_id, group=self.seats, beam_group=self)
        beam.output_token_ids = output_ids
        return beam

    def live_beams(self) -> list[Request]:
        return list(self.beams)

    def add_logprobs(self, beam: Request, logprobs: dict[int, float]) -> None:
        # A preempted beam that computes again reports the same numbers: overwrite.
        self.reported[beam.request_id] = logprobs

    def ready(self) -> bool:
        return not self.done and all(b.request_id in self.reported for b in self.beams)

    def advance(self) -> BeamStep:
        """Choose the survivors among every live beam's candidates."""
        params, width, step = self.params, self.params.beam_width, BeamStep()
        prompt_len = len(self.prompt_ids)
        cur_len = self.beams[0].num_tokens  # every live beam has the same length
        # Candidates (cum_logprob + logprob, beam, token), summed in float32 as transformers does.
        owners, tokens, lps = [], [], []
        for b, beam in enumerate(self.beams):
            for t, lp in self.reported[beam.request_id].items():
                if params.ignore_eos and t in self.eos_token_ids:
                    continue
                owners.append(b)
                tokens.append(t)
                lps.append(lp)
        self.reported = {}
        cpu = torch.device("cpu")
        acc = (torch.tensor(lps, dtype=torch.float32, device=cpu)
               + torch.tensor(self.scores, dtype=torch.float32, device=cpu)[owners])
        k = min(self.num_candidates, acc.numel())
        acc = acc.tolist()  # float32 sums, exactly
        # Best first; equal scores in (beam, token) order, as a flat top-k over beams x vocab.
        order = sorted(range(len(lps)), key=lambda j: (-acc[j], owners[j], tokens[j]))[:k]
        cands = [(acc[j], owners[j], tokens[j]) for j in order]
        at_limit = cur_len + 1 >= self.max_length
        hits = [at_limit or (not params.ignore_eos and t in self.eos_token_ids)
                for _, _, t in cands]

        # Finished hypotheses: only candidates ranked in the top `width` may finish.
        if self.improvable:
            gen_len = cur_len + 1 - prompt_len
            for rank, ((sc, b, t), hit) in enumerate(zip(cands, hits)):
                if hit and rank < width:
                    reason = ("length" if t not in self.eos_token_ids or params.ignore_eos
                              else "stop")
                    seq = self.beams[b].output_token_ids + [t]
                    self.finished.append((sc / gen_len**params.length_penalty, seq, sc, reason))
            self.finished.sort(key=lambda f: f[0], reverse=True)
            del self.finished[width:]

        survivors = [c for c, hit in zip(cands, hits) if not hit][:width]
        if at_limit or not survivors:
            return self._finish(step)

        # A parent continued several ways forks (shares its blocks); the first way reuses the
        # parent itself; a parent nobody continues is dropped (its blocks freed now).
        by_parent: dict[int, list[tuple[float, int]]] = {}
        for sc, b, t in survivors:
            by_parent.setdefault(b, []).append((sc, t))
        new_beams = []
        for b, parent in enumerate(self.beams):
            ways = by_parent.get(b)
            if not ways:
                step.drop.append(parent)
                continue
            for sc, t in ways[1:]:
                child = self._new_beam(parent.output_token_ids + [t])
                step.forks.append((parent, child))
                new_beams.append((sc, child))
            step.extend.append((parent, ways[0][1]))
            new_beams.append((ways[0][0], parent))
        new_beams.sort(key=lambda x: x[0], reverse=True)
        self.beams = [b for _, b in new_beams]
        self.scores = [sc for sc, _ in new_beams]

        # transformers' heuristic (early_stopping=False): stop once the best live beam, scored at
        # the current length, cannot beat the worst finished hypothesis.
        if len(self.finished) == width:
            best_possible = self.scores[0] / (cur_len + 1 - prompt_len) ** params.length_penalty
            self.improvable = self.improvable and best_possible > self.finished[-1][0]
        if not self.improvable:
            # Nothing forked or extended survives: undo this step's plan and drop every beam.
            step.drop = [b for b in step.drop] + [p for p, _ in step.extend]
            step.forks, step.extend = [], []
            self.beams, self.scores = [], []
            self.done = True
        return step

    def _finish(self, step: BeamStep) -> BeamStep:
        step.drop += self.beams
        self.beams, self.scores = [], []
        self.done = True
        return step

    def output(self, tokenizer) -> BeamSearchOutput:
        return BeamSearchOutput([
            BeamSearchSequence(self.prompt_ids + gen, detokenize(tokenizer, gen), cum, score,
                               reason)
            for score, gen, cum, reason in self.finished
        ])

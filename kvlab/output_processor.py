"""From requests that received tokens to `RequestOutput`s: text, stop strings, output kinds.

The last stage of a step, as vLLM's `vllm/v1/engine/output_processor.py`. Each sample that needs
text as it is generated (streaming, or stop strings to watch for) owns an incremental
detokenizer (`detokenizer.py`), fed only the step's new tokens. A request that only needs its
text at the end (offline `LLM.generate`, `RequestOutputKind.FINAL_ONLY`) is decoded once, when
it finishes. The n samples of one request report under their parent's id, as vLLM's
`parallel_sampling.py` does with its child requests: while streaming (CUMULATIVE or DELTA) an
output holds the samples that changed in this step; FINAL_ONLY gathers all n once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.detokenizer import IncrementalDetokenizer, detokenize
from kvlab.outputs import CompletionOutput, RequestOutput
from kvlab.request import Request
from kvlab.sampling import RequestOutputKind


@dataclass(eq=False)
class SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_tokens_seen: int = 0  # output tokens already given to the detokenizer
    num_tokens_sent: int = 0  # output tokens already returned (DELTA)
    sent_final: bool = False  # its finished output has been returned (streaming kinds)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.samples: dict[str, list[SampleState]] = {}  # caller's request id -> its samples

    def add_request(self, request_id: str, samples: list[Request]) -> None:
        states = []
        for r in samples:
            sp = r.sampling_params
            streaming = sp.output_kind != RequestOutputKind.FINAL_ONLY
            detok = None
            if sp.detokenize and (streaming or sp.stop):
                detok = IncrementalDetokenizer.from_request(self.tokenizer, r.prompt_token_ids, sp)
            states.append(SampleState(r, detok))
        self.samples[request_id] = states

    def remove(self, request_id: str) -> None:
        self.samples.pop(request_id, None)

    def check_stop_strings(self, touched: list[Request]) -> list[tuple[Request, str]]:
        """Feed each touched sample's new tokens to its detokenizer; return the samples whose
        text now holds one of their stop strings (the engine finishes them; one that reached a
        length limit in the same step is reported as stopped by the string, as in vLLM)."""
        hits = []
        for request in touched:
            state = self._state(request)
            if state is None or state.detokenizer is None:
                continue
            new = request.output_token_ids[state.num_tokens_seen:]
            state.num_tokens_seen = len(request.output_token_ids)
            stop = state.detokenizer.update(new, _stop_terminated(request))
            if stop is not None:
                hits.append((request, stop))
        return hits

    def make_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per caller's request that changed in this step, by output kind."""
        outputs = []
        for parent_id in dict.fromkeys(r.parent_id for r in touched):
            states = self.samples.get(parent_id)
            if states is None:
                continue
            kind = states[0].request.sampling_params.output_kind
            finished = all(s.request.is_finished for s in states)
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            if kind == RequestOutputKind.FINAL_ONLY:
                chosen = states
            else:
                changed = {id(r) for r in touched}
                chosen = [s for s in states if id(s.request) in changed and not s.sent_final]
            completions = [self._completion(s, delta=kind == RequestOutputKind.DELTA)
                           for s in chosen]
            first = states[0].request
            outputs.append(RequestOutput(
                request_id=parent_id,
                prompt=first.prompt,
                prompt_token_ids=first.prompt_token_ids,  # shared, not copied (streams: every step)
                outputs=completions,
                finished=finished,
                num_cached_tokens=first.num_cached_tokens,
                metrics=first.metrics,
                prompt_logprobs=first.prompt_logprobs,
            ))
            if finished:
                self.remove(parent_id)
        return outputs

    def _completion(self, state: SampleState, delta: bool) -> CompletionOutput:
        r = state.request
        finished = r.is_finished
        logprobs = None
        state.sent_final = finished
        if delta:
            start = state.num_tokens_sent
            token_ids = r.output_token_ids[start:]
            if r.sampling_params.logprobs is not None:
                logprobs = r.output_logprobs[start:]
            state.num_tokens_sent = len(r.output_token_ids)
        else:
            token_ids = list(r.output_token_ids)
            if r.sampling_params.logprobs is not None:
                logprobs = list(r.output_logprobs)
        return CompletionOutput(
            index=r.index,
            text=self._text(state, finished, delta),
            token_ids=token_ids,
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
            logprobs=logprobs,
        )

    def _text(self, state: SampleState, finished: bool, delta: bool) -> str:
        r, sp = state.request, state.request.sampling_params
        if not sp.detokenize:
            return ""
        if state.detokenizer is not None:
            return state.detokenizer.get_next_output_text(finished, delta)
        # FINAL_ONLY without stop strings: decoded once, now that it is finished. A stop token
        # stays in token_ids but not in the text, unless include_stop_str_in_output (vLLM).
        ids = r.output_token_ids
        if _stop_terminated(r) and not sp.include_stop_str_in_output:
            ids = ids[:-1]
        return detokenize(self.tokenizer, ids, sp.skip_special_tokens)

    def _state(self, request: Request) -> SampleState | None:
        for s in self.samples.get(request.parent_id, ()):
            if s.request is request:
                return s
        return None


def _stop_terminated(request: Request) -> bool:
    """Ended by a stop token (EOS or one of stop_token_ids), not by a stop string or a limit."""
    return request.finish_reason == "stop" and not isinstance(request.stop_reason, str)

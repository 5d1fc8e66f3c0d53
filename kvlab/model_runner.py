"""Turn a scheduled step into tensors, run the model, sample.

Builds the flat batch vLLM-style (`vllm/v1/worker/gpu_model_runner.py`): every scheduled
request's new tokens concatenated, their positions, the pool slot each new K/V goes to (slot
mapping), and each request's block table; the attention backend chosen at start turns those
into its own metadata. Then one forward, logits only for the sequences that reached their end,
and one batched sampler call. Like vLLM's, the runner never asks the KV cache manager anything:
the `SchedulerOutput` carries each scheduled request's block table.
"""

from __future__ import annotations

import time

import torch

from kvlab.attention_metadata import CommonAttentionMetadata, to_device
from kvlab.kv_quant import QuantizedKVCache
from kvlab.model import Transformer
from kvlab.request import Request
from kvlab.sampling import Sampler, prompt_logprobs
from kvlab.outputs import ModelRunnerOutput
from kvlab.scheduler import SchedulerOutput

PROMPT_LOGPROBS_ROWS = 256  # prompt positions scored per logits call


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv_cache: torch.Tensor | QuantizedKVCache,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.attn_backend = model.attn_backend
        # Each KV cache group's sliding window (None: full attention), read once from the
        # model's layers (the engine has grouped them before the runner exists).
        windows = {g: model.sliding_window if kind == "sliding_attention" else None
                   for g, kind in zip(model.layer_group, model.layer_types)}
        self.group_windows = [windows[g] for g in sorted(windows)]
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        # (layers, 2, blocks, block_size, Hkv, D): K and V of one token in one layer, as
        # attention reads them (a quantized pool's shape and dtype are those it dequantizes to)
        num_kv_heads, head_dim = kv_cache.shape[4:]
        self.layer_kv_bytes_per_token = 2 * num_kv_heads * head_dim * kv_cache.dtype.itemsize
        self.device = device
        self.sampler = sampler
        self.last_forward_time = 0.0
        # The tokens the last step sampled, by request id. Under async scheduling the next step
        # is scheduled before the engine has appended them, so a decode's input token comes
        # from here (vLLM's runner keeps the previous step's sampled ids on the device).
        self.last_sampled: dict[str, int] = {}
        # Chapter 10: the KV connector's worker side (kvlab/kv_transfer/); None without one.
        self.kv_connector = None
        self.failed_step_connector_output = None  # what a step whose forward raised reported

    def prepare(self, sched: SchedulerOutput):
        """Flat input ids, positions and the backend's attention metadata for one step: one
        metadata, or (a hybrid model, chapter 09) one per KV cache group, each from that
        group's block tables and with its window."""
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[tuple[str, int, int]] = []
        for request, num_new in sched.scheduled:
            start = sched.num_computed_tokens[request.request_id]
            end = start + num_new
            input_ids += self._input_token_ids(request, start, end)
            positions += range(start, end)
            spans.append((request.request_id, start, end))
        first = next(iter(sched.block_ids.values()), [])
        windows = self.group_windows
        if isinstance(first, tuple):  # one block table per group
            metas = [self._group_metadata(sched, spans, g, window)
                     for g, window in enumerate(windows)]
        else:
            metas = [self._group_metadata(sched, spans, None, windows[0])]
        dev = self.device
        # One host-to-device copy for the ids, positions and every group's slots (pinned, not
        # blocking the host, on a GPU).
        rows = to_device(torch.tensor([input_ids, positions] + [m[0] for m in metas],
                                      dtype=torch.long, device="cpu"), dev)
        ids, pos = rows[0], rows[1]
        built = [self.attn_backend.build(CommonAttentionMetadata(
            slot_mapping=rows[2 + g], query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table_ids=tables, block_size=self.block_size,
            num_blocks=self.kv_cache.shape[2], device=dev,
            layer_kv_bytes_per_token=self.layer_kv_bytes_per_token,
            dtype=self.kv_cache.dtype, sliding_window=window))
            for g, (_, query_start_loc, seq_lens, tables, window) in enumerate(metas)]
        return ids, pos, (built if isinstance(first, tuple) else built[0])

    def _group_metadata(self, sched: SchedulerOutput, spans, group: int | None,
                        window: int | None):
        """One group's slot mapping, query starts, lengths and block tables."""
        bs = self.block_size
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for rid, start, end in spans:
            block_ids = sched.block_ids[rid]
            if group is not None:
                block_ids = block_ids[group]
            # Position p goes to slot p % block_size of logical block p // block_size.
            slot_mapping += [block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)
            # Only the blocks that hold this sequence's context are read.
            tables.append(block_ids[: -(-end // bs)])
        return slot_mapping, query_start_loc, seq_lens, tables, window

    def _input_token_ids(self, request: Request, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the request; past what it holds, the one the previous step
        sampled for it (async scheduling: at most one step is ahead of the request)."""
        known = request.num_tokens
        if end <= known:
            return request.token_ids(start, end)
        assert end == known + 1 and request.request_id in self.last_sampled, (
            f"{request.request_id}: input up to {end} but {known} tokens are known")
        return request.token_ids(start, known) + [self.last_sampled[request.request_id]]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks of K/V, every layer: the physical half of copy-on-write and fork."""
        if copies:
            src, dst = to_device(torch.tensor(copies, dtype=torch.long, device="cpu").T
                                 .contiguous(), self.device)
            if isinstance(self.kv_cache, QuantizedKVCache):  # the scales travel with the blocks
                self.kv_cache.copy_blocks(src, dst)
            else:
                self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # (layers, K/V, blocks, ...)

    @staticmethod
    def _prompt_logprob_rows(request: Request, start: int, num_new: int, row0: int):
        """The flat rows of this step whose logits predict a prompt token not yet scored.
        Position p predicts token p + 1; `request.prompt_logprobs` already holds entries for
        tokens 0 .. len - 1, so a recomputed prompt (after a preemption) is not scored twice."""
        first = max(start, len(request.prompt_logprobs) - 1)  # first position to score
        last = min(start + num_new, request.num_prompt_tokens - 1)  # one past the last
        if first < last:
            yield request, row0 + first - start, last - first

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows) -> None:
        """Score the prompt tokens at `prompt_rows` (one logits call for all of them)."""
        for request, row0, count in prompt_rows:
            # In slices, so a long prompt never holds (prompt length x vocabulary) logits.
            for at in range(0, count, PROMPT_LOGPROBS_ROWS):
                n = min(PROMPT_LOGPROBS_ROWS, count - at)
                logits = self.model.compute_logits(hidden[row0 + at : row0 + at + n])  # (n, V)
                p0 = len(request.prompt_logprobs)  # the first target token's index
                request.prompt_logprobs.extend(prompt_logprobs(
                    logits, request.prompt_token_ids[p0 : p0 + n],
                    request.sampling_params.prompt_logprobs))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: copies, forward, logits of the sequences that reached their end,
        sampling. A request in the middle of a chunked prompt gets no token: its last computed
        position is not the end of its sequence, so there is nothing to predict yet.

        With a KV connector (chapter 10), in vLLM's order
        (vllm/v1/worker/kv_connector_model_runner_mixin.py): its loads before the forward, its
        stores after, then what finished; a step with no tokens only loads and stores."""
        connector = self.kv_connector
        if connector is None:
            return self._execute(sched)
        # Loads go into blocks allocated for them alone, which no copy touches.
        connector.bind_connector_metadata(sched.kv_connector_metadata)
        connector.start_load_kv()
        try:
            output = self._execute(sched) if sched.scheduled else ModelRunnerOutput()
        except BaseException:
            # The loads happened; the stores' K/V are incomplete. The engine hands this report
            # to the scheduler with the failed step (LLMEngine._fail_step).
            connector.fail_saves()
            self.failed_step_connector_output = connector.get_finished()
            connector.clear_connector_metadata()
            raise
        connector.wait_for_save()
        output.kv_connector_output = connector.get_finished()
        connector.clear_connector_metadata()
        return output

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.copy_blocks(sched.fork_copies)
        self.copy_blocks(sched.cow_copies)
        ids, pos, meta = self.prepare(sched)
        rows: list[int] = []  # the flat-batch row each done sequence samples from
        samplers: list[Request] = []  # who samples from it (forked samples share their parent's)
        # Prompt logprobs: only requests that ask pay, for their prompt positions' rows.
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first row, count)
        end = 0
        for request, num_new in sched.scheduled:
            end += num_new
            start = sched.num_computed_tokens[request.request_id]
            if request.prompt_logprobs is not None:
                prompt_rows.extend(self._prompt_logprob_rows(request, start, num_new,
                                                             end - num_new))
            if start + num_new >= request.num_tokens:  # reaches its end (a placeholder's too)
                rows.append(end - 1)  # the sequence's last new token
                samplers.append(request)
        # A pure decode step samples every row: no index to copy.
        last = None if not rows or rows == list(range(end)) else to_device(
            torch.tensor(rows, dtype=torch.long, device="cpu"), self.device)
        # What the model itself costs; the rest of a step is the engine's overhead (chapter 03).
        timer = ForwardTimer(self.device)
        hidden = self.model.forward(ids, pos, self.kv_cache, meta)  # (T, hidden)
        logits = None
        if rows:
            logits = self.model.compute_logits(hidden if last is None else hidden[last])  # (B, V)
        if prompt_rows:
            self._prompt_logprobs(hidden, prompt_rows)
        timer.stop()
        output = ModelRunnerOutput()
        if logits is None:
            self.last_forward_time = timer.seconds()
            return output
        # Samples forked this step draw from their parent's logits row (chapter 02).
        index, who = [], []
        for k, request in enumerate(samplers):
            for r in [request, *sched.forked.get(request.request_id, [])]:
                index.append(k)
                who.append(r)
        if len(who) > len(samplers):
            logits = logits[to_device(torch.tensor(index, dtype=torch.long, device="cpu"),
                                      self.device)]
        result = self.sampler(logits, [r.sampling_params for r in who],
                              [r.generator for r in who])
        self.last_forward_time = timer.seconds()  # the sampler has waited for the device
        self.last_sampled = {}
        for r, token, lp in zip(who, result.token_ids, result.logprobs):
            output.sampled_token_ids[r.request_id] = token
            self.last_sampled[r.request_id] = token
            if lp is not None:
                output.logprobs[r.request_id] = lp
        return output


class ForwardTimer:
    """The forward's time. On a GPU the host only queues kernels, so two CUDA events record
    when the device began and finished; reading them after the sampler's one transfer (which
    waits for the device anyway) costs no extra wait. A `torch.cuda.synchronize()` here would
    stall the host before it could queue the sampler: one more sync every step."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start, self.end = time.perf_counter(), None

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.end = time.perf_counter()

    def seconds(self) -> float:
        if self.events is None:
            return self.end - self.start
        start, end = self.events
        end.synchronize()  # done already after sampling; a step that samples nothing waits here
        return start.elapsed_time(end) / 1e3

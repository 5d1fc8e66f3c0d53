"""Turn a scheduled step into tensors, run the model, sample.

Builds the flat batch vLLM-style: every scheduled request's new tokens concatenated, their
positions, the pool slot each new K/V goes to (slot mapping), and each request's block table.
"""

from __future__ import annotations

import time

import torch

from kvlab.attention import AttentionMetadata
from kvlab.flex_attention import flex_block_mask
from kvlab.kv_cache import KVCacheManager
from kvlab.model import Transformer
from kvlab.request import Request


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv_cache: torch.Tensor,
        kv_cache_manager: KVCacheManager,
        device: torch.device,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.device = device
        self.attention_backend = attention_backend  # "auto", "reference" or "flex"
        self.last_forward_time = 0.0

    def prepare(self, scheduled: list[tuple[Request, int]]):
        """Flat input ids, positions and attention metadata for one step."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_ids_per_seq: list[list[int]] = []
        bs = self.block_size
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            input_ids += request.token_ids(start, end)
            positions += range(start, end)
            # Position p goes to slot p % block_size of logical block p // block_size.
            slot_mapping += [block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            # Only the blocks that hold this sequence's context are read.
            block_ids_per_seq.append(block_ids[: -(-end // bs)])

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=[torch.tensor(b, dtype=torch.long, device=dev) for b in block_ids_per_seq],
            use_reference=self.attention_backend == "reference",
        )
        num_seqs = len(scheduled)
        if self.attention_backend == "flex":
            meta.flex_block_mask = flex_block_mask(block_ids_per_seq, query_start_loc, seq_lens,
                                                   self.kv_cache.shape[2], bs, dev)
        elif num_seqs > 1 and len(input_ids) == num_seqs:
            # A pure decode step: pad the block tables to one rectangle (with block 0, which is
            # masked out) so all sequences attend in one call.
            max_blocks = max(len(b) for b in block_ids_per_seq)
            table = torch.zeros((num_seqs, max_blocks), dtype=torch.long)
            for i, b in enumerate(block_ids_per_seq):
                table[i, : len(b)] = torch.tensor(b, dtype=torch.long)
            key_pos = torch.arange(max_blocks * bs)
            mask = key_pos[None, :] < torch.tensor(seq_lens)[:, None]  # (B, L)
            meta.decode_block_table = table.to(dev)
            meta.decode_mask = mask[:, None, None, :].to(dev)  # (B, 1, 1, L)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks of K/V, every layer: the physical half of copy-on-write and fork."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # (layers, K/V, blocks, ...)

    def execute_model(self, scheduled: list[tuple[Request, int]]):
        """Run one step; return the requests whose K/V is now complete and their logits (B, V).

        A request in the middle of a chunked prompt gets no logits: its last computed position is
        not the end of its sequence, so there is nothing to predict yet.
        """
        self.copy_blocks(self.kv_cache_manager.take_pending_copies())
        ids, pos, meta = self.prepare(scheduled)
        rows, done = [], []
        for i, (request, num_new) in enumerate(scheduled):
            if request.num_computed_tokens + num_new == request.num_tokens:
                rows.append(meta.query_start_loc[i + 1] - 1)  # the last new token of sequence i
                done.append(request)
        t0 = time.perf_counter()
        hidden = self.model.forward(ids, pos, self.kv_cache, meta)  # (T, hidden)
        logits = self.model.compute_logits(hidden[rows]) if rows else None  # (B, V)
        if logits is not None and logits.device.type == "cuda":
            torch.cuda.synchronize()  # so the time below is the GPU's work, not its launch
        # What the model itself costs; the rest of a step is the engine's overhead (chapter 03).
        self.last_forward_time = time.perf_counter() - t0
        return done, logits

"""Randomised load on the engine's bookkeeping: block pool, prefix cache, copy-on-write and the
scheduler, driven by hypothesis for thousands of steps, with every invariant checked after every
operation.

The model is replaced by a stand-in that "predicts" a token from the sequence so far (so runs are
deterministic and fast); everything else is the real engine: LLMEngine, Scheduler,
KVCacheManager, BlockPool, forks, preemption, prefix-cache lookups and evictions.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab import LLM, SamplingParams
from kvlab.outputs import ModelRunnerOutput

FAKE_VOCAB = 2000  # the stand-in's logits only need to cover the tokens it emits


def fake_execute_model(engine):
    """Stand-in for ModelRunner.execute_model: same contract, no forward pass."""

    def execute_model(sched):
        # Where each step starts is in the output (schedule() has advanced the requests), and
        # under async scheduling the last input token may still be in flight: the fake's "next
        # token" is a function of the prompt and the position, known in either loop.
        ends = {r.request_id: sched.num_computed_tokens[r.request_id] + n
                for r, n in sched.scheduled}
        done = [r for r, n in sched.scheduled if ends[r.request_id] >= r.num_tokens]
        # Forked samples draw from their parent's row, as the real runner does.
        rows = [(r, s) for r in done for s in [r, *sched.forked.get(r.request_id, [])]]
        logits = torch.zeros((len(rows), FAKE_VOCAB))
        for i, (r, _) in enumerate(rows):
            logits[i, (r.prompt_token_ids[-1] * 31 + ends[r.request_id] * 7) % 1000 + 100] = 10.0
        result = engine.model_runner.sampler(logits, [s.sampling_params for _, s in rows],
                                             [s.generator for _, s in rows])
        return ModelRunnerOutput({s.request_id: t for (_, s), t in zip(rows, result.token_ids)})

    return execute_model


class EngineMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4, 16]),
                kv_blocks=st.integers(4, 24),
                budget=st.integers(1, 64),
                chunked=st.booleans(),
                caching=st.booleans(),
                scheduling=st.sampled_from(["continuous", "static"]),
                max_num_seqs=st.integers(1, 8),
                async_scheduling=st.booleans(),
                parallel_sampling=st.sampled_from(["fork", "child_requests"]))
    def setup(self, block_size, kv_blocks, budget, chunked, caching, scheduling, max_num_seqs,
              async_scheduling, parallel_sampling):
        max_model_len = min(kv_blocks * block_size, 48)
        if not chunked:
            budget = max(budget, max_model_len)
        max_num_seqs = min(max_num_seqs, budget)  # vLLM refuses a budget below max_num_seqs
        self.llm = LLM(block_size=block_size, kv_cache_tokens=kv_blocks * block_size,
                       max_model_len=max_model_len, max_num_batched_tokens=budget,
                       enable_chunked_prefill=chunked, enable_prefix_caching=caching,
                       scheduling=scheduling, max_num_seqs=max_num_seqs,
                       async_scheduling=async_scheduling, parallel_sampling=parallel_sampling)
        self.engine = self.llm.llm_engine
        self.engine.model_runner.execute_model = fake_execute_model(self.engine)
        self.kv = self.engine.kv_cache_manager
        self.max_model_len = max_model_len
        self.live: list[str] = []
        self.counter = 0
        self.block_content: dict[int, tuple] = {}  # keyed block -> (key, salt, tokens)
        original = self.kv.get_computed_blocks

        def checked_lookup(request):
            # Every hit: contiguous from the start, same salt, same tokens.
            hits, n = original(request)
            for j, blk in enumerate(hits):
                key, salt, tokens = self.block_content[blk.block_id]
                assert key == blk.block_hash and salt == request.cache_salt
                assert tokens == tuple(request.token_ids(0, (j + 1) * self.kv.block_size))
            return hits, n

        self.kv.get_computed_blocks = checked_lookup
        original_cache = self.kv.cache_blocks

        def recording_cache(request, num_tokens=None):
            # Note what each newly keyed block holds, from the request that keyed it.
            original_cache(request, num_tokens)
            for j, bid in enumerate(self.kv.get_block_ids(request.request_id)):
                key = self.kv.block_pool.blocks[bid].block_hash
                if key is not None and self.block_content.get(bid, (None,))[0] != key:
                    tokens = tuple(request.token_ids(0, (j + 1) * self.kv.block_size))
                    self.block_content[bid] = (key, request.cache_salt, tokens)

        self.kv.cache_blocks = recording_cache

    @rule(salt=st.sampled_from([None, "a", "b"]), prefix=st.integers(0, 2),
          length=st.integers(1, 30), max_tokens=st.integers(1, 12), n=st.integers(1, 3),
          temperature=st.sampled_from([0.0, 1.0]))
    def add(self, salt, prefix, length, max_tokens, n, temperature):
        length = min(length, self.max_model_len - 1)
        tokens = [500 + prefix] * 4 + list(range(1000, 1000 + length))
        tokens = tokens[:length]
        rid = f"r{self.counter}"
        self.counter += 1
        prompt = {"prompt_token_ids": tokens}
        if salt is not None:
            prompt["cache_salt"] = salt
        try:
            self.engine.add_request(rid, prompt, SamplingParams(
                max_tokens=max_tokens, n=n, temperature=temperature, seed=self.counter))
        except ValueError:
            return  # n > max_num_seqs: refused before anything changed
        self.live.append(rid)

    @rule(steps=st.integers(1, 20))
    def step(self, steps):
        for _ in range(steps):
            for out in self.engine.step():
                if out.finished:
                    self.live.remove(out.request_id)
            self.check()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        rid = self.live.pop(i % len(self.live))
        self.engine.abort_request(rid)

    @invariant()
    def check(self):
        if not hasattr(self, "engine"):
            return
        pool = self.kv.block_pool
        pool.check_invariants()  # free <=> ref 0, in queue; counts add up; keys match
        held = Counter(b.block_id for blocks in self.kv.req_to_blocks.values() for b in blocks)
        for blk in pool.blocks:
            assert blk.ref_cnt == held[blk.block_id], (blk, held[blk.block_id])
        # Only live requests hold blocks.
        running = {r.request_id for r in self.engine.scheduler.running}
        assert set(self.kv.req_to_blocks) <= running | {
            r.request_id for r in self.engine.scheduler.waiting}

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for rid in list(self.live):
            self.engine.abort_request(rid)
        assert self.kv.block_pool.get_num_free_blocks() == self.kv.block_pool.num_usable_blocks
        assert not self.engine.requests and not self.engine.parents


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

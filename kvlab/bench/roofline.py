"""Decode against this machine's roofline: where a decode step's time goes.

`python -m kvlab.bench roofline` (and `peers`, which calls it) runs, in one process:

- this machine's rates, measured in the same run (`peers.machine_rates`): fp32 matmul rate
  (torch.mm, and oneDNN's packed linear, the kernel the model's matmuls run on) and copy
  bandwidth;
- the batch sweep: decode steps at 1, 4, 16, 32 and 64 running requests at context 256 (and 32
  and 512 at 16 and 64), each step's time against the ceiling (`peers.decode_ceiling`: weights
  and every sequence's K/V read once, arithmetic at the matmul rate, whichever is slower);
- the cost of one more token of context, against reading that token's K and V once at the
  measured bandwidth (the slope of step time over context, batch fixed);
- the engine's overhead at 64 running (a step's wall time outside the model forward);
- a step holding decodes and one 128-token prefill chunk against the sum of its parts.

Defined for notebook 07 (the peers section plots the sweep, `viz.plot_roofline_sweep`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from kvlab.bench.common import make_prompts
from kvlab.bench.offline_peers import decode_ceiling, machine_rates
from kvlab.engine import LLM
from kvlab.sampling import SamplingParams

SWEEP_BATCHES = (1, 4, 16, 32, 64)
SWEEP_CONTEXT = 256
EXTRA_POINTS = ((16, 32), (16, 512), (64, 32), (64, 512))


class PaddedDecodeBackend:
    """The decode path before the batched copy groups, kept as the baseline `--attention padded` measures: per
    layer, a pure decode step copies every sequence's blocks into one padded (B, L) rectangle
    with advanced indexing, then one SDPA call with a boolean mask and `enable_gqa`; a step
    with any prefill attends one sequence at a time (the reference path), decodes included."""

    name = "padded"

    def build(self, common):
        from kvlab.attention import ReferenceBackend

        meta = ReferenceBackend().build(common)
        if common.num_seqs > 1 and common.is_pure_decode:
            tables = common.block_table_ids
            table = torch.zeros((common.num_seqs, max(len(t) for t in tables)), dtype=torch.long)
            for i, t in enumerate(tables):
                table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            key_pos = torch.arange(table.shape[1] * common.block_size)
            mask = key_pos[None, :] < torch.tensor(common.seq_lens)[:, None]  # (B, L)
            meta.padded = (table.to(common.device), mask[:, None, None, :].to(common.device))
        return meta

    def forward(self, q, kv_layer, meta, scale: float) -> torch.Tensor:
        from kvlab.attention import paged_attention_reference

        if getattr(meta, "padded", None) is None:
            return paged_attention_reference(q, kv_layer, meta, scale)
        bt, mask = meta.padded
        B, _, head_dim = q.shape
        num_kv_heads = kv_layer.shape[3]
        k = kv_layer[0][bt].view(B, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = kv_layer[1][bt].view(B, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o[:, :, 0, :]


def decode_steps(llm: LLM, batch: int, context: int, steps: int = 8, warmup: int = 2) -> dict:
    """Time `steps` decode steps with `batch` requests running at about `context` tokens each.

    The requests are prefilled first (those steps are not timed), then `warmup` decode steps run
    untimed; the timed steps are whole `LLMEngine.step()` calls (schedule, model, sampling,
    output processing), so the engine's own cost is in them. `context` is the median sequence
    length the timed steps attend over. The requests are aborted afterwards."""
    engine = llm.llm_engine
    prompt_len = max(1, context - warmup - steps // 2)
    prompts = make_prompts(llm.get_tokenizer(), batch, prompt_len, prompt_len)
    # As many tokens as fit: the first requests decode while the last ones are still in
    # prefill, and none may finish during the timed steps.
    room = llm.llm_engine.config.max_model_len - prompt_len
    assert room > warmup + steps, "max_model_len leaves no room for the timed steps"
    sp = SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)
    ids = []
    for p in prompts:
        rid = f"roofline-{engine.num_requests_added}"
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
        ids.append(rid)
    requests = [engine.requests[r] for r in ids]
    while any(not r.output_token_ids for r in requests):  # prefill, untimed
        engine.step()
    for _ in range(warmup):
        engine.step()
    walls, forwards, records, lens = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        # The forward run inside this call. Under async scheduling the step read in this call
        # ran its forward in the call before, so its trace record's forward_time is not the
        # one inside this wall time, and wall - forward could come out below zero.
        forwards.append(engine.model_runner.last_forward_time)
        rec = engine.step_trace[-1]
        # Only pure decode steps with every request running count (none may have finished).
        assert rec.num_prefill_tokens == 0 and len(rec.request_ids) == batch, rec
        records.append(rec)
        # This step's context, the median over the batch: computed tokens + the new one.
        lens.append(statistics.median(r.num_tokens - 1 for r in requests))
    for rid in ids:
        engine.abort_request(rid)
    step = statistics.median(walls)
    return {"batch": batch, "context": int(statistics.median(lens)),
            "step_ms": round(1000 * step, 2),
            "spread_ms": [round(1000 * min(walls), 2), round(1000 * max(walls), 2)],
            "forward_ms": round(1000 * statistics.median(forwards), 2),
            # The step as the engine's trace times it (no output processing): what mixed_step
            # compares, since its other steps come from the trace too.
            "trace_step_ms": round(1000 * statistics.median(r.step_time for r in records), 2),
            "overhead_fraction": round(statistics.median(
                (w - f) / w for w, f in zip(walls, forwards)), 4),
            "tok_s": round(batch / step, 1)}


def make_engine(model: str | None, attention=None, **knobs) -> LLM:
    """An engine for the bench; `attention` (a function returning a backend), when given,
    replaces its attention backend: the bench's way to run an older decode path beside the
    current one in the same process."""
    # Cold unless asked: the bench repeats its prompts, and each step must compute them.
    llm = LLM(model, **{"enable_prefix_caching": False, **knobs})
    if attention is not None:
        llm.llm_engine.set_attention_backend(attention())
    return llm


def best_rates(device, dtype, repeats: int = 5) -> dict:
    """`machine_rates` twice, the best of each (a noisy 2-core machine only ever makes a rate
    look slower, and a faster machine is the stricter ceiling)."""
    a = machine_rates(device=device, dtype=dtype, repeats=repeats)
    b = machine_rates(device=device, dtype=dtype, repeats=repeats)
    return {k: max(a[k], b[k]) for k in a}


def against_ceiling(row: dict, rates: dict, model: str | None) -> dict:
    """Add the ceiling at this point and the measured step's fraction of it, against the
    torch.mm rate (the ceiling issues 6 and 15 stated their targets in) and against the fastest
    fp32 matmul this machine runs (oneDNN's packed linear, the kernel the model uses)."""
    out = dict(row)
    for key, rate in (("mm", rates["matmul_flops"]), ("peak", rates["peak_matmul_flops"])):
        c = decode_ceiling(row["batch"], row["context"],
                           {"matmul_flops": rate, "bandwidth_bytes": rates["bandwidth_bytes"]},
                           model)
        out[f"ceiling_ms_{key}"] = c["step_ms"]
        out[f"bound_{key}"] = c["bound"]
        out[f"fraction_{key}"] = round(c["step_ms"] / row["step_ms"], 3)
    return out


def context_token_cost(rows: list[dict], batch: int, kv_bytes_per_token: int,
                       bandwidth: float) -> dict:
    """The cost of one more token of context at `batch` running: the slope of step time between
    the shortest and the longest context measured, per sequence-token, against reading one
    token's K and V (every layer) once at the measured copy bandwidth."""
    pts = sorted((r["context"], r["step_ms"]) for r in rows if r["batch"] == batch)
    (c0, t0), (c1, t1) = pts[0], pts[-1]
    per_token_us = 1000 * (t1 - t0) / (batch * (c1 - c0))
    read_us = 1e6 * kv_bytes_per_token / bandwidth
    return {"batch": batch, "contexts": [c0, c1], "per_context_token_us": round(per_token_us, 3),
            "kv_read_once_us": round(read_us, 3), "ratio": round(per_token_us / read_us, 2)}


def mixed_step(model: str | None = None, batch: int = 16, context: int = 256,
               chunk: int = 128, long_prompt: int = 1024, attention=None) -> dict:
    """A step holding `batch` decodes and one `chunk`-token prefill chunk, against the sum of a
    decode-only step (same batch, same context) and a prefill-only step of the same chunk (the
    same chunk positions of the same long prompt, nothing else running). All three are the
    engine trace's step times."""
    max_len = long_prompt + 32
    llm = make_engine(model, attention, max_model_len=max_len, max_num_seqs=batch + 1,
                      kv_cache_tokens=(batch + 1) * max_len + 64,
                      max_num_batched_tokens=batch + chunk)
    engine = llm.llm_engine
    decode = decode_steps(llm, batch, context, steps=6)  # its own requests, aborted after
    prompts = make_prompts(llm.get_tokenizer(), batch + 1, context, long_prompt)
    long_ids = prompts[-1][:long_prompt]
    ids = [f"mixed-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts[:batch]):
        engine.add_request(rid, {"prompt_token_ids": p[:context]},
                           SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    reqs = [engine.requests[r] for r in ids]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    engine.add_request("mixed-long", {"prompt_token_ids": long_ids},
                       SamplingParams(max_tokens=1, temperature=0))
    first = engine.num_steps
    while "mixed-long" in engine.requests:
        engine.step()
    mixed = [r.step_time for r in engine.step_trace if r.step > first
             and r.num_prefill_tokens == chunk and r.num_decode_tokens == batch]
    for rid in ids:
        engine.abort_request(rid)

    alone = make_engine(model, attention, max_model_len=max_len, max_num_seqs=1,
                        kv_cache_tokens=max_len + 64, max_num_batched_tokens=chunk)
    greedy1 = SamplingParams(max_tokens=1, temperature=0)
    alone.generate({"prompt_token_ids": prompts[0][:chunk]}, greedy1)  # warm-up
    first = alone.llm_engine.num_steps
    alone.generate({"prompt_token_ids": long_ids}, greedy1)
    prefill = [r.step_time for r in alone.llm_engine.step_trace
               if r.step > first and r.num_prefill_tokens == chunk]
    mixed_ms = 1000 * statistics.median(mixed)
    prefill_ms = 1000 * statistics.median(prefill)
    return {"batch": batch, "context": decode["context"], "chunk": chunk,
            "mixed_steps": len(mixed), "mixed_ms": round(mixed_ms, 2),
            "decode_only_ms": decode["trace_step_ms"], "prefill_only_ms": round(prefill_ms, 2),
            "mixed_over_parts": round(mixed_ms / (decode["trace_step_ms"] + prefill_ms), 3)}


def roofline(model: str | None = None, batches=SWEEP_BATCHES, context: int = SWEEP_CONTEXT,
             extra=EXTRA_POINTS, steps: int = 8, mixed: bool = True, attention=None,
             log=print) -> dict:
    """Everything above in one run; `log` gets each result as it comes."""
    points = [(b, context) for b in batches] + list(extra)
    max_batch = max(b for b, _ in points)
    max_len = max(c for _, c in points) + 32
    # One engine for every point: room for the largest batch at the longest context, and a
    # prefill budget that fills the batch in a few (untimed) steps.
    llm = make_engine(model, attention, max_model_len=max_len, max_num_seqs=max_batch,
                      kv_cache_tokens=max_batch * max_len + 64, max_num_batched_tokens=4096)
    engine = llm.llm_engine
    rates = best_rates(engine.device, engine.dtype)
    log({"rates_gflops_gbs": {k: round(v / 1e9, 1) for k, v in rates.items()}})
    decode_steps(llm, 4, 64, steps=2)  # warm-up: first-call allocations, kernel choices
    rows = []
    for batch, ctx in points:
        row = against_ceiling(decode_steps(llm, batch, ctx, steps), rates, model)
        rows.append(row)
        log(row)
    rates_after = best_rates(engine.device, engine.dtype)  # did the machine change meanwhile?
    log({"rates_after_gflops_gbs": {k: round(v / 1e9, 1) for k, v in rates_after.items()}})
    out = {"context": context, "batches": list(batches), "rates": rates,
           "rates_after": rates_after, "rows": rows,
           "context_token_cost": [], "overhead_at_64": None, "mixed": None}
    for batch in sorted({b for b, _ in points}):
        if len({r["context"] for r in rows if r["batch"] == batch}) > 1:
            cost = context_token_cost(rows, batch, engine.kv_bytes_per_token,
                                      rates["bandwidth_bytes"])
            out["context_token_cost"].append(cost)
            log(cost)
    at64 = [r for r in rows if r["batch"] == 64]
    if at64:  # the sweep's own point (context 256), the first row at 64
        out["overhead_at_64"] = {k: at64[0][k] for k in ("context", "step_ms", "forward_ms",
                                                         "overhead_fraction")}
        log({"overhead_at_64": out["overhead_at_64"]})
    if mixed:
        out["mixed"] = mixed_step(model, attention=attention)
        log({"mixed": out["mixed"]})
    return out

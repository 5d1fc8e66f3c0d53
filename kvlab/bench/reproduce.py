"""The cited experiments each chapter reproduces, one named function each, as
`python -m kvlab.bench reproduce`.

The figures come from the PagedAttention, Orca and Sarathi-Serve papers and from three articles
on vLLM's KV-cache management ("LLM KV Cache Anatomy, part 2", 2026-10-13, Qwen3-1.7B on an 8 GB
GPU, vLLM 0.31.0; "PagedAttention by logic simulation"; "Continuous batching, chunked prefill,
prefix caching and cache_salt, re-measured on a small model", 2026-10-27, Qwen3-Reranker-0.6B on
an 8 GB Ada laptop GPU, vLLM 0.31.0). Every experiment returns flat rows (one dict per measured
point), so the command line prints them as a table and saves them as JSON and CSV alike. The
protocol is those articles': a warm-up run that is not counted, then `repeats` runs, medians with the spread (min-max) where time is measured.
Chapter sizes are kept so a full run takes minutes on a laptop CPU; pass bigger sizes to the
functions themselves on a GPU.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from kvlab.workbook import allocator_sim
from kvlab.bench import prefix, scheduling
from kvlab.bench.cow import cow_savings
from kvlab.engine import LLM
from kvlab.model import load_model
from kvlab.sampling import SamplingParams


def continuous_batching(repeats: int = 3, model: str | None = None,
                        progress: bool = True) -> list[dict]:
    """Chapter 03's seed table: one request at a time (`max_num_seqs=1`) against the default
    scheduler, bursts of `concurrency` requests of 64 + 16 tokens (EOS ignored)."""
    servers = {"max_num_seqs=1": ({"max_num_seqs": 1}, (1, 4, 16)), "default": ({}, (1, 4, 16))}
    rows = scheduling.continuous_batching_table(servers, 64, 16, repeats, model, progress)
    base = {r["server"]: r["tok_s"] for r in rows if r["concurrency"] == 1}
    for r in rows:
        r["speedup_vs_c1"] = round(r["tok_s"] / base[r["server"]], 2)
    return rows


def kv_capacity(repeats: int = 1, model: str | None = None, progress: bool = True) -> list[dict]:
    """Chapter 03: concurrency past what a 1,024-token KV budget holds, requests of 48 + 16
    tokens. The knee is predicted as the pool's blocks over the blocks one request holds at its
    end (48 + 16 - 1 tokens, in whole blocks); past it requests wait, and running ones are
    preempted."""
    sweep = scheduling.kv_capacity_sweep((1, 4, 8, 16, 32), kv_cache_tokens=1024, input_len=48,
                                         output_len=16, repeats=repeats, model=model,
                                         progress=progress)
    return [{"concurrency": r["concurrency"], "predicted_knee": sweep["predicted_knee"],
             **{k: v for k, v in r.items() if k != "concurrency"}} for r in sweep["rows"]]


def chunked_prefill(repeats: int = 3, model: str | None = None,
                    progress: bool = True) -> list[dict]:
    """Chapter 04's stall table: a 1,024-token prompt arrives while a request decodes; its worst
    inter-token gap and the long prompt's TTFT for each token budget, and with chunking off."""
    rows = []
    for budget in tqdm((64, 128, 256, 512, None), desc="chunked prefill", disable=not progress):
        runs = scheduling.chunked_prefill_trials(budget, 1024, repeats, model)
        gaps = [1000 * r.max_gap for r in runs]
        rows.append({"max_num_batched_tokens": budget if budget else "off (no chunking)",
                     "chunks": runs[0].chunks,
                     "max_gap_ms": round(statistics.median(gaps), 1),
                     "max_gap_ms_spread": [round(min(gaps), 1), round(max(gaps), 1)],
                     "inserted_ttft_ms": round(1000 * statistics.median(
                         r.inserted_ttft for r in runs), 1)})
    unchunked = rows[-1]["max_gap_ms"]
    for r in rows:
        r["gap_vs_unchunked"] = round(r["max_gap_ms"] / unchunked, 3)
    return rows


def prefix_cache(repeats: int = 3, model: str | None = None, progress: bool = True) -> list[dict]:
    """Chapter 05: TTFT of a request whose long prefix is cached (warm) against the first one
    (cold), for several prefix lengths, 32-token distinct tails; `repeats` prefixes each."""
    rows = []
    for length in tqdm((256, 1024, 2048), desc="prefix cache", disable=not progress):
        r = prefix.cold_warm_ttft(length, 32, num_prefixes=repeats, model=model)
        rows.append({k: r[k] for k in ("prefix_len", "tail_len", "cold_ttft_ms", "warm_ttft_ms",
                                       "warm_ttft_ms_range", "speedup", "warm_cached_tokens")})
    return rows


def cache_salt(repeats: int = 3, model: str | None = None, progress: bool = True) -> list[dict]:
    """Chapter 06's salt table (tenants a, a, b, b, no salt on one 512-token document) and the
    timing attack's accuracy with and without per-tenant salts."""
    rows = [{"experiment": "salt table", **r} for r in prefix.salt_table(model=model)]
    for salted in tqdm((False, True), desc="cache_salt attack", disable=not progress):
        r = prefix.timing_attack(trials=20, salted=salted, model=model)
        rows.append({"experiment": "timing attack", "cache_salt": "per tenant" if salted
                     else "none", "trials": r["trials"], "accuracy": r["accuracy"]})
    return rows


def paged_admission(repeats: int = 3, model: str | None = None,
                    progress: bool = True) -> list[dict]:
    """Chapter 01: contiguous (max_model_len reserved per request) against paged (blocks on
    demand, vLLM's admission). The allocator simulation over `repeats` seeds (100 requests of
    10-512 tokens, 10,000 slots): steps to finish them all, requests running per step,
    preemptions; then the real model: 16 requests, a 2,560-token budget."""
    rows = []
    for seed in tqdm(range(repeats), desc="paged admission", disable=not progress):
        lengths = allocator_sim.request_lengths(100, 10, 512, seed=seed)
        runs = {layout: allocator_sim.simulate(lengths, layout) for layout in ("contiguous", "paged")}
        for layout, r in runs.items():
            rows.append({"run": f"simulation seed {seed}", "kv_layout": layout,
                         "steps_to_finish": r.num_steps,
                         "mean_running": round(r.mean_running, 1), "peak_running": r.max_running,
                         "preemptions": r.num_preemptions,
                         "recomputed_tokens": r.num_recomputed_tokens,
                         "slots_holding_tokens": round(r.mean_utilisation, 3)})
    tok = load_model(model).tokenizer
    text = tok(" ".join(["Paged memory lets a serving engine keep many requests in flight."]
                        * 30)).input_ids
    prompts = [{"prompt_token_ids": text[i: i + 30 + 4 * i]} for i in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for layout in ("contiguous", "paged"):
        llm = LLM(model, kv_layout=layout, block_size=16, kv_cache_tokens=2560, max_model_len=512,
                  enable_prefix_caching=False)  # the layouts alone: no cache on either side
        llm.generate(prompts[:2], params)  # warm-up
        start = llm.llm_engine.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        outputs[layout] = [o.outputs[0].token_ids for o in outs]
        trace = [r for r in llm.llm_engine.step_trace if r.step > start]
        rows.append({"run": "real model, 16 requests", "kv_layout": layout,
                     "peak_running": max(r.num_running for r in trace),
                     "tok_s": round(16 * 24 / wall, 1)})
    rows[-1]["identical_to_contiguous"] = outputs["paged"] == outputs["contiguous"]
    return rows


def cow(repeats: int = 3, model: str | None = None, progress: bool = True) -> list[dict]:
    """Chapter 02: peak KV blocks saved by sharing, parallel sampling n and beam width k (block
    counts are exact, so one run each; `repeats` is not used)."""
    return cow_savings(model=model, progress=progress)


@dataclass(frozen=True)
class Experiment:
    chapter: str
    summary: str
    run: Callable[..., list[dict]]


EXPERIMENTS: dict[str, Experiment] = {
    "paged-admission": Experiment("01", "requests at once, contiguous vs paged KV",
                                  paged_admission),
    "cow": Experiment("02", "peak KV blocks saved by sharing (n, beam width)", cow),
    "continuous-batching": Experiment("03", "throughput and TTFT, one at a time vs continuous",
                                      continuous_batching),
    "kv-capacity": Experiment("03", "concurrency past the KV budget: knee and preemptions",
                              kv_capacity),
    "chunked-prefill": Experiment("04", "worst decode gap per token budget", chunked_prefill),
    "prefix-cache": Experiment("05", "TTFT cold vs warm prefix", prefix_cache),
    "cache-salt": Experiment("06", "salt table and the timing attack", cache_salt),
}


def format_table(rows: list[dict]) -> str:
    """Rows as an aligned text table; columns are the union of the rows' keys, in order."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)


def save_rows(rows: list[dict], out_dir: Path, name: str) -> list[Path]:
    """`name`.json (the rows as they are) and `name`.csv (lists and flags as JSON text)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{name}.json", out_dir / f"{name}.csv"
    json_path.write_text(json.dumps(rows, indent=2))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({c: _cell(r[c]) if c in r else "" for c in columns} for r in rows)
    return [json_path, csv_path]


def run_experiments(names: list[str], repeats: int = 3, model: str | None = None,
              out_dir: Path | None = None, progress: bool = True) -> dict[str, list[dict]]:
    """Run the named experiments in order; print each table; save JSON and CSV to `out_dir`."""
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    results = {}
    for name in names:
        exp = EXPERIMENTS[name]
        rows = exp.run(repeats=repeats, model=model, progress=progress)
        results[name] = rows
        print(f"\n== {name} (chapter {exp.chapter}) ==\n{format_table(rows)}", flush=True)
        if out_dir is not None:
            paths = save_rows(rows, out_dir, name)
            print("saved " + ", ".join(str(p) for p in paths), flush=True)
    return results

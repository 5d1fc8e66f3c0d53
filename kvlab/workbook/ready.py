"""Is this laptop ready for the workshop? One command a participant runs at home the day before.

    python -m kvlab.workbook.ready        (or, in a clone: make ready)

It loads the packaged model (the first load de-quantises it once and caches it, so the day
starts warm), runs a short decode benchmark (about ten seconds), reads the memory, and prints
`READY` or `TOO SLOW` / `NOT ENOUGH MEMORY` with the measured threshold and what to do.

The threshold is measured, not guessed. `reference.json` beside this file holds the machine that
executed the committed notebooks: its score on the same benchmark, each path's run time there,
and each session's reserve: three hours less the arrival, the break and its chapters as two
cold readers timed them (kvlab.workbook.agenda.COLD_READ_MINUTES). A laptop k times slower than
that machine runs each path's cells in k times their time; it is too slow when, for some
session, that extra time no longer fits the reserve: (k - 1) x the session's path run time >
reserve. The memory needed is the largest chapter's measured peak (notebooks/timings.json) plus
what JupyterLab and a browser tab take (BROWSER_MIB, an allowance).

`python -m kvlab.workbook.ready --record` (run alone, on the machine that executed the notebooks,
after scripts/execute_notebooks.py) writes the reference's benchmark; the chapters' part is
rewritten from the notebooks and timings.json by scripts/execute_notebooks.py, and
tests/workbook/test_ready.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REFERENCE = Path(__file__).with_name("reference.json")
BROWSER_MIB = 1536  # JupyterLab's server and one browser tab: an allowance, not a measurement
BENCH_REQUESTS, BENCH_TOKENS, BENCH_REPEATS = 8, 32, 3
CPU_TORCH = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")


def available_mib() -> float | None:
    """Memory a new program can have (Linux MemAvailable; elsewhere psutil when installed)."""
    from kvlab.workbook.session import proc_mib

    mib = proc_mib("/proc/meminfo", "MemAvailable")
    if mib is not None:
        return mib
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available / 2**20


def benchmark() -> dict:
    """The first model load, then decode tokens/s of BENCH_REQUESTS requests decoded together
    (greedy, BENCH_TOKENS new tokens each), the median of BENCH_REPEATS runs after a warm-up."""
    import kvlab
    from kvlab import LLM, SamplingParams

    start = time.perf_counter()
    loaded = kvlab.load_model()
    load_s = time.perf_counter() - start
    llm = LLM(max_model_len=256, kv_cache_tokens=2048, enable_prefix_caching=False)
    tok = loaded.tokenizer
    prompts = [{"prompt_token_ids": tok(f"Request {i}: the KV cache holds").input_ids}
               for i in range(BENCH_REQUESTS)]
    params = SamplingParams(max_tokens=BENCH_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(BENCH_REPEATS):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(BENCH_REQUESTS * BENCH_TOKENS / (time.perf_counter() - t0))
    return {"load_s": round(load_s, 1), "decode_tok_s": round(statistics.median(rates), 1),
            "decode_tok_s_runs": [round(r, 1) for r in rates]}


def threshold(reference: dict) -> tuple[float, str]:
    """(the slowest score at which every session still fits, the session that sets it)."""
    best_k, which = float("inf"), ""
    for name, sess in reference["sessions"].items():
        if sess["path_run_s"] <= 0:
            continue
        k = 1 + 60 * sess["reserve_minutes"] / sess["path_run_s"]
        if k < best_k:
            best_k, which = k, name
    return reference["decode_tok_s"] / best_k, which


def verdict(score: dict, reference: dict, avail_mib: float | None) -> tuple[bool, list[str]]:
    """(ready, the lines to print) for a measured `score` against `reference`."""
    lines = []
    slowest, session = threshold(reference)
    k = reference["decode_tok_s"] / score["decode_tok_s"]
    fast = score["decode_tok_s"] >= slowest
    lines.append(f"decode: {score['decode_tok_s']:.0f} tokens/s (runs: "
                 f"{', '.join(f'{r:.0f}' for r in score['decode_tok_s_runs'])}); the workbook's "
                 f"machine ({reference['machine']}): {reference['decode_tok_s']:.0f}, so its "
                 f"cells run about {k:.1f}x as long here")
    lines.append(f"too slow below {slowest:.0f} tokens/s: there the paths' cells of {session}, "
                 f"run that much longer, no longer fit its three hours")
    need = max(c["peak_mib"] for c in reference["chapters"].values()) + BROWSER_MIB
    enough = avail_mib is None or avail_mib >= need
    if avail_mib is None:
        lines.append(f"memory: not readable here; the workbook needs about {need / 1024:.1f} GB "
                     "free (its largest chapter, JupyterLab and a browser tab)")
    else:
        lines.append(f"memory: {avail_mib / 1024:.1f} GB available; the workbook needs about "
                     f"{need / 1024:.1f} GB (its largest chapter's measured peak, plus "
                     f"{BROWSER_MIB / 1024:.1f} GB for JupyterLab and a browser tab)")
    if not enough:
        lines.append("NOT ENOUGH MEMORY: close other programs (browsers with many tabs, video "
                     "calls) and run this again; shut each chapter's kernel down before the next")
    if not fast:
        lines.append("TOO SLOW: run the long measurements small (`%env KVLAB_SIZE=small` in a "
                     "notebook, or `KVLAB_SIZE=small make lab`), close other programs, plug the "
                     "laptop in; or pair with a faster laptop on the day")
    if fast and enough:
        lines.append("READY")
    return fast and enough, lines


def torch_build_note() -> str | None:
    """A CUDA build of torch on a machine without an NVIDIA GPU: gigabytes for nothing."""
    import torch

    if torch.version.cuda and not torch.cuda.is_available() and platform.system() == "Linux":
        return (f"note: this torch ({torch.__version__}) is a CUDA build, but no NVIDIA GPU is "
                f"visible; the CPU build is enough and far smaller: {CPU_TORCH}")
    return None


def chapters_part(notebooks: dict, timings: dict) -> dict:
    """The reference's chapters, sessions and machine, from the notebooks (`notebooks`: chapter
    number -> path) and notebooks/timings.json's content: each path's run time and its kernel's
    measured peak; each session's paths' run time, and its reserve: three hours less the arrival,
    the break and its chapters as the cold readers timed them (agenda.COLD_READ_MINUTES)."""
    from kvlab.workbook import agenda

    chapters = {}
    for number, path in notebooks.items():
        run = timings["notebooks"].get(Path(path).stem, {})
        chapters[number] = {"path_run_s": agenda.chapter_clock(path)["path_run_s"],
                            "peak_mib": run.get("peak_mib", 0)}
    sessions = {}
    for s in agenda.SESSIONS:
        used = (agenda.ARRIVAL_MINUTES + agenda.BREAK_MINUTES
                + sum(agenda.COLD_READ_MINUTES[n] for n in s["chapters"]))
        sessions[s["name"]] = {
            "path_run_s": round(sum(chapters[n]["path_run_s"] for n in s["chapters"]), 1),
            "reserve_minutes": agenda.SESSION_MINUTES - used}
    return {"machine": timings["machine"], "chapters": chapters, "sessions": sessions}


def write_chapters_part(notebooks: dict, timings: dict, path: Path = REFERENCE) -> None:
    ref = json.loads(path.read_text()) if path.exists() else {}
    ref.update(chapters_part(notebooks, timings))
    path.write_text(json.dumps(ref, indent=1, sort_keys=True) + "\n")


def record(score: dict, path: Path = REFERENCE) -> None:
    ref = json.loads(path.read_text()) if path.exists() else {"chapters": {}}
    ref.update({"decode_tok_s": score["decode_tok_s"], "decode_tok_s_runs":
                score["decode_tok_s_runs"], "benchmark_date": time.strftime("%Y-%m-%d"),
                "benchmark_machine": session_machine()})
    path.write_text(json.dumps(ref, indent=1, sort_keys=True) + "\n")


def session_machine() -> str:
    """The CPU's model name and core count, as scripts/execute_notebooks.py names a machine."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true",
                        help="write this machine's score into the reference (maintainers)")
    args = parser.parse_args(argv)
    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{session_machine()}", flush=True)
    note = torch_build_note()
    if note:
        print(note)
    print("loading the model and running a short benchmark (about half a minute) ...", flush=True)
    score = benchmark()
    print(f"model loaded in {score['load_s']:.0f} s (the first load on a laptop de-quantises "
          "and caches it; later loads take a few seconds)")
    if args.record:
        record(score)
        print(f"recorded {score['decode_tok_s']:.0f} tokens/s into {REFERENCE}")
        return 0
    ok, lines = verdict(score, json.loads(REFERENCE.read_text()), available_mib())
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

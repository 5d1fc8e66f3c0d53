"""Chapter 07 challenge, the capstone: tune the engine for a workload and an SLO (the tuning lab).

What it asks: the settings (max_num_seqs, max_num_batched_tokens, block_size, kv_cache_dtype,
long_prefill_token_threshold) under which most requests of a stated workload meet a latency
SLO, in a fixed KV memory budget. Graded by goodput (kvlab/bench/goodput.py: the requests
within every bound, per second) for the participant's settings, a reference tuning and
kvlab's defaults, side by side.

Each run is the real engine on the real model: it schedules, preempts and generates every
token. Its clock is chapter 04's model of a step (`StepCost`: the decode step, plus a price per
prompt token and per extra decode), measured on this machine first, once for each block size
and KV precision a run uses. So a busy laptop cannot change the verdict, and the same settings
get the same latencies every time. Time is counted in this machine's decode steps, and
arrivals come at a rate in the same unit: on a faster or slower laptop the workload and the
bounds scale together.

`try_settings(**knobs)` runs the workload once with any settings and prints what it measured:
the bench participants try settings on before they hand in a choice.
"""

from __future__ import annotations

from kvlab.bench.goodput import SLO, Replay, StepCost, Workload, measure_step_cost, replay
from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, positive_int

# The workload, with time in decode steps: 14 requests, one arriving every 10 decode steps on
# average (Poisson); a quarter carry a document. (Chosen on a 2-core Xeon, one thread, where
# the defaults met the SLO for 9 of the 14 requests and the reference for all 14.)
NUM_REQUESTS = 14
MEAN_GAP_STEPS = 10
SHORT_PROMPT = (16, 64)
LONG_PROMPT = (256, 384)
LONG_SHARE = 0.25
OUTPUT_LEN = (6, 16)
# The SLO per request, in decode steps: the first token within 40, no gap between two of its
# tokens over 6 (a stream that stalls is what a reader notices; TPOT would average it away).
TTFT_STEPS = 40
MAX_GAP_STEPS = 6
# The KV memory: 768 tokens at float32 (SmolLM2-135M: 46,080 bytes a token).
KV_CACHE_MEMORY_BYTES = 768 * 46_080
KNOBS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_dtype",
         "long_prefill_token_threshold")
# The precisions within chapter 08's KL bound (its challenge's MAX_KL), as chapter 08 measured.
KV_CACHE_DTYPES = ("auto", "int8_per_token_head")
BLOCK_SIZES = (8, 16, 32)
TOLERANCE = 0.80  # a choice within this share of the best goodput measured passes


def my_tuning():
    """The reference tuning for the lab's workload."""
    # A whole document prefilled in one step stalls every stream in that step (chapter 04),
    # so the step's prompt tokens are capped. But a cap alone lets a document's chunk take the
    # whole budget while short prompts wait behind it: long_prefill_token_threshold caps what
    # one prompt takes per step, so short ones fit beside it and start at once. The other
    # settings stay at kvlab's defaults: the pool is not what binds here.
    return {"max_num_batched_tokens": 192, "long_prefill_token_threshold": 64}


TUNING_STUB = '''def my_tuning():
    """Return a dict of engine settings for the lab's workload: any of max_num_seqs,
    max_num_batched_tokens, block_size (8, 16 or 32), kv_cache_dtype ("auto" or
    "int8_per_token_head", the precisions within chapter 08's KL bound) and
    long_prefill_token_threshold (0: off); a setting left out keeps kvlab's default, and {} is
    the defaults. The KV memory is fixed (kv_cache_memory_bytes, 768 tokens at float32). The
    check runs the workload with yours, a reference tuning and the defaults, and compares
    goodput: the requests per second that met the SLO."""
    raise NotImplementedError("your turn")
'''


def workload(unit_s: float) -> Workload:
    return Workload(num_requests=NUM_REQUESTS, rate=1 / (MEAN_GAP_STEPS * unit_s),
                    short_prompt=SHORT_PROMPT, long_prompt=LONG_PROMPT, long_share=LONG_SHARE,
                    output_len=OUTPUT_LEN, seed=0)


def slo(unit_s: float) -> SLO:
    return SLO(ttft_s=TTFT_STEPS * unit_s, max_gap_s=MAX_GAP_STEPS * unit_s)


def settings(value) -> dict:
    """The participant's dict, checked before any engine is built."""
    if not isinstance(value, dict):
        raise Mismatch("a dict of settings ({} keeps every default)", repr(value)[:80])
    unknown = sorted(set(value) - set(KNOBS))
    if unknown:
        raise Mismatch(f"settings among {', '.join(KNOBS)}", f"{unknown}")
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if key in value:
            positive_int(value[key], f"{key}: an int >= 1")
    if "long_prefill_token_threshold" in value:
        v = value["long_prefill_token_threshold"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise Mismatch("long_prefill_token_threshold: an int >= 0 (0: off)", repr(v))
    if value.get("block_size", 16) not in BLOCK_SIZES:
        raise Mismatch(f"block_size among {BLOCK_SIZES}", repr(value["block_size"]))
    if value.get("kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        raise Mismatch(f"kv_cache_dtype among {KV_CACHE_DTYPES} (chapter 08's KL bound)",
                       repr(value["kv_cache_dtype"]))
    return dict(value)


def step_cost(knobs: dict, cache: dict) -> StepCost:
    """This machine's step cost at these settings' block size and KV precision, measured once
    per pair and kept in `cache`."""
    key = (knobs.get("block_size", 16), knobs.get("kv_cache_dtype", "auto"))
    if key not in cache:
        cache[key] = measure_step_cost(block_size=key[0], kv_cache_dtype=key[1])
    return cache[key]


def run_once(knobs: dict, cost: StepCost, unit_s: float) -> Replay:
    """The workload once through a fresh engine with these settings, on `cost`'s clock, with
    time in units of `unit_s` (the default settings' decode step)."""
    from kvlab.engine import LLM
    from kvlab.sampling import SamplingParams

    work = workload(unit_s)
    try:
        llm = LLM(kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES, max_model_len=work.max_len(),
                  **knobs)
    except ValueError as e:  # settings the engine refuses together, said in its words
        raise Mismatch("settings the engine accepts", str(e)) from None
    llm.generate({"prompt_token_ids": _real_engine.prompt_ids([64])[0]},
                 SamplingParams(max_tokens=4))  # warm-up
    return replay(llm, work, step_cost=cost)


def vllm_serve_command(knobs: dict) -> str:
    """The same settings as a `vllm serve` command line (kvlab serve takes the same flags)."""
    flags = [f"--kv-cache-memory-bytes {KV_CACHE_MEMORY_BYTES}"]
    flags += [f"--{k.replace('_', '-')} {knobs[k]}" for k in KNOBS if k in knobs]
    return "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct " + " ".join(flags)


def _line(name: str, s: dict) -> str:
    return (f"{name}: {s['met']}/{s['of']} within the SLO ({s['missed_ttft']} late first "
            f"token, {s['missed_gap']} stalled), goodput {s['goodput']:.2f} req/s; TTFT p50 "
            f"{s['p50_ttft_s']:.2f} s, p99 {s['p99_ttft_s']:.2f} s; worst gap p50 "
            f"{s['p50_max_gap_ms']:.0f} ms, p99 {s['p99_max_gap_ms']:.0f} ms; "
            f"{s['preemptions']} preemptions")


# Step costs measured in this process, by (block_size, kv_cache_dtype): try_settings measures
# each pair once, so that every try is judged on the same clock.
_COSTS: dict = {}


def describe() -> str:
    """The workload, the SLO and the memory, in words (what the chapter's prose refers to)."""
    return (f"the workload: {NUM_REQUESTS} requests, Poisson arrivals one every "
            f"{MEAN_GAP_STEPS} decode steps on average; {1 - LONG_SHARE:.0%} with a prompt of "
            f"{SHORT_PROMPT[0]}-{SHORT_PROMPT[1]} tokens, {LONG_SHARE:.0%} with a document of "
            f"{LONG_PROMPT[0]}-{LONG_PROMPT[1]}; {OUTPUT_LEN[0]}-{OUTPUT_LEN[1]} new tokens each. "
            f"The SLO: the first token within {TTFT_STEPS} decode steps of arrival, no gap "
            f"between two tokens over {MAX_GAP_STEPS}. KV memory: {KV_CACHE_MEMORY_BYTES:,} "
            f"bytes ({KV_CACHE_MEMORY_BYTES // 46_080} tokens at float32)")


def try_settings(**knobs) -> dict:
    """Run the lab's workload once with these settings and print what it measured."""
    knobs = settings(knobs)
    print(describe())
    with _real_engine.one_thread():
        unit = step_cost({}, _COSTS).decode_s
        run = run_once(knobs, step_cost(knobs, _COSTS), unit)
    summary = run.summary(slo(unit))
    print(f"decode step here: {unit * 1000:.0f} ms, so the SLO is TTFT <= "
          f"{TTFT_STEPS * unit:.2f} s and no gap over {MAX_GAP_STEPS * unit * 1000:.0f} ms")
    print(_line(str(knobs or "defaults"), summary))
    print(f"the step model's clock ran {run.duration_s:.1f} s; the engine's calls took "
          f"{run.measured_s:.1f} s of wall time")
    print(vllm_serve_command(knobs))
    return summary


def _why(mine: dict, ref: dict, knobs: dict, unit_s: float) -> str:
    """What the measurements say held yours back, in the chapters' terms."""
    reasons = []
    if mine["missed_gap"] > ref["missed_gap"]:
        reasons.append(f"{mine['missed_gap']} streams stalled past "
                       f"{MAX_GAP_STEPS * unit_s * 1000:.0f} ms (the reference: "
                       f"{ref['missed_gap']}): a step that carries a long prompt's tokens "
                       "delays every decode in it (chapter 04)")
    if mine["missed_ttft"] > ref["missed_ttft"]:
        reasons.append(f"{mine['missed_ttft']} first tokens came late (the reference: "
                       f"{ref['missed_ttft']}): a small token budget spreads a prompt over "
                       "many steps, and one long prompt's chunk can take the whole budget "
                       "while short prompts wait (long_prefill_token_threshold caps one "
                       "prompt's share)")
    if mine["preemptions"] > ref["preemptions"]:
        reasons.append(f"{mine['preemptions']} preemptions: more running requests than the KV "
                       "budget holds, each recomputed from its prompt (chapter 03)")
    if knobs.get("kv_cache_dtype", "auto") != "auto":
        reasons.append("the quantized cache holds more tokens, but this pool was not what "
                       "bound, and each step pays to quantize and read it back (chapter 08)")
    return "; ".join(reasons) or "the runs were close: compare the lines above"


def _lab_measured(impl) -> str:
    knobs = settings(impl())
    configs = {"yours": knobs, "reference": my_tuning(), "defaults": {}}
    cache: dict = {}  # measured afresh for each check, shared by the three runs
    with _real_engine.one_thread():
        unit = step_cost({}, cache).decode_s
        runs = {name: run_once(cfg, step_cost(cfg, cache), unit)
                for name, cfg in configs.items()}
    summaries = {name: run.summary(slo(unit)) for name, run in runs.items()}
    lines = (f"decode step here {unit * 1000:.0f} ms (SLO: first token within {TTFT_STEPS}, "
             f"gaps within {MAX_GAP_STEPS} steps). "
             + ". ".join(_line(name, s) for name, s in summaries.items()))
    if (knobs.get("kv_cache_dtype", "auto") == "auto"
            and runs["yours"].tokens != runs["reference"].tokens):
        raise Mismatch("the same greedy tokens as the reference tuning's run",
                       "different tokens", lines)
    best = max(summaries["reference"]["goodput"], summaries["defaults"]["goodput"])
    share = summaries["yours"]["goodput"] / best if best else 1.0
    verdict = (f"{lines}. Yours: {share:.0%} of the best goodput measured. "
               f"As a command line: {vllm_serve_command(knobs)}")
    if share < TOLERANCE:
        raise Mismatch(f"goodput within {1 - TOLERANCE:.0%} of the best measured", verdict,
                       _why(summaries["yours"], summaries["reference"], knobs, unit))
    return verdict


TUNING_LAB = Exercise(
    name="tuning_lab",
    chapter="07_capstone",
    title="tune the engine for an SLO",
    kind="challenge",
    prompt=(
        "Choose the engine's settings for a stated workload so that as many requests as "
        "possible meet a latency SLO, in a fixed KV memory. Try settings with "
        "lab.try_settings(...) first: each run takes about ten seconds. The check runs "
        "yours, a reference tuning and the defaults and compares goodput."
    ),
    full_version=(
        "vLLM's benchmark measures goodput the same way against a running server "
        "(vllm bench serve --goodput ttft:MS tpot:MS e2el:MS, vllm/benchmarks/serve.py), with "
        "TPOT, a mean, where this lab bounds the worst gap. A real tuning also sweeps the "
        "arrival rate: the settings that win at one load can lose at another. The stall is "
        "chapter 04's, the pool's limits chapter 03's, the precisions chapter 08's."
    ),
    stub=TUNING_STUB,
    hint=(
        "Run lab.try_settings() with no settings first: which bound do the defaults miss, "
        "the first token or the gaps? Then ask what sets the longest step, and what keeps a "
        "short prompt waiting while a document is being prefilled."
    ),
    solution=my_tuning,
    cases=[
        Case("your settings, by name and range", lambda impl: settings(impl()),
             "A dict of the lab's settings; {} keeps the defaults."),
        Case(f"real model: {NUM_REQUESTS} requests, yours beside a reference tuning and the "
             "defaults", _lab_measured,
             "Read which bound your settings missed in the lines above.", real_model=True,
             timeout_s=900),
    ],
)

EXERCISES = [TUNING_LAB]

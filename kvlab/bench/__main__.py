"""`python -m kvlab.bench COMMAND`: the benchmarks as a command line."""

from __future__ import annotations

import argparse
import json

from kvlab.bench import cow_savings, speed
from kvlab.bench import prefix, scheduling


def print_json(row) -> None:
    """One result as a JSON line, flushed: long runs show each as it comes."""
    print(json.dumps(row), flush=True)


def scheduling_targets(repeats: int = 3, model: str | None = None) -> dict:
    """Chapters 03-04's measurements in one run: throughput ratios, the stall at budget 128 against no
    chunking with its linear fit over budgets, and the engine overhead at 64 running."""
    out = {"throughput": scheduling.throughput_targets(repeats=repeats, model=model)}
    print_json(out["throughput"])
    runs = scheduling.chunked_prefill_table((64, 128, 256, 512, None), 1024, repeats, model)
    gaps = {str(r.budget): round(1000 * r.max_gap, 1) for r in runs}
    chunked = [r for r in runs if r.budget is not None]
    a, b, r2 = scheduling.fit_line([r.budget for r in chunked], [r.max_gap for r in chunked])
    out["stall"] = {"long_prompt": 1024, "max_gap_ms": gaps,
                    "inserted_ttft_ms": {str(r.budget): round(1000 * r.inserted_ttft, 1)
                                         for r in runs},
                    "unchunked_over_budget_128": round(gaps["None"] / gaps["128"], 2),
                    "fit_ms": [round(1000 * a, 2), round(1000 * b, 4)], "fit_r2": round(r2, 4)}
    print_json(out["stall"])
    out["overhead"] = scheduling.engine_overhead(64, model=model)
    print_json(out["overhead"])
    return out


def prefix_targets(model: str | None = None) -> dict:
    """Chapters 05-06's measurements in one run: warm vs cold TTFT for a 2,048-token prefix + 32-token
    tails, the throughput cost with no shared prefix, the attack with and without salts."""
    out = {"cold_warm": prefix.cold_warm_ttft(2048, 32, model=model)}
    print_json(out["cold_warm"])
    out["no_sharing_cost"] = prefix.no_shared_prefix_cost(model=model)
    print_json(out["no_sharing_cost"])
    for salted in (False, True):
        r = prefix.timing_attack(trials=20, salted=salted, model=model)
        r.pop("rows")
        out["attack_salted" if salted else "attack"] = r
        print_json(r)
    out["salt_table"] = prefix.salt_table(model=model)
    print_json(out["salt_table"])
    return out


def client_benchmark(args) -> dict:
    """Distinct random-token prompts (no accidental prefix-cache hits), streamed."""
    import asyncio
    import random

    from kvlab.bench.stream_client import run_benchmark
    from kvlab.bench.prefix import random_prompt

    rng = random.Random(0)
    prompts = [random_prompt(rng, args.input_len) for _ in range(args.num_requests)]
    out = asyncio.run(run_benchmark(args.base_url, prompts, args.model, args.max_tokens,
                                    args.concurrency, args.request_rate))
    out.pop("results")
    print_json(out)
    return out


def parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per benchmark (main() runs the one chosen)."""
    cli = argparse.ArgumentParser(prog="python -m kvlab.bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = cli.add_subparsers(dest="command", required=True)
    p = sub.add_parser("speed", help="kvlab vs transformers generate at batch 1 and 16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the rows to this file")
    p = sub.add_parser("cow", help="KV memory saved by block sharing (n and beam width)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 512])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the rows to this file")
    p = sub.add_parser("sched", help="continuous batching, stall, overhead against their targets")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the results to this file")
    p = sub.add_parser("prefix", help="prefix caching: cold/warm TTFT, cost with no sharing, salts")
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the results to this file")
    p = sub.add_parser("compiled-flex", help="compiled FlexAttention on this machine: graphs "
                                             "compiled over a varied run, tokens against "
                                             "reference, time against the default path")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the results to this file")
    from kvlab.bench.kv_dtype import DTYPES

    p = sub.add_parser("kv-dtype", help="KV density by precision (vLLM's kv_cache_dtype): "
                                        "bytes per token, requests that fit, accuracy against "
                                        "the full-precision cache, quantize/dequantize time")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), metavar="NAME")
    p.add_argument("--memory-bytes", type=int, default=64 * 2**20,
                   help="kv_cache_memory_bytes, the same for every precision")
    p.add_argument("--request-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="decode batch of the timed step")
    p.add_argument("--context", type=int, default=256, help="context of the timed step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for the whole run (default: torch's own)")
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the rows to this file")
    p = sub.add_parser("weights-dtype", help="bfloat16 weights against float32: decode steps "
                                             "against each dtype's ceiling, tokens against "
                                             "transformers in the same dtype")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the results to this file")
    p = sub.add_parser("client", help="stream requests to any OpenAI-compatible endpoint")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="the model name the server expects (default: the one /v1/models lists)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", help="also write the results to this file")
    from kvlab.bench.api_experiments import API_EXPERIMENTS, SIZES
    from kvlab.bench.reproduce import EXPERIMENTS

    p = sub.add_parser("reproduce", help="the cited experiments each chapter reproduces, "
                                         "tables saved as JSON and CSV; with --base-url, "
                                         "those measurable from outside, through any "
                                         "OpenAI-compatible server (vLLM, kvlab serve)")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"any of {', '.join(EXPERIMENTS)} (default: all, in chapter order); "
                        f"with --base-url any of {', '.join(API_EXPERIMENTS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None,
                   help="in process: the model to load; with --base-url: the name the server "
                        "serves (default: the first /v1/models lists)")
    p.add_argument("--out", default="bench-results", help="folder for NAME.json and NAME.csv")
    p.add_argument("--base-url", default=None,
                   help="measure this server through its API instead (e.g. http://127.0.0.1:8000)")
    p.add_argument("--size", choices=list(SIZES), default="full",
                   help="with --base-url: request counts and lengths (small: a test's)")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help="with --base-url: fields every request carries instead of the probed "
                        "ignore_eos (e.g. a server's own generation config)")
    p = sub.add_parser("peers", help="kvlab vs transformers generate and generate_batch, and "
                                     "kvlab's fraction of this machine's ceiling (the roofline "
                                     "sweep first)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the results to this file")
    p = sub.add_parser("roofline", help="decode steps by batch and context against "
                                        "this machine's roofline, cost per context token, "
                                        "engine overhead, mixed steps")
    p.add_argument("--attention", choices=["current", "padded"], default="current",
                   help="padded: the older decode path (a padded copy per layer), for a before/after")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed-step measurement")
    p.add_argument("--model", default=None)
    p.add_argument("--json", help="also write the results to this file")
    p = sub.add_parser("serve-peers", help="kvlab serve vs transformers serve: one streaming "
                                           "client, TTFT, ITL and tokens/s by concurrency")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--num-requests", type=int, default=None,
                   help="per concurrency (default: three waves, at least 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--words", type=int, default=96, help="words per prompt")
    p.add_argument("--model", default=None, help="a local folder (default: the packaged model)")
    p.add_argument("--json", help="also write the results to this file")
    return cli


def reproduce(args, parser: argparse.ArgumentParser) -> None:
    """The chapters' experiments: in process, or through a server's API with --base-url."""
    from pathlib import Path

    from kvlab.bench.api_experiments import API_EXPERIMENTS
    from kvlab.bench.reproduce import EXPERIMENTS, run_experiments

    if args.base_url:
        from kvlab.bench.api_experiments import run_api_experiments

        unknown = sorted(set(args.names) - set(API_EXPERIMENTS))
        if unknown:
            parser.error(f"unknown experiment(s) {unknown}; through the API: "
                         f"{list(API_EXPERIMENTS)}")
        run_api_experiments(args.base_url, args.names, args.model, args.size,
                            json.loads(args.extra_body) if args.extra_body else None,
                            Path(args.out), printer=lambda s: print(s, flush=True))
        return
    unknown = sorted(set(args.names) - set(EXPERIMENTS))
    if unknown:
        parser.error(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    run_experiments(args.names or list(EXPERIMENTS), args.repeats, args.model, Path(args.out))


def serve_peers(args):
    from kvlab.bench import online_peers

    rows = online_peers.compare_servers(
        tuple(args.concurrency), args.max_tokens, args.words,
        args.num_requests or online_peers.default_num_requests, args.model)
    print(online_peers.report(rows), flush=True)
    return rows


def peers(args) -> dict:
    from kvlab.bench import offline_peers
    from kvlab.bench.roofline import roofline

    rows = {"roofline": roofline(args.model, log=print_json)}
    rows["ceiling"] = offline_peers.ceiling_fraction(model=args.model)
    print_json(rows["ceiling"])
    rows["peers"] = offline_peers.compare_peers(repeats=args.repeats, model=args.model)
    print_json(rows["peers"])
    return rows


def roofline_sweep(args):
    from kvlab.bench.roofline import PaddedDecodeBackend, roofline

    return roofline(args.model, mixed=not args.no_mixed,
                    attention=PaddedDecodeBackend if args.attention == "padded" else None,
                    log=print_json)


def kv_dtype(args):
    from kvlab.bench.kv_dtype import kv_dtype_table, report

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    rows = kv_dtype_table(tuple(args.dtypes), args.memory_bytes, args.request_len,
                          args.num_prompts, args.prompt_len, args.max_tokens,
                          batch=args.batch, context=args.context, repeats=args.repeats,
                          model=args.model)
    print(report(rows), flush=True)
    return rows


def weights_dtype(args):
    from kvlab.bench.weights_dtype import report, weights_dtype_table

    rows = weights_dtype_table(batches=tuple(args.batches), context=args.context,
                               steps=args.steps, model=args.model)
    print(report(rows), flush=True)
    return rows


def compiled_flex(args):
    from kvlab.bench.compiled_flex import compiled_flex_report

    return compiled_flex_report(args.steps, args.repeats, args.model)


def cow(args):
    rows = cow_savings(tuple(args.prompt_lens), max_tokens=args.max_tokens, model=args.model)
    for row in rows:
        print_json(row)
    return rows


# Every subcommand but reproduce (which saves its own files): the function that runs it, whose
# rows --json writes.
COMMANDS = {
    "serve-peers": serve_peers,
    "peers": peers,
    "roofline": roofline_sweep,
    "client": lambda args: client_benchmark(args),
    "kv-dtype": kv_dtype,
    "weights-dtype": weights_dtype,
    "compiled-flex": compiled_flex,
    "prefix": lambda args: prefix_targets(args.model),
    "speed": lambda args: speed(tuple(args.batch_sizes), args.max_tokens, args.repeats,
                                model=args.model),
    "sched": lambda args: scheduling_targets(args.repeats, args.model),
    "cow": cow,
}


def main(argv=None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    if args.command == "reproduce":
        reproduce(args, cli)
        return
    rows = COMMANDS[args.command](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

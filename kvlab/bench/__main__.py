"""`python -m kvlab.bench COMMAND`: the benchmarks as a command line."""

from __future__ import annotations

import argparse
import json

from kvlab.bench import cow_savings, speed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
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
    args = parser.parse_args(argv)
    if args.command == "speed":
        rows = speed(tuple(args.batch_sizes), args.max_tokens, args.repeats, model=args.model)
    else:
        rows = cow_savings(tuple(args.prompt_lens), max_tokens=args.max_tokens, model=args.model)
        for row in rows:
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

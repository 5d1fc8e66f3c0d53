"""`kvlab serve ...`: vLLM's flag names, mapped onto `LLM(...)`."""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="kvlab")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="an OpenAI-compatible server on localhost")
    p.add_argument("model", nargs="?", default=None, help="hub id or folder (default: packaged)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)

    from kvlab.engine import LLM
    from kvlab.server import serve

    llm = LLM(args.model, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
              enable_prefix_caching=args.enable_prefix_caching,
              enable_chunked_prefill=args.enable_chunked_prefill)
    serve(llm, args.host, args.port)


if __name__ == "__main__":
    main()

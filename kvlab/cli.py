"""`kvlab serve ...`: vLLM's flag names, mapped onto `LLM(...)`.

Defined for notebook 07: `engine_kwargs(parser().parse_args([...]))` shows which `LLM` knob each
vLLM flag sets, so a command line carries over between the two.
"""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kvlab")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="an OpenAI-compatible server on localhost")
    p.add_argument("model", nargs="?", default=None, help="hub id or folder (default: packaged)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="kvlab-only: the KV budget in tokens (vLLM: --gpu-memory-utilization)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--prefix-caching-hash-algo", default="sha256")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (off, as in vLLM)")
    return top


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM(...)` keyword arguments a `kvlab serve` command line stands for."""
    return {"model": args.model, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "kv_cache_tokens": args.kv_cache_tokens,
            "enable_prefix_caching": args.enable_prefix_caching,
            "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
            "enable_chunked_prefill": args.enable_chunked_prefill}


def main(argv=None) -> None:
    args = parser().parse_args(argv)

    from kvlab.engine import LLM
    from kvlab.server import serve

    serve(LLM(**engine_kwargs(args)), args.host, args.port,
          enable_prompt_tokens_details=args.enable_prompt_tokens_details)


if __name__ == "__main__":
    main()

"""`kvlab serve ...`: vLLM's flag names, mapped onto `LLM(...)`.

Defined for notebook 07: `engine_kwargs(parser().parse_args([...]))` shows which `LLM` knob each
vLLM flag sets, so a command line carries over between the two; `server_kwargs` does the same for
the server's own options (`build_app(...)`).

Key mode, modelled on vLLM's `--api-key` / `VLLM_API_KEY` (the flag wins over the variable):
`--api-keys-file PATH` or `KVLAB_API_KEYS` holds {key: tenant} (a JSON object, or
`key1=tenant-a,key2=tenant-b`: see `kvlab.serve.tenants`), and `--salt-secret-file PATH` or
`KVLAB_SALT_SECRET` the secret the tenants' salts derive from. Unlike vLLM there is no flag that
takes a key itself: a command line is readable by every local user (`ps`, /proc/PID/cmdline).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Mapping

from kvlab.config import BACKENDS, EngineConfig
from kvlab.kv_quant import KV_CACHE_DTYPES
from kvlab.kv_transfer.kv_transfer_config import OFFLOADING_BACKENDS


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kvlab")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="an OpenAI-compatible server on localhost")
    p.add_argument("model", nargs="?", default=None, help="hub id or folder (default: packaged)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=16)
    # Unset: vLLM's 256, lowered to the step's token budget (vllm/engine/arg_utils.py).
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="kvlab-only: the KV budget in tokens (vLLM: --gpu-memory-utilization)")
    # vLLM's flags (vllm/config/cache.py, vllm/engine/arg_utils.py): how K/V are stored, and
    # the pool in bytes (not with --kv-cache-tokens).
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="the weights' and activations' dtype (vLLM's --dtype; auto: float32 on "
                        "a CPU, bfloat16 or float16 on a GPU)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="K/V storage precision (auto: the model's dtype)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="the KV pool's size in bytes (scales included)")
    # Unset: on, vLLM's default (vllm/config/cache.py), for the paged layout.
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--prefix-caching-hash-algo", default="sha256")
    # vLLM's flags (vllm/engine/arg_utils.py, vllm/config/cache.py): JSON laid over the model's
    # config (kvlab applies layer_types and sliding_window, chapter 09), and which blocks of a
    # sliding-window group are keyed ("none": every full block).
    p.add_argument("--hf-overrides", type=json_dict, default=None, metavar="JSON",
                   help='e.g. \'{"layer_types": [...], "sliding_window": 128}\'')
    p.add_argument("--prefix-cache-retention-interval", type=int_or_none, default=0)
    # Chapter 10, vLLM 0.33.0's flags (vllm/config/cache.py, vllm/config/kv_transfer.py,
    # vllm/engine/arg_utils.py): a second KV tier of this many GiB behind the pool, run by the
    # "native" backend (vLLM's OffloadingConnector; "lmcache" needs LMCache's server and is
    # refused at start), or a connector named outright as JSON (vLLM's KVTransferConfig fields
    # that kvlab reads: kv_connector, kv_role, kv_connector_extra_config,
    # kv_load_failure_policy). Numbers in that JSON may carry vLLM's suffixes: 80m, 2G.
    p.add_argument("--kv-offloading-size", type=gib, default=None, metavar="GIB",
                   help="size of the KV offloading tier in GiB (default: no offloading)")
    p.add_argument("--kv-offloading-backend", choices=OFFLOADING_BACKENDS, default="native",
                   help="the backend that runs the tier, once --kv-offloading-size is set "
                        "(kvlab runs 'native')")
    p.add_argument("--kv-transfer-config", type=json_config, default=None, metavar="JSON",
                   help='e.g. \'{"kv_connector": "ExampleConnector", "kv_role": "kv_both", '
                        '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}\'')
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    # vLLM 0.33.0's default loop (vllm/config/scheduler.py, vllm/config/vllm.py): schedule the
    # next step before reading this one's tokens. --no-async-scheduling: the synchronous loop.
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    # vLLM 0.33.0's scheduler flags (vllm/config/scheduler.py), with vLLM's defaults.
    p.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction,
                   default=True, help="admit a request only when its whole prompt fits")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's: the waiting queue's order (priority: a request's `priority`, "
                        "then arrival)")
    p.add_argument("--watermark", type=float, default=0.0,
                   help="fraction of KV blocks an admission must leave free")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request gets per step while others wait or "
                        "run (0: no cap)")
    p.add_argument("--long-prefill-token-threshold-adaptive",
                   action=argparse.BooleanOptionalAction, default=False,
                   help="raise that cap to max_num_batched_tokens / number of requests when "
                        "larger")
    # vLLM's two flags (vllm/engine/arg_utils.py); vLLM's --attention-backend takes its own
    # backends' names (FLASH_ATTN, FLEX_ATTENTION, CPU_ATTN: vllm/v1/attention/backends/
    # registry.py), kvlab's takes kvlab's three.
    p.add_argument("--attention-backend", choices=BACKENDS, default="auto",
                   help="kvlab's attention backend (LLM(backend=...))")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="never compile (unset: the flex backend compiles on a GPU only)")
    # vLLM 0.33.0's admission limit (vllm/config/scheduler.py, vllm/engine/arg_utils.py), checked
    # in the API server: a server option here (build_app), not an engine knob.
    p.add_argument("--max-num-queued-reqs", type=int, default=None, metavar="N",
                   help="most requests unfinished at once, waiting or running (n > 1 counts "
                        "n); past it a request gets a 503 to retry elsewhere (default: no "
                        "limit)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (off, as in vLLM)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: the model's own name)")
    # vLLM's observability flags (vllm/engine/arg_utils.py): the KV block residency histograms.
    # vLLM: off, sampling 0.01 of blocks; kvlab: on, every block (the pools here are small).
    p.add_argument("--kv-cache-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="the vllm:kv_block_* residency histograms on /metrics")
    p.add_argument("--kv-cache-metrics-sample", type=float, default=1.0,
                   help="fraction of KV blocks timed for those histograms")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="key mode: a JSON object {key: tenant} (or key=tenant pairs); every /v1 "
                        "request then needs 'Authorization: Bearer <key>' and gets its tenant's "
                        "cache salt (env: KVLAB_API_KEYS, same format)")
    p.add_argument("--salt-secret-file", default=None, metavar="PATH",
                   help="key mode: the secret (>= 32 bytes) the tenants' salts derive from; "
                        "default random at start, so cached prefixes do not survive a restart "
                        "(env: KVLAB_SALT_SECRET)")
    return top


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM(...)` keyword arguments a `kvlab serve` command line stands for."""
    return {"model": args.model, "dtype": args.dtype, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "kv_cache_tokens": args.kv_cache_tokens,
            "kv_cache_dtype": args.kv_cache_dtype,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "enable_prefix_caching": args.enable_prefix_caching,
            "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
            "enable_chunked_prefill": args.enable_chunked_prefill,
            "async_scheduling": args.async_scheduling,
            "scheduler_reserve_full_isl": args.scheduler_reserve_full_isl,
            "watermark": args.watermark, "policy": args.scheduling_policy,
            "long_prefill_token_threshold": args.long_prefill_token_threshold,
            "long_prefill_token_threshold_adaptive": args.long_prefill_token_threshold_adaptive,
            "backend": args.attention_backend, "enforce_eager": args.enforce_eager,
            "hf_overrides": args.hf_overrides,
            "prefix_cache_retention_interval": args.prefix_cache_retention_interval,
            "kv_offloading_size": args.kv_offloading_size,
            "kv_offloading_backend": args.kv_offloading_backend,
            "kv_transfer_config": args.kv_transfer_config}


def checked_engine_kwargs(args: argparse.Namespace) -> dict:
    """`engine_kwargs(args)`, checked as `LLM(...)` checks them (its `EngineConfig`) before any
    model is loaded. Raises ValueError naming the flags (--kv-offloading-size, not the knob
    kv_offloading_size) on a bad value or a bad combination."""
    kwargs = engine_kwargs(args)
    try:
        EngineConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(flag_message(str(e), args)) from None
    return kwargs


def flag_message(message: str, args: argparse.Namespace) -> str:
    """An engine error in the command line's words: each knob a flag sets named as that flag;
    an error inside --kv-transfer-config's JSON (a field of it) prefixed with the flag."""
    dests = {action.dest: action.option_strings[-1] for action in _serve_actions()
             if action.option_strings and "_" in action.dest}
    renamed = re.sub(r"\b(" + "|".join(map(re.escape, dests)) + r")\b",
                     lambda m: dests[m.group(1)], message)
    if renamed == message and args.kv_transfer_config is not None and re.search(
            r"\bkv_(connector|role|load_failure_policy)", message):
        renamed = f"--kv-transfer-config: {message}"
    return renamed


def _serve_actions():
    serve = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return serve.choices["serve"]._actions


def gib(text: str) -> float:
    """--kv-offloading-size: a size in GiB, > 0 and finite (vLLM's type is float)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size in GiB, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"a size in GiB, > 0, got {text!r}")
    return value


def json_config(text: str) -> dict:
    """A config flag's JSON object, as vLLM parses --kv-transfer-config
    (`_expand_json_human_readable_numbers`, vllm/engine/arg_utils.py): outside the strings a
    bare number may end in k, m, g, t (powers of 1000) or K, M, G, T (powers of 1024)."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)
    for i in range(0, len(parts), 2):  # even indices: outside the strings
        parts[i] = re.sub(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b",
                          lambda m: str(human_readable_int(m.group())), parts[i])
    return json_dict("".join(parts))


def human_readable_int(text: str) -> int:
    """'80m' -> 80_000_000, '2G' -> 2 * 2**30 (vllm/utils/argparse_utils.py)."""
    number, suffix = text[:-1], text[-1]
    if suffix in "kmgt":
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to "
            f"use {number}{suffix.lower()} instead?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def json_dict(text: str) -> dict:
    """A command-line JSON object (vLLM parses --hf-overrides the same way)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def int_or_none(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int or 'none', got {text!r}") from None


def server_kwargs(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict:
    """The `build_app(...)` keyword arguments a `kvlab serve` command line (and environment)
    stands for. Raises ValueError, never quoting a key or the secret, on a bad map or secret."""
    from kvlab.serve.protocol import check_max_num_queued_reqs
    from kvlab.serve.tenants import MIN_SECRET_BYTES, parse_api_keys

    max_num_queued_reqs = check_max_num_queued_reqs(args.max_num_queued_reqs)  # before the model
    environ = os.environ if environ is None else environ
    api_keys = salt_secret = None
    if args.api_keys_file:
        with open(args.api_keys_file, encoding="utf-8") as f:
            api_keys = parse_api_keys(f.read())
    elif environ.get("KVLAB_API_KEYS", "").strip():  # empty counts as unset, as VLLM_API_KEY
        api_keys = parse_api_keys(environ["KVLAB_API_KEYS"])
    if args.salt_secret_file:
        with open(args.salt_secret_file, "rb") as f:
            salt_secret = f.read().strip()  # `echo $SECRET > file` leaves a newline
    elif environ.get("KVLAB_SALT_SECRET", "").strip():
        salt_secret = environ["KVLAB_SALT_SECRET"].strip().encode("utf-8")
    if salt_secret is not None and len(salt_secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the salt secret must be at least {MIN_SECRET_BYTES} bytes")
    if salt_secret is not None and api_keys is None:
        raise ValueError("a salt secret (--salt-secret-file / KVLAB_SALT_SECRET) is only used "
                         "with API keys (--api-keys-file / KVLAB_API_KEYS)")
    # vLLM's switch for its development routes (POST /reset_prefix_cache among them).
    dev_mode = environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")
    return {"enable_prompt_tokens_details": args.enable_prompt_tokens_details,
            "api_keys": api_keys, "salt_secret": salt_secret, "dev_mode": dev_mode,
            "model_name": args.served_model_name, "kv_cache_metrics": args.kv_cache_metrics,
            "kv_cache_metrics_sample": args.kv_cache_metrics_sample,
            "max_num_queued_reqs": max_num_queued_reqs}


def main(argv=None) -> None:
    top = parser()
    args = top.parse_args(argv)
    try:
        app_kwargs = server_kwargs(args)
        llm_kwargs = checked_engine_kwargs(args)  # every knob checked before the model loads
    except (OSError, ValueError) as e:
        top.error(str(e))

    from kvlab.engine import LLM
    from kvlab.serve.api_server import serve

    try:
        llm = LLM(**llm_kwargs)
    except ValueError as e:
        # What only the loaded model can refuse (a KV connector with a hybrid model or a
        # quantized --kv-cache-dtype, say), in the flags' words as well.
        top.error(flag_message(str(e), args))
    # What vLLM logs once the pool is sized (vllm/v1/core/kv_cache_utils.py).
    print(llm.llm_engine.kv_cache_capacity()["line"], flush=True)
    serve(llm, args.host, args.port, **app_kwargs)


if __name__ == "__main__":
    main()

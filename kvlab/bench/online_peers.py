"""`kvlab serve` against `transformers serve`, through one streaming client.

Defined for notebook 07. `transformers serve --continuous-batching` is what a transformers user
runs instead of `kvlab serve`: an OpenAI-compatible FastAPI server over transformers' own
continuous batching with paged attention. Both servers get the same weights (kvlab's
de-quantised cache folder), the same text prompts, the same `max_tokens`, greedy, EOS not
stopping, and the same client (`kvlab.bench.stream_client.send_all`) streams `/v1/completions` from
both and stamps time to first token (TTFT) and the gaps between streamed chunks (ITL).

    python -m kvlab.bench serve-peers [--concurrency 1 8 16] [--json FILE]

One server runs at a time: each is a subprocess on a free loopback port, loaded, warmed up,
measured at every concurrency, then stopped before the other starts, so the two never share the
CPU's cores. A server that cannot start here is reported with the reason (its exit status and
the end of its log), and the other is still measured.

How each is told to ignore EOS. kvlab takes vLLM's `ignore_eos`. transformers serve refuses
fields it does not know (HTTP 422) but takes a `generation_config` JSON: `eos_token_id: -1` leaves
its continuous batching with no stop token (a negative id is dropped from the request's stop set,
`transformers/generation/continuous_batching/requests.py`), so every request runs to
`max_tokens`, as vLLM's `ignore_eos` does (EOS may be generated, it only stops stopping:
`vllm/sampling_params.py`). The row's `tokens_per_request` shows it held.

The same KV budget: on a CPU, transformers serve is given kvlab serve's (`cpu_kv_blocks`);
left to itself it would take most of the machine's free RAM. And `same_text` counts the requests
whose text both servers agree on, so the rows compare the same work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvlab.bench.stream_client import StreamResult, pooled, send_all
from kvlab.bench.common import BENCH_TEXT
from kvlab.bench.scheduling import percentile  # linear between ranks, as numpy's default

SERVERS = ("kvlab serve", "transformers serve")
# transformers serve loads `getattr(transformers, config.architectures[0])`; a kvlab cache folder
# written before kvlab named it (a GGUF load leaves `architectures` unset) lacks it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


class ServerUnavailable(RuntimeError):
    """A server that could not run here; the message says exactly why."""


# ---- statistics: pure functions over the client's per-request results --------------------------
def summarise(server: str, concurrency: int, results: list[StreamResult], wall_s: float) -> dict:
    """One table row: TTFT and ITL medians and p90 (ms) over the requests that succeeded, output
    tokens/s over the wall time of the whole run (failed requests count for nothing)."""
    ok, ttfts, itls, tokens = pooled(results)
    ms = lambda xs, q: round(1000 * percentile(xs, q), 1) if xs else None  # noqa: E731
    return {
        "server": server, "concurrency": concurrency, "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error is not None), None),
        "output_tokens": sum(tokens), "wall_s": round(wall_s, 2),
        "output_tok_s": round(sum(tokens) / wall_s, 1) if wall_s > 0 else None,
        "ttft_median_ms": ms(ttfts, 50), "ttft_p90_ms": ms(ttfts, 90),
        "itl_median_ms": ms(itls, 50), "itl_p90_ms": ms(itls, 90),
        "tokens_per_request": [min(tokens), max(tokens)] if tokens else None,
    }


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table, grouped by concurrency."""
    head = (f"{'conc':>4}  {'server':<18} {'req':>4} {'err':>3} {'tok/s':>7} "
            f"{'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p90':>8}  tokens/req")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["concurrency"], SERVERS.index(r["server"])
                                         if r["server"] in SERVERS else len(SERVERS))):
        tpr = r["tokens_per_request"]
        lines.append(
            f"{r['concurrency']:>4}  {r['server']:<18} {r['requests']:>4} {r['errors']:>3} "
            f"{_fmt(r['output_tok_s'], '7.1f')} {_fmt(r['ttft_median_ms'], '9.1f')} "
            f"{_fmt(r['ttft_p90_ms'], '9.1f')} {_fmt(r['itl_median_ms'], '8.1f')} "
            f"{_fmt(r['itl_p90_ms'], '8.1f')}  "
            + ("-" if tpr is None else str(tpr[0]) if tpr[0] == tpr[1] else f"{tpr[0]}-{tpr[1]}"))
    return "\n".join(lines) + "\n(times in ms; ITL = gap between streamed chunks)"


def targets(rows: list[dict], ours: str = "kvlab serve", peer: str = "transformers serve",
            throughput_at=(8, 16), ttft_at: int = 1) -> dict:
    """Whether ours is ahead on output tokens/s at `throughput_at`, and no worse on the TTFT
    median at `ttft_at`. A level either server lacks is left out; `met` is None when
    nothing could be compared."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    out: dict = {"throughput_ratio": {}, "ttft_ratio": None}
    checks = []
    for c in throughput_at:
        a, b = by.get((ours, c)), by.get((peer, c))
        if a and b and a["output_tok_s"] and b["output_tok_s"]:
            ratio = a["output_tok_s"] / b["output_tok_s"]
            out["throughput_ratio"][str(c)] = round(ratio, 2)
            checks.append(ratio > 1)
    a, b = by.get((ours, ttft_at)), by.get((peer, ttft_at))
    if a and b and a["ttft_median_ms"] and b["ttft_median_ms"]:
        ratio = a["ttft_median_ms"] / b["ttft_median_ms"]  # below 1: ours answers first
        out["ttft_ratio"] = round(ratio, 3)  # three places: a target missed by 0.3% shows
        checks.append(ratio <= 1)
    out["met"] = all(checks) if checks else None
    return out


# ---- the workload --------------------------------------------------------------------------------
def make_text_prompts(num: int, words: int = 96, tag: str = "Request") -> list[str]:
    """Distinct text prompts of `words` words cut from the benchmark text at different offsets.

    Text, not token ids: transformers serve's /v1/completions takes a string only; both servers
    tokenise it with the same tokenizer. Each prompt starts with its own `tag` and number, so no
    two share a first block: transformers' continuous batching shares cached prefix blocks
    (`allow_block_sharing`, on by default, no `transformers serve` flag) and so does kvlab serve
    (vLLM's default), so no prompt finds another's blocks on either side."""
    base = (BENCH_TEXT * (words // 20 + 4)).split()
    return [f"{tag} {i}: " + " ".join(base[(7 * i) % 40:(7 * i) % 40 + words])
            for i in range(num)]


# ---- starting and stopping the servers -----------------------------------------------------------
def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadable_folder(folder: Path, dest: Path) -> Path:
    """`folder` itself when its config names the architecture, else a copy in `dest` whose
    config.json does (every other file a symlink to the original: no weights are copied)."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures"):
        return folder
    arch = ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        raise ServerUnavailable(f"{folder}/config.json names no architecture and model_type "
                                f"{config.get('model_type')!r} is not one of {list(ARCHITECTURES)}")
    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f.resolve())
    (dest / "config.json").write_text(json.dumps({**config, "architectures": [arch]}, indent=2))
    return dest


def serving_missing() -> str | None:
    """Why `transformers serve` cannot run in this Python, or None when it can."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return ("transformers serve needs transformers[serving] (FastAPI, Uvicorn, openai), "
                "which this Python lacks: pip install 'transformers[serving]' (make setup "
                "installs it, with kvlab's notebooks extra)")
    return None


def cpu_kv_blocks(folder: Path, kv_bytes: int, itemsize: int = 4) -> int:
    """transformers' `--cb-num-blocks` for a KV cache of `kv_bytes`, kvlab serve's default
    budget on a CPU, so both hold the same KV tokens. Left to itself on a CPU, transformers
    sizes its cache at 60% of the machine's RAM not yet in use by the server
    (`resolve_max_memory_percent` in `transformers/generation/continuous_batching/
    initialization.py`): gigabytes, which a laptop running the notebook cannot spare. Its blocks
    are whole-model, `page_size` tokens each (256 by default)."""
    from transformers import ContinuousBatchingConfig

    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * itemsize
    return max(1, kv_bytes // (ContinuousBatchingConfig().page_size * per_token))


@dataclass
class ServerSpec:
    """How to start one server and what its request bodies carry besides the common fields."""

    name: str
    port: int
    argv: list[str]
    model: str  # the `model` field of each request
    extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)


def kvlab_spec(port: int, model: str | None = None) -> ServerSpec:
    """`kvlab serve` with its defaults (vLLM's: prefix cache on; the prompts share nothing)."""
    argv = [sys.executable, "-m", "kvlab.serve.cli", "serve", *([model] if model else []),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "kvlab"]
    return ServerSpec("kvlab serve", port, argv, "kvlab", {"ignore_eos": True})


def transformers_spec(port: int, folder: Path, device: str, dtype: str,
                      num_blocks: int | None = None) -> ServerSpec:
    """`transformers serve` pinned to `folder`, with its continuous batching and SDPA attention
    (the kernel kvlab's default backend calls), on kvlab's device and dtype; `num_blocks` sets
    its KV cache size (`--cb-num-blocks`, see `cpu_kv_blocks`)."""
    exe = Path(sys.executable).parent / "transformers"
    launcher = [str(exe)] if exe.exists() else [
        sys.executable, "-c", "from transformers.cli.transformers import main; main()"]
    argv = [*launcher, "serve", str(folder), "--continuous-batching",
            "--attn-implementation", "sdpa", "--device", device, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            *(["--cb-num-blocks", str(num_blocks)] if num_blocks else [])]
    # No EOS stop (module docstring); temperature 0 already turns sampling off.
    extra = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
    return ServerSpec("transformers serve", port, argv, str(folder), extra)


class ServerProcess:
    """A server in a subprocess of its own: `start()` waits for /health, `stop()` ends it.

    Its output goes to a log file; when it dies or never gets healthy, ServerUnavailable carries
    the exit status and the log's last lines, which say why."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.url = f"http://127.0.0.1:{spec.port}"
        self.log_path = log_dir / (spec.name.replace(" ", "-") + ".log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300) -> None:
        import urllib.error
        import urllib.request

        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.spec.env},
                                             # a Ctrl-C at the terminal reaches us, and we
                                             # stop the server (finally, in measure_server)
                                             start_new_session=True)
            except OSError as e:
                raise ServerUnavailable(f"{self.spec.name} could not be started: {e}") from e
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerUnavailable(f"{self.spec.name} exited with status "
                                        f"{self.proc.returncode} before it served:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerUnavailable(f"{self.spec.name} was not healthy after {timeout_s:.0f} s:\n"
                                f"{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def peak_rss_mib(self) -> float | None:
        """The server's peak resident memory so far (Linux's VmHWM), None where unreadable."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except (OSError, AttributeError):
            return None
        kib = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), None)
        return None if kib is None else round(kib / 1024, 1)

    def stop(self, grace_s: float = 5) -> str:
        """Ctrl-C, then, after `grace_s`, SIGKILL; says which ended it. transformers serve
        5.24 needs the kill: on Ctrl-C its app's shutdown unloads the model but leaves the
        continuous-batching thread (not a daemon) running, and the process stays (here it was
        still there 30 s later)."""
        if self.proc is None or self.proc.poll() is not None:
            return "not running"
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(grace_s)
            return "exited on Ctrl-C"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return f"still running {grace_s:.0f} s after Ctrl-C: killed"


# ---- measuring -----------------------------------------------------------------------------------
async def run_level(url: str, spec: ServerSpec, prompts: list[str], max_tokens: int,
                    concurrency: int) -> tuple[list[StreamResult], float]:
    """Every prompt, at most `concurrency` in flight, all arriving at once; returns the per-request
    results (a malformed event or a dropped connection: that request's failure) and the wall
    time."""
    bodies = [{"model": spec.model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
               **spec.extra} for p in prompts]
    return await send_all(url + "/v1/completions", bodies, concurrency,
                          timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                          errors_as_results=True)


def measure_server(spec: ServerSpec, log_dir: Path, concurrencies, num_requests,
                   max_tokens: int, words: int, progress=print) -> tuple[list[dict], dict]:
    """Start one server, warm it up, measure it at each concurrency, stop it. Returns the rows
    and each level's output texts (to compare the two servers' work)."""
    server = ServerProcess(spec, log_dir)
    t0 = time.perf_counter()
    rows, texts = [], {}
    try:  # start inside: a Ctrl-C while it loads must stop it too (it has its own session)
        server.start()
        progress(f"{spec.name}: healthy after {time.perf_counter() - t0:.1f} s on {server.url}")
        # Warm-up, not measured: transformers serve builds its batching manager (and its paged
        # cache) on the first request; both servers pay first-call costs here.
        warm = _run_sync(lambda: run_level(server.url, spec, make_text_prompts(2, words, "Warm-up"),
                                           max_tokens, 2))
        bad = [r.error for r in warm[0] if r.error]
        if bad:
            raise ServerUnavailable(f"{spec.name} failed its warm-up request: {bad[0]}\n"
                                    f"{server.tail()}")
        for c in concurrencies:
            prompts = make_text_prompts(num_requests(c), words, f"Run {c}, request")
            results, wall = _run_sync(lambda: run_level(server.url, spec, prompts, max_tokens, c))
            rows.append(summarise(spec.name, c, results, wall))
            texts[c] = [r.text if r.error is None else None for r in results]
            progress(json.dumps(rows[-1]))
    finally:
        rss = server.peak_rss_mib()
        for r in rows:
            r["server_peak_rss_mib"] = rss
        progress(f"{spec.name}: peak memory {rss} MiB; {server.stop()}")
    return rows, texts


def same_texts(a: dict, b: dict) -> dict:
    """Per concurrency present in both: how many requests got the same text from both servers,
    as "k/n" (greedy on the same weights: equal unless a near-tie flips under different
    kernels)."""
    return {str(c): f"{sum(x is not None and x == y for x, y in zip(a[c], b[c]))}/{len(a[c])}"
            for c in a if c in b}


def _run_sync(make_coro):
    """asyncio.run, also from inside a running event loop (a Jupyter cell): then on a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def default_num_requests(concurrency: int) -> int:
    """Three waves of requests per level, at least eight."""
    return max(8, 3 * concurrency)


def compare_servers(concurrencies=(1, 8, 16), max_tokens: int = 64, words: int = 96,
                    num_requests=default_num_requests, model: str | None = None,
                    servers=SERVERS, progress=print) -> dict:
    """Measure each server in `servers` in turn on the same prompts; returns the rows, the
    targets and, for any server that could not run here, the reason (`unavailable`).

    `num_requests` is a count or a function of the concurrency. `model` is a local folder or a
    hub id (default: kvlab's packaged model, its de-quantised cache folder)."""
    from kvlab.engine import DEFAULT_CPU_KV_BYTES
    from kvlab.model import packaged_model_folder, resolve_device, resolve_dtype

    count = num_requests if callable(num_requests) else (lambda c: num_requests)
    device = resolve_device("auto")
    dtype = str(resolve_dtype("auto", device)).removeprefix("torch.")
    rows: list[dict] = []
    texts: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="kvlab-serve-peers-"))
    source = Path(model) if model else packaged_model_folder()  # what both servers load
    try:
        for name in servers:
            try:
                if name == "kvlab serve":
                    spec = kvlab_spec(free_port(), str(source) if source.is_dir() else model)
                elif name == "transformers serve":
                    missing = serving_missing()
                    if missing:
                        raise ServerUnavailable(missing)
                    if not source.is_dir():
                        raise ServerUnavailable(f"{model} is not a local folder; this benchmark "
                                                "serves one folder to both servers")
                    folder = loadable_folder(source, log_dir / "model")
                    blocks = (cpu_kv_blocks(folder, DEFAULT_CPU_KV_BYTES)
                              if device.type == "cpu" and dtype == "float32" else None)
                    spec = transformers_spec(free_port(), folder, device.type, dtype, blocks)
                else:
                    raise ValueError(f"unknown server {name!r}; choose from {SERVERS}")
                got, texts[name] = measure_server(spec, log_dir, concurrencies, count,
                                                  max_tokens, words, progress)
                rows += got
            except ServerUnavailable as e:
                unavailable[name] = str(e)
                progress(f"{name} could not run here: {e}")
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    same = same_texts(*texts.values()) if len(texts) == 2 else {}
    return {"rows": rows, "targets": targets(rows), "same_text": same, "unavailable": unavailable,
            "max_tokens": max_tokens, "device": device.type, "dtype": dtype}


def report(out: dict) -> str:
    """compare_servers' result in words: the table, the work check, the targets, and why any
    server could not run."""
    lines = [format_table(out["rows"])] if out["rows"] else []
    if out.get("same_text"):
        lines.append("same text from both servers (greedy, same weights), by concurrency: "
                     + ", ".join(f"{c}: {k}" for c, k in out["same_text"].items()))
    t = out["targets"]
    if t["met"] is not None:
        tp = ", ".join(f"{c}: {r}x" for c, r in t["throughput_ratio"].items()) or "-"
        lines.append(f"kvlab / transformers output tok/s by concurrency: {tp}; "
                     f"TTFT median at 1, kvlab / transformers: {t['ttft_ratio'] or '-'}x; "
                     f"targets {'met' if t['met'] else 'not met'}")
    for name, why in out["unavailable"].items():
        lines.append(f"{name} could not run here: {why}")
    return "\n".join(lines)

"""Third-party clients against `kvlab serve`: the tools vLLM users already run, run as they run.

    python benchmarks/third_party_clients.py                  # or: make clients
    python benchmarks/third_party_clients.py --requests 32 --out DIR

Starts `kvlab serve` (the packaged SmolLM2-135M-Instruct, default flags) on a free loopback
port, then runs, each as its own command line:

* guidellm 0.8.1: its default chat benchmark (`/v1/chat/completions`, streamed, with
  `stream_options.continuous_usage_stats`) and its completions one, 4 concurrent streams, a
  bounded number of requests of 128 synthetic prompt tokens and 32 output tokens. Reported:
  errors, TTFT, ITL, throughput, and the server's own mean TTFT over the same requests
  (vllm:time_to_first_token_seconds before and after) beside guidellm's.
* lm-eval 0.4.13: the tiny multiple-choice task in tests/data/lm_eval/ (32 questions, read from
  its jsonl: no download), once through `local-completions` with its defaults (token-id
  prompts, `echo` with logprobs, here 2 prompts per request) against kvlab serve, once with
  lm-eval's own `hf` backend (transformers) on the same weights, a folder transformers loads
  (kvlab.model.packaged_model_folder). Reported: the largest |loglikelihood difference| over
  every (question, choice) and both accuracies. Both run on the CPU in float32
  (CUDA_VISIBLE_DEVICES is emptied), so the two sides do the same arithmetic.

The clients conflict with none of kvlab's pins (transformers>=5,<6, torch), but they bring
about a hundred packages (datasets, pandas, scikit-learn, sanic...) that a workshop's venv has no
use for, so they live in a venv of their own, made once and reused: KVLAB_CLIENTS_VENV or
~/.cache/kvlab/clients-venv. It is an overlay on the project's venv (a .pth file puts the
project's site-packages after its own), so the clients use the very torch and transformers the
engine is checked against, and pip installs only what is missing there; pip never touches the
project's venv from it (it refuses to uninstall outside the environment). Everything is
offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) but that one pip install.

Writes OUT/results.json and prints a summary. Exit status: 0 when every check holds (guidellm:
no errors; lm-eval: max |difference| <= 1e-3 and equal accuracy), 1 when one fails, 3 when the
clients could not be installed (the reason on the last line of stderr: tests skip on it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ("guidellm==0.8.1", "lm-eval[api,hf]==0.4.13")
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASK = "kvlab_tiny_mc"
LOGLIKELIHOOD_TOLERANCE = 1e-3
EXIT_UNAVAILABLE = 3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}


class ClientsUnavailable(RuntimeError):
    """The clients' venv could not be made (no index reachable, a wheel missing...)."""


# ---- the clients' venv ----------------------------------------------------------------------------
def default_venv() -> Path:
    return Path(os.environ.get("KVLAB_CLIENTS_VENV", Path.home() / ".cache/kvlab/clients-venv"))


def clients_venv(path: Path, log) -> Path:
    """The venv's bin/ folder, made (or remade, when the clients, this Python or the project's
    venv changed) as an overlay on the venv running this script."""
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    stamp = {"clients": list(CLIENTS), "python": sys.version, "overlay": sorted(set(site))}
    stamp_file = path / "kvlab-clients.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path / "bin"
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # `python -m venv` from inside a venv makes one on the same base interpreter: the project's
    # compiled packages (torch) load in it.
    run([sys.executable, "-m", "venv", str(path)], log, timeout=300)
    own_site = subprocess.run([str(path / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(own_site, "kvlab-project-venv.pth").write_text("\n".join(stamp["overlay"]) + "\n")
    try:
        run([str(path / "bin" / "python"), "-m", "pip", "install", "-q",
             "--disable-pip-version-check", *CLIENTS], log, timeout=1200)
    except subprocess.CalledProcessError as e:
        raise ClientsUnavailable(f"pip could not install {' '.join(CLIENTS)} into {path} "
                                 f"(exit {e.returncode}; see {log.name})")
    stamp_file.write_text(json.dumps(stamp))
    return path / "bin"


def run(cmd: list, log, timeout: float, cwd: Path | None = None, env: dict | None = None):
    """Run one command, its output appended to `log`; raise CalledProcessError if it fails."""
    log.write(f"\n$ {' '.join(map(str, cmd))}\n")
    log.flush()
    subprocess.run([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, check=True,
                   timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


# ---- the server ---------------------------------------------------------------------------------
class KvlabServe:
    """`kvlab serve` with its default flags on a free loopback port, for a `with` block."""

    def __init__(self, out: Path) -> None:
        from kvlab.bench.online_peers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(out / "kvlab-serve.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvlab.serve.cli", "serve", "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE})

    def __enter__(self) -> "KvlabServe":
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvlab serve exited ({self.proc.returncode}): see "
                                   f"{self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        else:
            raise RuntimeError("kvlab serve did not answer /health within 300 s")
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as resp:
            self.model = json.loads(resp.read())["data"][0]["id"]
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def ttft(self) -> tuple[float, float]:
        """(count, sum) of vllm:time_to_first_token_seconds now."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        values = {}
        for line in text.splitlines():
            for part in ("count", "sum"):
                if line.startswith(f"vllm:time_to_first_token_seconds_{part}{{"):
                    values[part] = float(line.rsplit(" ", 1)[1])
        return values["count"], values["sum"]


# ---- guidellm -------------------------------------------------------------------------------------
def guidellm_command(bin_dir: Path, url: str, request_format: str, requests: int,
                     tokenizer: Path, output: Path) -> list:
    """guidellm's own benchmark command line: the same one measures a vLLM server."""
    return [bin_dir / "guidellm", "run",
            "--backend", f"kind=openai_http,target={url},request_format={request_format}",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
            # The synthetic prompts are cut to length with the model's tokenizer: the local
            # folder, not a hub download.
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={output}", "--disable-console-interactive"]


def run_guidellm(bin_dir: Path, server: KvlabServe, request_format: str, requests: int,
                 tokenizer: Path, out: Path, log) -> dict:
    output = out / f"guidellm{request_format.replace('/', '_')}.json"
    before = server.ttft()
    start = time.perf_counter()
    run(guidellm_command(bin_dir, server.url, request_format, requests, tokenizer, output),
        log, timeout=600, cwd=out, env=OFFLINE)
    wall = time.perf_counter() - start
    after = server.ttft()
    (bench,) = json.loads(output.read_text())["benchmarks"]
    m = bench["metrics"]

    def stat(key, which="mean"):
        return m[key]["successful"][which]

    totals = m["request_totals"]
    served = after[0] - before[0]
    server_ttft_ms = 1000 * (after[1] - before[1]) / served if served else None
    client_ttft_ms = stat("time_to_first_token_ms")
    return {
        "request_format": request_format, "wall_s": round(wall, 1),
        "successful": totals["successful"], "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "ttft_ms_mean": client_ttft_ms, "ttft_ms_median": stat("time_to_first_token_ms", "median"),
        "itl_ms_mean": stat("inter_token_latency_ms"),
        "itl_ms_median": stat("inter_token_latency_ms", "median"),
        "requests_per_s": stat("requests_per_second"),
        "output_tokens_per_s": stat("output_tokens_per_second"),
        "server_requests": served, "server_ttft_ms_mean": server_ttft_ms,
        "server_over_client_ttft": server_ttft_ms / client_ttft_ms if server_ttft_ms else None,
        "command": " ".join(map(str, guidellm_command(Path(), server.url, request_format,
                                                      requests, tokenizer, output))),
    }


# ---- lm-eval --------------------------------------------------------------------------------------
def lm_eval_command(bin_dir: Path, model: str, model_args: str, output: Path) -> list:
    return [bin_dir / "lm_eval", "run", "--model", model, "--model_args", model_args,
            "--batch_size", "2", "--tasks", TASK, "--include_path", ".", "--device", "cpu",
            "--output_path", output, "--log_samples"]


def run_lm_eval(bin_dir: Path, server: KvlabServe, folder: Path, out: Path, log) -> dict:
    """The task through kvlab serve (local-completions) and through transformers (hf)."""
    env = {**OFFLINE, "HF_DATASETS_CACHE": str(out / "hf-datasets")}
    args = {
        "kvlab": ("local-completions", f"model={server.model},base_url={server.url}"
                                       f"/v1/completions,tokenizer={folder}"),
        "hf": ("hf", f"pretrained={folder}"),
    }
    results, commands = {}, {}
    for name, (model, model_args) in args.items():
        shutil.rmtree(out / f"lm-eval-{name}", ignore_errors=True)  # an earlier run's samples
        cmd = lm_eval_command(bin_dir, model, model_args, out / f"lm-eval-{name}")
        start = time.perf_counter()
        # The task's data_files name its jsonl relative to the working folder: its own.
        run(cmd, log, timeout=600, cwd=TASK_DIR, env=env)
        results[name] = read_samples(out / f"lm-eval-{name}")
        results[name]["wall_s"] = round(time.perf_counter() - start, 1)
        commands[name] = " ".join(map(str, lm_eval_command(Path(), model, model_args,
                                                           Path("OUT"))))
    kv, hf = results["kvlab"], results["hf"]
    if kv["loglikelihoods"].keys() != hf["loglikelihoods"].keys():
        raise RuntimeError("lm-eval scored different questions through the two backends")
    diffs = [abs(a - b) for key in kv["loglikelihoods"]
             for a, b in zip(kv["loglikelihoods"][key], hf["loglikelihoods"][key])]
    return {"pairs": len(diffs), "max_abs_loglikelihood_diff": max(diffs),
            "mean_abs_loglikelihood_diff": statistics.mean(diffs),
            "acc_kvlab": kv["acc"], "acc_hf": hf["acc"],
            "wall_s": {"kvlab": kv["wall_s"], "hf": hf["wall_s"]}, "commands": commands}


def read_samples(output: Path) -> dict:
    """lm-eval's --log_samples file: per question its choices' loglikelihoods, and accuracy."""
    (path,) = glob.glob(str(output / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    loglikelihoods, correct = {}, []
    for line in Path(path).read_text().splitlines():
        sample = json.loads(line)
        loglikelihoods[sample["doc_id"]] = [float(r[0]) for r in sample["filtered_resps"]]
        correct.append(sample["acc"])
    return {"loglikelihoods": loglikelihoods, "acc": statistics.mean(correct)}


# ---- the whole run --------------------------------------------------------------------------------
def checks(results: dict) -> list[str]:
    """What failed, in words (empty: every check holds)."""
    failed = []
    for g in results["guidellm"]:
        if g["errored"] or g["incomplete"] or not g["successful"]:
            failed.append(f"guidellm {g['request_format']}: {g['errored']} errored, "
                          f"{g['incomplete']} incomplete, {g['successful']} successful")
    lm = results["lm_eval"]
    if lm["max_abs_loglikelihood_diff"] > LOGLIKELIHOOD_TOLERANCE:
        failed.append(f"lm-eval: max |loglikelihood difference| "
                      f"{lm['max_abs_loglikelihood_diff']:.2e} > {LOGLIKELIHOOD_TOLERANCE}")
    if lm["acc_kvlab"] != lm["acc_hf"]:
        failed.append(f"lm-eval: accuracy {lm['acc_kvlab']} through kvlab serve, "
                      f"{lm['acc_hf']} with transformers")
    return failed


def summary(results: dict) -> str:
    lines = ["| guidellm, concurrent@4 | requests ok / errors | TTFT mean (median) ms | "
             "server TTFT mean ms | ITL mean (median) ms | output tok/s | req/s |",
             "|---|---|---|---|---|---|---|"]
    for g in results["guidellm"]:
        lines.append(f"| {g['request_format']} | {g['successful']} / {g['errored']} | "
                     f"{g['ttft_ms_mean']:.0f} ({g['ttft_ms_median']:.0f}) | "
                     f"{g['server_ttft_ms_mean']:.0f} | {g['itl_ms_mean']:.1f} "
                     f"({g['itl_ms_median']:.1f}) | {g['output_tokens_per_s']:.1f} | "
                     f"{g['requests_per_s']:.2f} |")
    lm = results["lm_eval"]
    lines += ["", f"lm-eval {TASK}: {lm['pairs']} (question, choice) loglikelihoods, max "
                  f"|kvlab serve - transformers| = {lm['max_abs_loglikelihood_diff']:.2e}; "
                  f"accuracy {lm['acc_kvlab']:.4f} (kvlab serve) vs {lm['acc_hf']:.4f} (hf)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "third_party_clients")
    p.add_argument("--venv", type=Path, default=default_venv(),
                   help="the clients' venv (made once; env KVLAB_CLIENTS_VENV)")
    p.add_argument("--requests", type=int, default=16, help="guidellm requests per benchmark")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "clients.log", "w") as log:
        try:
            bin_dir = clients_venv(args.venv, log)
        except ClientsUnavailable as e:
            print(f"clients unavailable: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        from kvlab.bench.online_peers import loadable_folder
        from kvlab.model import packaged_model_folder

        folder = loadable_folder(packaged_model_folder(), args.out / "model")
        start = time.perf_counter()
        with KvlabServe(args.out) as server:
            results = {"guidellm": [run_guidellm(bin_dir, server, fmt, args.requests, folder,
                                                 args.out, log)
                                    for fmt in ("/v1/chat/completions", "/v1/completions")],
                       "lm_eval": run_lm_eval(bin_dir, server, folder, args.out, log)}
        results["wall_s"] = round(time.perf_counter() - start, 1)
    results["failed"] = checks(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(summary(results))
    print(f"\nresults: {args.out / 'results.json'} ({results['wall_s']} s)")
    for failure in results["failed"]:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

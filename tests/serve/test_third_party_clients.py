"""guidellm and lm-eval against `kvlab serve`, as their users run them: benchmarks/
third_party_clients.py, whose own checks this test holds it to (guidellm's chat and completions
benchmarks without an error; lm-eval's loglikelihoods through kvlab serve within 1e-3 of its
transformers backend, and the same accuracy), plus the server's TTFT beside guidellm's.

The clients live in a venv of their own (KVLAB_CLIENTS_VENV, else ~/.cache/kvlab/clients-venv),
made on the first run (about a minute and a half of pip) and reused; the run itself takes about
two minutes on two cores. The test is skipped, saying why, only when the clients cannot be
installed (no package index reachable); every other failure fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "third_party_clients.py"
EXIT_UNAVAILABLE = 3  # the script's "clients unavailable"


@pytest.mark.slow
def test_guidellm_and_lm_eval_against_kvlab_serve(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode == EXIT_UNAVAILABLE:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["failed"] == []
    for run in results["guidellm"]:
        assert run["errored"] == 0 and run["successful"] > 0, run
        # Arrival stamped as the HTTP request comes in: the server's TTFT is the client's.
        assert abs(run["server_over_client_ttft"] - 1) <= 0.15, run
    lm = results["lm_eval"]
    assert lm["max_abs_loglikelihood_diff"] <= 1e-3 and lm["acc_kvlab"] == lm["acc_hf"], lm

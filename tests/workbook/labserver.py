"""JupyterLab on a loopback port for the tests that need a real server (the browser tests and
`make lab`'s settings check): one way to start it, wait for it and stop it."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvlab.bench.online_peers import free_port


@contextlib.contextmanager
def running_jupyterlab(tmp_path: Path, cwd: Path, args: list[str]):
    """Start `python -m jupyterlab ARGS` with its own token, port, runtime and workspace folders
    (else JupyterLab reopens the tabs of earlier sessions); yield (base url, token) once
    /api/status answers; stop it on exit. Its log is tmp_path/jupyterlab.log."""
    token, port = secrets.token_hex(16), free_port()
    cmd = [sys.executable, "-m", "jupyterlab", *args, "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", f"--ServerApp.token={token}",
           f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses root without it (containers, CI)
    log_path = tmp_path / "jupyterlab.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")})
        try:
            deadline = time.time() + 180  # a cold start on a busy 2-core machine
            while True:
                try:
                    urllib.request.urlopen(urllib.request.Request(
                        f"{base}/api/status", headers={"Authorization": f"token {token}"}),
                        timeout=2)
                    break
                except OSError:
                    if time.time() > deadline or proc.poll() is not None:
                        raise RuntimeError(log_path.read_text()[-2000:])
                    time.sleep(0.5)
            yield base, token
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

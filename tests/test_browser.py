"""The workbook in a real browser: JupyterLab from this environment, notebook 01 run in headless
Chromium, the block-size slider moved, the output checked to change, a screenshot saved.

Needs Debian's `chromium` (`.ci/run` installs it). Without it the test is skipped with a reason,
unless KVLAB_REQUIRE_BROWSER=1 (as in CI), where a missing browser is a failure.
"""

from __future__ import annotations

import os
import shutil
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium")
NOTEBOOK = "01_contiguous_vs_paged.ipynb"
SCREENSHOT_DIR = Path(os.environ.get("KVLAB_SCREENSHOT_DIR", ROOT / "tests" / "screenshots"))


def require_browser():
    missing = None
    if not Path(CHROMIUM).exists():
        missing = (f"Chromium not found at {CHROMIUM}: the browser test was skipped "
                   "(install it with `apt-get install chromium chromium-driver`)")
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed: the browser test was skipped"
    if missing:
        if os.environ.get("KVLAB_REQUIRE_BROWSER") == "1":
            pytest.fail(missing)
        pytest.skip(missing)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab on localhost over a copy of the notebooks (the repo's files stay untouched)."""
    require_browser()
    work = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    token, port = secrets.token_hex(16), free_port()
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--notebook-dir={work}",
           "--ServerApp.open_browser=False", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work,
                            env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError((tmp_path / "jupyterlab.log").read_text()[-2000:])
                time.sleep(0.5)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_notebook_01_runs_and_the_slider_moves_the_output(jupyterlab):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--disable-quic"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-Toolbar", timeout=60_000)
            time.sleep(2)  # let the kernel connect
            page.click("li.lm-MenuBar-item:has-text('Run')")
            page.click(".lm-Menu-item:has-text('Run All Cells')")
            slider = page.wait_for_selector(".widget-slider", timeout=240_000)
            # The interactive's text output sits in the same widget box as the slider.
            box = page.locator(".widget-interact").first
            box.locator("text=block_size= 16").wait_for(timeout=120_000)
            before = box.inner_text()
            slider.scroll_into_view_if_needed()
            handle = box.locator(".noUi-handle").first
            handle.focus()
            for _ in range(4):
                page.keyboard.press("ArrowRight")
            box.locator("text=block_size= 20").wait_for(timeout=60_000)
            after = box.inner_text()
            page.screenshot(path=str(SCREENSHOT_DIR / "notebook01_slider.png"), full_page=False)
        except Exception:
            page.screenshot(path=str(SCREENSHOT_DIR / "notebook01_failure.png"))
            raise
        finally:
            browser.close()
    assert before != after
    assert "block_size= 16" in before and "block_size= 20" in after

"""The workbook in a real browser: JupyterLab from this environment, chapter 01's set-up and its
block-size section run in headless Chromium, the block-size slider moved, its cell's text and picture checked to be redrawn in
place, a screenshot saved; and the engine explorer stepped by its buttons, its picture redrawn
in place, its queue text checked against the engine's state.

Needs Debian's `chromium` (`.ci/run` installs it). Without it the test is skipped with a reason,
unless KVLAB_REQUIRE_BROWSER=1 (as in CI), where a missing browser is a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from tests.workbook.labserver import running_jupyterlab

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab on localhost over a copy of the notebooks (the repo's files stay untouched)."""
    require_browser()
    work = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    with running_jupyterlab(tmp_path, work, [
            f"--notebook-dir={work}", "--ServerApp.open_browser=False", "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]) as server:
        yield server


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]


@contextlib.contextmanager
def notebook_open(jupyterlab, notebook: str, width: int, height: int, failure_png: str):
    """Headless Chromium on `notebook` in JupyterLab, its cells drawn; yields the page, saves a
    screenshot under SCREENSHOT_DIR if the body fails, closes the browser."""
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        try:
            page.goto(f"{base}/lab/tree/{notebook}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            yield page
        except Exception:
            page.screenshot(path=str(SCREENSHOT_DIR / failure_png))
            raise
        finally:
            browser.close()


@contextlib.contextmanager
def notebook_running(jupyterlab, notebook: str, height: int, failure_png: str, width: int = 1400):
    """`notebook_open`, then Run > Run All Cells clicked."""
    with notebook_open(jupyterlab, notebook, width, height, failure_png) as page:
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-Toolbar", timeout=60_000)
        time.sleep(2)  # let the kernel connect
        page.click("li.lm-MenuBar-item:has-text('Run')")
        page.click(".lm-Menu-item:has-text('Run All Cells')")
        yield page


def block_size_section(work: Path) -> str:
    """Chapter 01's set-up cells and its block-size section, as a notebook beside it: the
    browser runs what the slider needs (nbval runs the whole chapter, so this test does not)."""
    import nbformat

    nb = nbformat.read(work / NOTEBOOK, as_version=4)
    setup = next(i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and "import kvlab" in c.source)
    start = next(i for i, c in enumerate(nb.cells)
                 if c.source.split("\n", 1)[0].endswith("Explore: the block size"))
    slider = next(i for i, c in enumerate(nb.cells) if "widgets.block_size_slider(" in c.source)
    nb.cells = nb.cells[:setup + 1] + nb.cells[start:slider + 1]
    name = "01_block_size_section.ipynb"
    nbformat.write(nb, work / name)
    return name


def test_notebook_01_runs_and_the_slider_moves_the_output(jupyterlab, tmp_path):
    notebook = block_size_section(tmp_path / "notebooks")
    with notebook_running(jupyterlab, notebook, 1000, "notebook01_failure.png") as page:
        slider = page.wait_for_selector(".kvlab-controls .widget-slider", timeout=240_000)
        # The slider redraws its cell's own outputs (text and picture) in place.
        cell = page.locator(".jp-CodeCell").filter(has=page.locator(".kvlab-controls")).first
        text = cell.locator(".kvlab-live-text").first
        text.locator("text=block_size= 16").wait_for(timeout=120_000)
        before, picture = text.inner_text(), cell.locator(".jp-OutputArea-output img")
        picture_before = picture.first.get_attribute("src")
        slider.scroll_into_view_if_needed()
        handle = cell.locator(".noUi-handle").first
        handle.focus()
        for _ in range(4):
            page.keyboard.press("ArrowRight")
        text.locator("text=block_size= 20").wait_for(timeout=60_000)
        after = text.inner_text()
        wait_until(lambda: picture.first.get_attribute("src") != picture_before, 60,
                   "a new picture")
        pictures = picture.count()
        page.screenshot(path=str(SCREENSHOT_DIR / "notebook01_slider.png"), full_page=False)
    assert before != after
    assert "block_size= 16" in before and "block_size= 20" in after
    assert pictures == 1  # redrawn in place, not a second picture


def test_chapter_00_opens_with_kvlab_source_folded_until_clicked(jupyterlab):
    """The committed chapter 00 shows its forward pass folded (`jupyter.outputs_hidden`): in
    the browser the cell shows a placeholder, not the code, until the reader clicks it."""
    with notebook_open(jupyterlab, "00_the_model_and_its_kv_cache.ipynb", 1400, 1000,
                       "notebook00_folded_failure.png") as page:
        cell = page.locator(".jp-CodeCell").filter(
            has_text="show_source(kvlab.model.Transformer.forward)").first
        cell.scroll_into_view_if_needed()
        placeholder = cell.locator(".jp-OutputPlaceholder")
        placeholder.wait_for(state="visible", timeout=60_000)
        assert "def forward" not in cell.inner_text()
        placeholder.click()
        cell.locator("text=def forward").first.wait_for(state="visible", timeout=30_000)


# A two-cell notebook: the explorer over a small engine holding two requests, then a cell that
# prints the engine's queues straight from its scheduler (not through the explorer).
EXPLORER_CELLS = [
    """from kvlab import LLM
from kvlab.workbook import widgets
from kvlab.workbook.explorer import EngineExplorer

llm = LLM(block_size=4, kv_cache_tokens=128, max_model_len=64)
ex = EngineExplorer(llm, max_tokens=6)
ex.add_request("The capital of France is")
ex.add_request("Paged attention stores keys and values in")
widgets.engine_explorer(ex, prompt="Tell me a story")""",
    """engine = llm.llm_engine
print("ENGINE step", engine.num_steps)
print("ENGINE running", [r.request_id for r in engine.scheduler.running])
print("ENGINE waiting", [r.request_id for r in engine.scheduler.waiting])""",
]


def wait_until(check, timeout: float, what: str):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def queue_ids(text: str, queue: str) -> list[str]:
    """Request ids on the explorer's `running (n): ...` or `waiting (n): ...` line."""
    line = next(x for x in text.splitlines() if x.startswith(f"{queue} ("))
    return re.findall(r"(\S+) \[", line.split(":", 1)[1])


def test_engine_explorer_buttons_step_the_engine_in_the_browser(jupyterlab, tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in EXPLORER_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / "notebooks" / "explorer_check.ipynb")
    with notebook_running(jupyterlab, "explorer_check.ipynb", 1400,
                          "engine_explorer_failure.png") as page:
        notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        box = notebook.locator(".kvlab-explorer").first
        box.wait_for(timeout=240_000)
        queues = box.locator(".kvlab-explorer-queues")
        # The picture is the cell's own output above the buttons, redrawn in place.
        explorer_cell = notebook.locator(".jp-CodeCell").filter(
            has=page.locator(".kvlab-explorer")).first
        pictures = explorer_cell.locator(".jp-OutputArea-output img")
        picture = pictures.first
        picture.wait_for(timeout=60_000)
        assert queues.inner_text().startswith("step 0")
        before = picture.get_attribute("src")

        def press(name: str, until: str):
            box.get_by_role("button", name=name, exact=True).click()
            wait_until(lambda: until in queues.inner_text(), 120, f"{until!r} after {name}")

        press("Step", "step 1\n")
        press("Step", "step 2\n")
        press("Add request", "waiting (1): r2 [")
        press("Step", "step 3\n")
        wait_until(lambda: picture.get_attribute("src") != before, 60, "a new picture")
        after = picture.get_attribute("src")
        num_pictures = pictures.count()
        shown = queues.inner_text()

        # Now ask the engine itself, from the second cell.
        cell = notebook.locator(".jp-CodeCell").filter(has_text='print("ENGINE step"').first
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputPrompt").first.click()  # select the cell, then run it
        page.keyboard.press("Shift+Enter")
        wait_until(lambda: "ENGINE step 3" in cell.locator(".jp-OutputArea").inner_text(),
                   120, "the engine's own report")
        report = cell.locator(".jp-OutputArea").inner_text()
        box.scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOT_DIR / "engine_explorer.png"), full_page=False)
    assert before.startswith("data:image/png") and after != before  # the picture was redrawn
    assert num_pictures == 1  # in place: one picture, never a stale second one
    engine_running = re.search(r"ENGINE running \[(.*)\]", report).group(1)
    engine_waiting = re.search(r"ENGINE waiting \[(.*)\]", report).group(1)
    assert queue_ids(shown, "running") == re.findall(r"'([^']+)'", engine_running)
    assert queue_ids(shown, "waiting") == re.findall(r"'([^']+)'", engine_waiting)
    assert "r2" in queue_ids(shown, "running")  # the request added by the button was admitted


def test_a_chapter_opens_with_going_further_folded(jupyterlab):
    """Each chapter's Going further opens folded (JupyterLab's own collapsed-heading metadata):
    at a projector's 1280x720 the heading shows with its hidden-cells button, its first
    subsection does not until the reader opens it, and the chapter's last section (the release
    cell's) stays on screen below it."""
    import json

    from kvlab.workbook import agenda

    notebook = "03_continuous_batching.ipynb"
    nb = json.loads((ROOT / "notebooks" / notebook).read_text())
    _, further = agenda.layers(nb)
    inside = next("".join(nb["cells"][i]["source"]).split("\n", 1)[0].lstrip("# ").strip()
                  for i in further[1:] if "".join(nb["cells"][i]["source"]).startswith("###"))
    with notebook_open(jupyterlab, notebook, 1280, 720, "going_further_failure.png") as page:
        heading = page.locator(".jp-MarkdownCell").filter(
            has=page.locator("h2", has_text="Going further")).first
        heading.scroll_into_view_if_needed()
        # JupyterLab shows the arrow only on hover; its state is the class.
        heading.locator(".jp-collapseHeadingButton.jp-mod-collapsed").wait_for(
            state="attached", timeout=60_000)
        sub = page.locator(".jp-MarkdownCell h3", has_text=inside).first
        assert not sub.is_visible()
        after = page.locator(".jp-MarkdownCell h2", has_text="Before the next chapter").first
        after.wait_for(state="visible", timeout=30_000)
        after.scroll_into_view_if_needed()  # the folded heading and the section after it
        page.screenshot(path=str(SCREENSHOT_DIR / "going_further_folded.png"))
        heading.locator(".jp-showHiddenCellsButton").click()
        sub.wait_for(state="visible", timeout=30_000)


def test_the_explorer_reads_on_a_projector(jupyterlab, tmp_path):
    """The explorer at 1280x720, JupyterLab's sidebar open as it starts: the picture's smallest
    type (FONT_PT at the figure's dpi, times the scale the browser draws the picture at) and the
    queue text are at least 12 px; a screenshot is saved for the eye."""
    import nbformat

    from kvlab.workbook.viz.snapshot import FONT_PT

    cells = [EXPLORER_CELLS[0],
             'import matplotlib\nprint("DPI", matplotlib.rcParams["figure.dpi"])']
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / "notebooks" / "explorer_projector.ipynb")
    with notebook_running(jupyterlab, "explorer_projector.ipynb", 720,
                          "explorer_projector_failure.png", width=1280) as page:
        notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        box = notebook.locator(".kvlab-explorer").first
        box.wait_for(timeout=240_000)
        cell = notebook.locator(".jp-CodeCell").filter(has=page.locator(".kvlab-explorer")).first
        picture = cell.locator(".jp-OutputArea-output img").first
        picture.wait_for(timeout=60_000)
        dpi_cell = notebook.locator(".jp-CodeCell").filter(has_text='print("DPI"').first
        wait_until(lambda: "DPI " in dpi_cell.locator(".jp-OutputArea").inner_text(), 120, "dpi")
        dpi = float(re.search(r"DPI ([\d.]+)", dpi_cell.locator(".jp-OutputArea").inner_text())
                    .group(1))
        picture.scroll_into_view_if_needed()
        natural = picture.evaluate("img => img.naturalWidth")
        shown = picture.bounding_box()["width"]
        queue_px = float(box.locator(".kvlab-explorer-queues").evaluate(
            "e => parseFloat(getComputedStyle(e.querySelector('*') || e).fontSize)"))
        page.screenshot(path=str(SCREENSHOT_DIR / "explorer_1280x720.png"), full_page=False)
    smallest_px = FONT_PT * dpi / 72 * shown / natural
    assert smallest_px >= 12, f"{smallest_px:.1f} px: the picture is drawn too small"
    assert queue_px >= 12

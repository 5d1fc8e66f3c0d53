"""The workshop around the notebooks: the size setting, the measured minutes, and `make lab`.

- `KVLAB_SIZE` (kvlab/session.py) picks full or small sweeps, and every long sweep uses it;
- the "minutes here" columns of README.md and notebooks/FACILITATOR.md say what
  notebooks/timings.json says (scripts/execute_notebooks.py writes both);
- `make lab` opens chapter 00, with JupyterLab's news prompt switched off by the project's own
  settings file, and a JupyterLab started that way really serves the setting.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from tests.workbook.labserver import running_jupyterlab

from kvlab.workbook import chapters, session
from kvlab.workbook.session import sized

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = chapters.notebook_paths(ROOT)
NEWS_PLUGIN = "@jupyterlab/apputils-extension:notification"


def load_script():
    spec = importlib.util.spec_from_file_location("execute_notebooks",
                                                  ROOT / "scripts" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the size setting ----------------------------------------------------------------------------
def test_size_is_full_unless_set_small(monkeypatch):
    monkeypatch.delenv("KVLAB_SIZE", raising=False)
    assert session.size() == "full" and sized(full=3, small=1) == 3
    for value, expected in (("small", "small"), (" Small\n", "small"), ("full", "full"),
                            ("", "full")):
        monkeypatch.setenv("KVLAB_SIZE", value)
        assert session.size() == expected, value
    monkeypatch.setenv("KVLAB_SIZE", "small")
    assert sized(full=(2, 4, 8), small=(2, 8)) == (2, 8)
    assert sized(full={"num_requests": 16}, small={"num_requests": 8}) == {"num_requests": 8}


def test_size_is_read_at_each_call_and_a_typo_is_refused(monkeypatch):
    monkeypatch.setenv("KVLAB_SIZE", "small")
    assert sized(full=3, small=1) == 1
    monkeypatch.setenv("KVLAB_SIZE", "full")  # as `%env KVLAB_SIZE=full` in a running kernel
    assert sized(full=3, small=1) == 3
    monkeypatch.setenv("KVLAB_SIZE", "tiny")
    with pytest.raises(ValueError, match="KVLAB_SIZE must be one of"):
        sized(full=3, small=1)


# The long sweeps of the workbook, by the function that runs them. Each call must be sized.
# (Chapter 02's parallel_sampling_table is not one: its table is checked output, a row per n,
# so it runs the same at both sizes, and `make test` checks it at KVLAB_SIZE=small.)
LONG_SWEEPS = ("continuous_batching_table(", "chunked_prefill_trials(",
               "cold_warm_ttft(", "no_shared_prefix_cost(", "timing_attack(", "compare_peers(",
               "kv_dtype_table(", "capacity_by_dtype(", "weights_dtype_table(")


def test_every_long_sweep_in_the_notebooks_takes_the_size_setting():
    found = set()
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            calls = [s for s in LONG_SWEEPS if s in cell.source]
            # The long sweep cells, not the exercises' cells (`exercises.check("timing_attack",`).
            calls = [s for s in calls if f".{s}" in cell.source or f"= {s}" in cell.source]
            if calls:
                found.update(calls)
                assert "sized(" in cell.source, f"{path.name}: {calls} without sized(...)"
                assert "from kvlab.workbook.session import sized" in "".join(
                    c.source for c in nb.cells if c.cell_type == "code"), path.name
    assert found == set(LONG_SWEEPS), f"not found in any notebook: {set(LONG_SWEEPS) - found}"


def test_a_sweep_runs_its_small_version_when_asked(monkeypatch):
    """The pattern the notebooks use, on a real sweep: fewer points run under KVLAB_SIZE=small."""
    from kvlab.bench import scheduling

    monkeypatch.setenv("KVLAB_SIZE", "small")
    sweep = scheduling.kv_capacity_sweep(sized(full=(2, 4, 8), small=(2, 4)),
                                         kv_cache_tokens=128, input_len=8, output_len=4)
    assert [r["concurrency"] for r in sweep["rows"]] == [2, 4]


# ---- the measured minutes ------------------------------------------------------------------------
def test_readme_and_guide_show_what_timings_json_says():
    script = load_script()
    timings = json.loads((ROOT / "notebooks" / "timings.json").read_text())
    assert set(timings) == {"machine", "notebooks"}
    assert set(timings["notebooks"]) <= {p.stem for p in NOTEBOOKS}
    for run in timings["notebooks"].values():
        assert run["seconds"] > 0 and re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"])
    for doc in (ROOT / "README.md", ROOT / "notebooks" / "FACILITATOR.md"):
        text = doc.read_text(encoding="utf-8")
        assert script.render(text, timings) == text, (
            f"{doc.name} is out of date: python scripts/execute_notebooks.py --render-only")
        # Every chapter has a row in the doc's "minutes here" table.
        for path in NOTEBOOKS:
            assert re.search(rf"^\| `{path.stem}` \| [^|]+ \|", text, re.M), (doc.name, path.stem)


def test_render_fills_the_minutes_column_and_the_summary_only():
    script = load_script()
    doc = ("| notebook | minutes here | what |\n|---|---|---|\n"
           "| `00_a` | – | keep this | text |\n| `01_b` | 9.9 | and this |\n"
           "| **total** | – | |\n\n| other | table |\n|---|---|\n| `00_a` | untouched |\n\n"
           "Minutes here: <!-- timings -->old words<!-- /timings -->\n")
    timings = {"machine": "a CPU, 2 cores, Linux",
               "notebooks": {"00_a": {"seconds": 90.0, "date": "2026-12-01",
                                      "load_1min_before": 0.1}}}
    out = script.render(doc, timings)
    assert "| `00_a` | 1.5 | keep this | text |" in out
    assert "| `01_b` | – | and this |" in out  # not measured: a dash, never an old number
    assert "| **total** | 1.5 | |" in out
    assert "| `00_a` | untouched |" in out and "|---|---|---|" in out
    assert ("<!-- timings -->each notebook executed top to bottom by "
            "`scripts/execute_notebooks.py` on a CPU, 2 cores, Linux, 2026-12-01; 1 notebook, "
            "1.5 minutes in all.<!-- /timings -->") in out
    assert script.render(out, timings) == out


def test_execute_records_times_and_rewrites_the_docs(tmp_path, monkeypatch):
    """The script's bookkeeping, with the notebook run replaced (executing is nbclient's job)."""
    script = load_script()
    monkeypatch.setattr(script, "execute", lambda path: (78.0, 1536.4))
    doc = tmp_path / "GUIDE.md"
    doc.write_text("| notebook | minutes here | peak GB here |\n|---|---|---|\n| `03_x` | – | – |\n")
    timings = tmp_path / "timings.json"
    script.main([str(tmp_path / "03_x.ipynb"), "--timings", str(timings), "--docs", str(doc)])
    saved = json.loads(timings.read_text())
    assert saved["notebooks"]["03_x"]["seconds"] == 78.0
    assert "cores" in saved["machine"] and "load_1min_before" in saved["notebooks"]["03_x"]
    assert saved["notebooks"]["03_x"]["peak_mib"] == 1536
    assert "| `03_x` | 1.3 | 1.5 |" in doc.read_text()


def test_render_fills_the_peak_memory_column_and_its_total_is_the_largest():
    script = load_script()
    doc = ("| notebook | minutes here | peak GB here |\n|---|---|---|\n| `00_a` | – | – |\n"
           "| `01_b` | – | – |\n| `02_c` | – | – |\n| **total** | – | – |\n")
    runs = {"00_a": {"seconds": 60.0, "date": "2026-12-01", "peak_mib": 1740},
            "01_b": {"seconds": 30.0, "date": "2026-12-01", "peak_mib": 2560},
            "02_c": {"seconds": 30.0, "date": "2026-12-01"}}  # measured before peaks were
    out = script.render(doc, {"machine": "m", "notebooks": runs})
    assert "| `00_a` | 1.0 | 1.7 |" in out and "| `01_b` | 0.5 | 2.5 |" in out
    assert "| `02_c` | 0.5 | – |" in out
    assert "| **total** | 2.0 | 2.5 |" in out


def test_the_kernel_peak_is_read_from_the_running_kernel():
    """What execute() records: the peak resident memory of a live process, by its pid."""
    import os
    import types

    script = load_script()
    me = types.SimpleNamespace(km=types.SimpleNamespace(
        provisioner=types.SimpleNamespace(pid=os.getpid())))
    peak = script.kernel_peak_mib(me)
    if not Path("/proc/self/status").exists():
        assert peak is None
        return
    assert peak > 10  # this test process: more than 10 MiB resident at its peak
    gone = types.SimpleNamespace(km=types.SimpleNamespace(provisioner=types.SimpleNamespace(
        pid=2**22 + 7)))
    assert script.kernel_peak_mib(gone) is None


# ---- make lab ------------------------------------------------------------------------------------
def lab_command() -> list[str]:
    """The `jupyter lab` command `make lab` runs (make -n prints it and runs nothing)."""
    out = subprocess.run(["make", "-n", "lab", "LAB_ROOT="], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.replace("\\\n", " ")
    line = next(ln for ln in out.splitlines() if "jupyter lab" in ln)
    return shlex.split(line)


def test_make_lab_opens_chapter_00_with_the_project_settings():
    overrides = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    assert overrides[NEWS_PLUGIN]["fetchNews"] == "false"
    # The value is one JupyterLab accepts, and its own default is the one that asks.
    schema = json.loads((Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas" /
                         "@jupyterlab" / "apputils-extension" / "notification.json").read_text())
    fetch_news = schema["properties"]["fetchNews"]
    assert fetch_news["default"] == "none"
    assert "false" in {choice["const"] for choice in fetch_news["oneOf"]}
    # make lab installs the file into the venv's own settings folder, then opens chapter 00.
    # -B: print every recipe, also once an earlier `make lab` has made the file up to date.
    plan = subprocess.run(["make", "-n", "-B", "lab"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    assert ("cp jupyter/overrides.json .venv/share/jupyter/lab/settings/overrides.d/kvlab.json"
            in plan)
    url = next(a for a in lab_command() if a.startswith("--LabApp.default_url="))
    notebook = url.removeprefix("--LabApp.default_url=/lab/tree/")
    assert notebook == NOTEBOOKS[0].name


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_jupyterlab_started_as_make_lab_serves_no_news_prompt(tmp_path):
    """JupyterLab, started with make lab's arguments and the installed settings file (here in a
    temporary settings folder, and no user settings), serves fetchNews "false": the front end
    asks about news only when it is "none" (JupyterLab's default). "/" leads to chapter 00."""
    settings = tmp_path / "settings" / "overrides.d"
    settings.mkdir(parents=True)
    shutil.copy(ROOT / "jupyter" / "overrides.json", settings / "kvlab.json")
    args = [*lab_command()[2:], f"--LabApp.app_settings_dir={tmp_path / 'settings'}",
            f"--LabApp.user_settings_dir={tmp_path / 'user-settings'}"]
    with running_jupyterlab(tmp_path, ROOT, args) as (base, token):
        auth = {"Authorization": f"token {token}"}
        req = urllib.request.Request(f"{base}/lab/api/settings/{NEWS_PLUGIN}", headers=auth)
        setting = json.load(urllib.request.urlopen(req, timeout=10))
        # The server hands the front end the schema with the overridden default; the front end
        # takes a user's own value over it, and there is none here.
        assert setting["schema"]["properties"]["fetchNews"]["default"] == "false"
        assert "fetchNews" not in setting["raw"]
        with pytest.raises(urllib.error.HTTPError) as redirect:
            urllib.request.build_opener(NoRedirect).open(
                urllib.request.Request(f"{base}/", headers=auth), timeout=10)
        assert redirect.value.code in (301, 302)
        location = redirect.value.headers["Location"].split("?")[0]
        assert location.endswith(f"/lab/tree/{NOTEBOOKS[0].name}")


RELEASE_SCRIPT = r"""
import json, sys, threading, urllib.request
import ipywidgets
import kvlab
from kvlab import LLM, SamplingParams
from kvlab.serve import BackgroundServer
from kvlab.workbook.session import release

llm = LLM(max_model_len=64)
slider = ipywidgets.IntSlider()
slider.observe(lambda change, engine=llm: None, "value")  # a callback that keeps an engine
ns = {"engines": {"one": llm}, "loaded": kvlab.load_model(), "n": 3, "tok": llm.get_tokenizer(),
      "Out": {1: "a displayed value"}, "_": "the last result", "_7": llm,
      # kvlab's forward pass alone: it holds the fused copies and the layers, not their parent
      "model": llm.llm_engine.model}
# Bound to no name: only its thread holds it. In key mode, with a request served: aiohttp
# then caches the middleware chain, and with it the application (server.py says why).
server = BackgroundServer(LLM(max_model_len=64), api_keys={"key-a": "tenant-a"})
request = urllib.request.Request(server.url + "/v1/models", headers={"Authorization": "Bearer key-a"})
urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=60).read()
del server
ns["engines"]["one"].generate("hello", SamplingParams(max_tokens=2))
threads = [t for t in threading.enumerate() if t.name == "kvlab-server"]
params = sum(p.numel() * p.element_size() for p in ns["loaded"].hf_model.parameters())
del llm, slider
freed = release(ns)
again = LLM(max_model_len=64).generate("hello", SamplingParams(max_tokens=2))[0]
print(json.dumps({**freed, "left": sorted(ns), "server_alive": any(t.is_alive() for t in threads),
                  "param_mib": params / 2**20, "again": len(again.outputs[0].token_ids)}))
"""


@pytest.mark.slow
def test_release_frees_the_chapters_engines_and_weights_and_the_kernel_stays_usable():
    """A chapter's last cell: every name that leads to the weights goes (a dict of engines, a
    loaded model), servers stop, widgets close (a callback held an engine), IPython's output
    history is emptied, nothing else is touched, and a new LLM() works afterwards. In a
    process of its own: this test session's other tests hold engines of their own."""
    proc = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(out["deleted"]) == ["engines", "loaded", "model"]  # what leads to the weights
    assert out["left"] == ["Out", "n", "tok"] and not out["server_alive"]
    assert out["weights_held"] == 0  # nothing kept the transformers model alive
    # The engines' packed copies of the weights (transformers' own pages went back to the file
    # when the first engine was built) and pools: more than the weights' size must leave the
    # process's resident memory, or the release freed nothing a laptop would notice.
    assert out["rss_before_mib"] - out["rss_after_mib"] > out["param_mib"]
    assert out["again"] == 2


SHELL_SCRIPT = r"""
import json
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for cell in ("from kvlab import LLM, SamplingParams",
             "import ipywidgets",
             "llm = LLM(max_model_len=64)",
             # displayed as a cell's result: IPython keeps it as Out[4], _4 (also in its hidden
             # namespace) and in its display hook's _, although no name of the chapter holds it
             "box = ipywidgets.VBox(); box.engine = llm; box",
             "del llm, box",
             "from kvlab.workbook.session import release",
             "freed = release(globals())"):
    assert shell.run_cell(cell, store_history=True).success, cell  # numbered, as in a kernel
print(json.dumps(shell.user_ns["freed"]))
"""


@pytest.mark.slow
def test_release_in_ipython_also_empties_its_output_history():
    proc = subprocess.run([sys.executable, "-c", SHELL_SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["weights_held"] == 0, out

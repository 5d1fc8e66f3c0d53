"""Each chapter's two layers (the path, and Going further folded), and the workshop clock.

The path is what the room reads and does in session: at most about 1,000 words of markdown, and
it runs without Going further (no path cell reads a name that only a Going further cell binds).
FACILITATOR.md's agenda is the one `kvlab.workbook.agenda` computes from the notebooks: a slot
never shorter than its chapter's model, a session never over three hours with its break.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
from pathlib import Path

import pytest

from kvlab.workbook import agenda, chapters

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
FACILITATOR = NOTEBOOKS / "FACILITATOR.md"
CHAPTER_PATHS = [NOTEBOOKS / c.notebook for c in chapters.CHAPTERS]
# The words limit holds for every chapter ("about 1,000": 10% over is still about).
WORDS_LIMIT = agenda.PATH_WORDS_LIMIT * 1.1


def _nb(path):
    return json.loads(Path(path).read_text())


@pytest.mark.parametrize("path", CHAPTER_PATHS, ids=lambda p: p.stem[:2])
def test_each_chapter_has_a_path_and_a_folded_going_further(path):
    nb = _nb(path)
    path_idx, further_idx = agenda.layers(nb)
    assert further_idx, f"{path.name} has no '{agenda.GOING_FURTHER}' heading"
    head = nb["cells"][further_idx[0]]
    assert head["metadata"].get(agenda.FOLDED) is True, "Going further opens folded"
    # The release cell's section comes after Going further, so the path ends by freeing memory.
    after = [nb["cells"][i] for i in path_idx if i > further_idx[-1]]
    assert after and "".join(after[0]["source"]).startswith(agenda.BEFORE_NEXT)
    clock = agenda.chapter_clock(path)
    assert clock["path_words"] <= WORDS_LIMIT, (
        f"{path.name}: {clock['path_words']} words on the path (about {agenda.PATH_WORDS_LIMIT})")


def _magic_free(source: str) -> str:
    """The cell as Python: IPython's own transform turns `%magic` and `!shell` lines into calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _names(source: str) -> tuple[set[str], set[str]]:
    """(names the cell binds anywhere, names it loads)."""
    tree = ast.parse(_magic_free(source))
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, (ast.Store, ast.Del)) else loaded).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, loaded


def unbound_on_path(nb) -> dict[int, set[str]]:
    """Path cells that read a name no earlier path cell (nor the cell itself) binds."""
    path_idx, _ = agenda.layers(nb)
    known = set(dir(builtins)) | {"get_ipython", "display", "In", "Out"}
    missing = {}
    for i in path_idx:
        cell = nb["cells"][i]
        if cell["cell_type"] != "code":
            continue
        bound, loaded = _names("".join(cell["source"]))
        if loaded - bound - known:
            missing[i] = loaded - bound - known
        known |= bound
    return missing


@pytest.mark.parametrize("path", CHAPTER_PATHS, ids=lambda p: p.stem[:2])
def test_the_path_runs_without_going_further(path):
    assert unbound_on_path(_nb(path)) == {}


def test_the_dependency_check_catches_a_path_cell_that_needs_going_further():
    def code(src):
        return {"cell_type": "code", "source": src, "metadata": {}}

    def md(src, **meta):
        return {"cell_type": "markdown", "source": src, "metadata": meta}

    nb = {"cells": [code("a = 1"), md(agenda.GOING_FURTHER, **{agenda.FOLDED: True}),
                    code("b = a + 1"), md(agenda.BEFORE_NEXT), code("print(a)")]}
    assert unbound_on_path(nb) == {}
    nb["cells"][4] = code("print(b)")
    assert unbound_on_path(nb) == {4: {"b"}}


def _agenda_block(text: str) -> str:
    m = re.search(r"<!-- agenda -->\n(.*?)<!-- /agenda -->", text, re.S)
    assert m, "FACILITATOR.md has no <!-- agenda --> block"
    return m.group(1)


def test_facilitator_shows_the_computed_agenda_and_every_slot_fits_its_model():
    sessions = agenda.plan({c.number: NOTEBOOKS / c.notebook for c in chapters.CHAPTERS})
    assert _agenda_block(FACILITATOR.read_text()) == agenda.render_agenda(sessions)
    planned = [n for s in agenda.SESSIONS for n in s["chapters"]]
    assert sorted(planned) == sorted(c.number for c in chapters.CHAPTERS)
    for s in sessions:
        assert s["total"] <= agenda.SESSION_MINUTES, f"{s['name']}: {s['total']} minutes"
        assert sum(r["chapter"] == "break" for r in s["rows"]) == 1
        for r in s["rows"]:
            if r["model"] is not None:
                assert r["minutes"] >= r["model"], r
        # 06 never absorbs a delay: it is not the last chapter of its session.
        assert s["rows"][-1]["chapter"] != "06"


def test_the_clock_counts_what_the_model_says(tmp_path):
    stamp = {"iopub.execute_input": "2026-01-01T00:00:00Z",
             "shell.execute_reply": "2026-01-01T00:00:30Z"}
    cells = [
        {"cell_type": "markdown", "source": " ".join(["word"] * 360), "metadata": {}},
        {"cell_type": "code", "source": "prediction_x = None", "metadata": {"execution": stamp}},
        {"cell_type": "code", "source": "check()",
         "metadata": {"execution": stamp, "tags": ["exercise-check"]}},
        {"cell_type": "markdown", "source": agenda.GOING_FURTHER,
         "metadata": {agenda.FOLDED: True}},
        {"cell_type": "markdown", "source": "more " * 50, "metadata": {}},
        {"cell_type": "code", "source": "slow()", "metadata": {"execution": stamp}},
        {"cell_type": "markdown", "source": agenda.BEFORE_NEXT, "metadata": {}},
    ]
    p = tmp_path / "nb.ipynb"
    p.write_text(json.dumps({"cells": cells}))
    c = agenda.chapter_clock(p)
    # 360 words / 180 = 2 min, 60 s run = 1 min, one exercise 5, one prediction 2.
    assert (c["path_words"], c["further_words"], c["path_run_s"]) == (365, 53, 60.0)
    assert c["model_minutes"] == pytest.approx(365 / 180 + 1 + 5 + 2, abs=0.05)
    assert c["folded"] and agenda.slot(c["model_minutes"]) == 10

"""The build track as the committed notebooks show it: every exercise is its stub, its check and
its comparison, in that order; no kvlab source is on screen before the participant asks for it;
the terms the chapters use are defined in bold where they first appear and gathered in the
glossary the chapters link to."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from kvlab.workbook import chapters, exercises

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
BUILD_CHAPTERS = chapters.notebook_paths(ROOT, chapters.with_exercises())
ALL_CHAPTERS = chapters.notebook_paths(ROOT)
# A line of Python source: what kvlab.show or exercises.solution print.
SOURCE_LINE = re.compile(r"^\s*(def|class) \w+.*[:(]", re.MULTILINE)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def visible_output(cell: dict) -> str:
    """What a reader sees under a code cell when the notebook opens (folded outputs: nothing)."""
    if cell.get("metadata", {}).get("jupyter", {}).get("outputs_hidden"):
        return ""
    parts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            parts.append("".join(out["text"]))
        for kind in ("text/plain", "text/html", "text/markdown"):
            if kind in out.get("data", {}):
                parts.append("".join(out["data"][kind]))
    return "\n".join(parts)


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_each_exercise_is_its_stub_then_its_check_then_its_comparison(name):
    ex = exercises.EXERCISES[name]
    nb = cells(NOTEBOOKS / f"{ex.chapter}.ipynb")
    stubs = [i for i, c in enumerate(nb) if c["cell_type"] == "code"
             and text(c).strip() == ex.stub.strip()]
    assert len(stubs) == 1, f"{name}: its stub is not one cell of {ex.chapter}"
    i = stubs[0]
    heading = f"### Challenge: {ex.title}" if ex.kind == "challenge" else f"### Your turn: {ex.title}"
    assert heading in text(nb[i - 1])
    assert ex.prompt in text(nb[i - 1])
    assert f'exercises.check("{name}", {ex.entry_point})' in text(nb[i + 1])
    assert f'exercises.compare("{name}", {ex.entry_point})' in text(nb[i + 2])
    for cell in nb[i - 1:i + 3]:
        assert "exercises.solution(" not in text(cell) or cell["cell_type"] == "markdown"


@pytest.mark.parametrize("path", BUILD_CHAPTERS, ids=lambda p: p.stem)
def test_committed_chapters_show_no_kvlab_source_before_it_is_asked_for(path):
    """No visible output of a chapter with exercises prints a function or class (kvlab.show, a
    solution, a comparison's answer); a folded output may, since opening it is asking."""
    for i, cell in enumerate(cells(path)):
        if cell["cell_type"] != "code":
            continue
        shown = visible_output(cell)
        assert not SOURCE_LINE.search(shown), (
            f"{path.stem} cell {i} shows source:\n{SOURCE_LINE.search(shown).group(0)}")
        if "show_source(" in text(cell) or "exercises.solution(" in text(cell):
            assert cell["metadata"].get("jupyter", {}).get("outputs_hidden"), (
                f"{path.stem} cell {i} prints kvlab's source unfolded")


def test_chapters_01_to_06_hold_challenges_and_every_exercise_has_a_kind():
    kinds = {ex.kind for ex in exercises.EXERCISES.values()}
    assert kinds == {"build", "challenge"}
    assert {ex.chapter[:2] for ex in exercises.EXERCISES.values() if ex.kind == "challenge"}


def test_a_folded_cell_really_holds_source_so_the_check_above_can_fail():
    """Chapter 00's forward pass is printed folded: the output is there, only hidden."""
    nb = cells(NOTEBOOKS / "00_the_model_and_its_kv_cache.ipynb")
    folded = [c for c in nb if c["cell_type"] == "code" and "show_source(" in text(c)
              and c["metadata"].get("jupyter", {}).get("outputs_hidden")]
    assert folded
    shown = "".join("".join(o.get("text", "")) for o in folded[0]["outputs"])
    assert SOURCE_LINE.search(shown)


@functools.lru_cache(maxsize=1)
def _executor():
    """scripts/execute_notebooks.py as a module, loaded once for the whole file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "execute_notebooks", ROOT / "scripts" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sources(path: Path) -> list[dict]:
    return [dict(c, source=text(c)) for c in cells(path)]


@pytest.mark.parametrize("path", ALL_CHAPTERS, ids=lambda p: p.stem)
def test_saved_outputs_that_answer_a_prediction_open_folded(path):
    """Every measurement and reveal between a prediction and the cell that grades it opens
    folded, so the saved numbers do not answer the question before it is asked."""
    nb = _sources(path)
    for i in _executor().answer_cells(nb):
        if nb[i].get("outputs"):
            assert nb[i]["metadata"].get("jupyter", {}).get("outputs_hidden"), (
                f"{path.stem} cell {i} answers a prediction unfolded:\n{nb[i]['source'][:200]}")


def test_the_cells_that_answer_a_prediction_are_the_measurement_and_its_grading():
    """Chapter 04's gap prediction: the stall table and the cell that grades it, nothing
    before the prediction and nothing after the grading."""
    nb = _sources(NOTEBOOKS / "04_chunked_prefill.ipynb")
    asked = next(i for i, c in enumerate(nb) if c["source"].startswith("prediction_gap_ms ="))
    answers = [i for i in _executor().answer_cells(nb) if i <= asked + 2]
    assert answers == [asked + 1, asked + 2]
    assert "chunked_prefill_trials" in nb[asked + 1]["source"]
    assert "prediction_gap_ms" in nb[asked + 2]["source"]


def glossary() -> list[tuple[str, str]]:
    """(term, first chapter) rows of notebooks/GLOSSARY.md."""
    rows = []
    for line in (NOTEBOOKS / "GLOSSARY.md").read_text().splitlines():
        m = re.match(r"\| <a id=\"[\w-]+\"></a>\*\*(.+?)\*\* \| .+ \| (\d\d)", line)
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def test_every_chapter_links_the_glossary():
    assert len(glossary()) >= 30
    for path in ALL_CHAPTERS:
        assert "](GLOSSARY.md)" in text(cells(path)[0]), f"{path.stem}: no glossary link"


@pytest.mark.parametrize("term, chapter", glossary())
def test_each_glossary_term_is_defined_in_bold_in_its_first_chapter(term, chapter):
    path = next(p for p in ALL_CHAPTERS if p.stem.startswith(chapter))
    markdown = "\n".join(text(c) for c in cells(path) if c["cell_type"] == "markdown")
    bold = {" ".join(m.lower().split()) for m in re.findall(r"\*\*(.+?)\*\*", markdown, re.DOTALL)}
    # The glossary's "internal / external fragmentation" is two bold phrases in the chapter.
    wanted = [t.strip() for t in re.split(r" / ", term.lower())]
    if len(wanted) == 2 and " " in wanted[1]:
        wanted[0] = wanted[0] + " " + wanted[1].split(" ", 1)[1]
    for w in wanted:
        stem = w.split(" (")[0]
        assert any(b.startswith(stem) or b.rstrip("s") == stem or stem in b for b in bold), (
            f"{term!r} is not in bold in chapter {chapter} ({path.stem})")


def test_solved_notebooks_replace_every_stub_with_an_answer_that_passes(tmp_path):
    """The instructor's copies come from kvlab.workbook.exercises: every stub cell of each
    chapter with exercises becomes its solution, one copy per such chapter, nothing else
    changes but the outputs, and each solution cell, executed on its own, defines code that
    passes its exercise's fast cases."""
    spec_path = ROOT / "scripts" / "solved_notebooks.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("solved_notebooks", spec_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in BUILD_CHAPTERS)
    solved_names = []
    for path in BUILD_CHAPTERS:
        original = cells(path)
        solved = cells(tmp_path / path.name)
        assert "Instructor's copy" in text(solved[0])
        assert len(solved) == len(original) + 1
        for before, after in zip(original, solved[1:]):
            assert not after.get("outputs")
            if "solution" not in after["metadata"].get("tags", []):
                assert text(after) == text(before)
                continue
            name = next(ex.name for ex in exercises.by_chapter(path.stem)
                        if ex.stub.strip() == text(before).strip())
            ex = exercises.EXERCISES[name]
            assert 'raise NotImplementedError("your turn")' not in text(after)
            namespace: dict = {}
            exec(compile(text(after), f"<solved {name}>", "exec"), namespace)
            result = exercises.check(name, namespace[ex.entry_point], real_model=False)
            assert result, str(result)
            solved_names.append(name)
    assert sorted(solved_names) == sorted(exercises.EXERCISES)

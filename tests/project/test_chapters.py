"""The chapter index (kvlab/workbook/chapters.py) and the files it names agree: every chapter
notebook in notebooks/ is listed, and every notebook, exercise module, figures module, bench
subcommand and reproduce experiment the index lists exists."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from kvlab.bench.__main__ import parser
from kvlab.bench.api_experiments import API_EXPERIMENTS
from kvlab.bench.reproduce import EXPERIMENTS
from kvlab.workbook import chapters

ROOT = Path(__file__).resolve().parents[2]
# What a chapter's notebook is named like: the check below finds one the index leaves out.
CHAPTER_NOTEBOOK = "[0-9][0-9]_*.ipynb"


def unlisted_notebooks(notebooks: Path) -> list[str]:
    listed = {c.notebook for c in chapters.chapters()}
    return sorted(p.name for p in notebooks.glob(CHAPTER_NOTEBOOK) if p.name not in listed)


def missing_notebooks(root: Path) -> list[str]:
    return [p.name for p in chapters.notebook_paths(root) if not p.is_file()]


def test_every_chapter_notebook_is_in_the_index_and_every_listed_one_exists():
    assert unlisted_notebooks(ROOT / "notebooks") == []
    assert missing_notebooks(ROOT) == []


def test_the_checks_above_catch_a_notebook_left_out_and_one_that_is_gone(tmp_path):
    """A notebooks/ folder with one chapter more and one fewer than the index: both are named."""
    (tmp_path / "notebooks").mkdir()
    for path in chapters.notebook_paths(tmp_path)[1:]:
        path.write_text("{}")
    (tmp_path / "notebooks" / "99_unlisted.ipynb").write_text("{}")
    assert unlisted_notebooks(tmp_path / "notebooks") == ["99_unlisted.ipynb"]
    assert missing_notebooks(tmp_path) == [chapters.chapters()[0].notebook]


def test_numbers_are_the_notebooks_prefixes_unique_and_in_order():
    numbers = [c.number for c in chapters.chapters()]
    assert numbers == sorted(set(numbers))
    for c in chapters.chapters():
        assert c.notebook.startswith(f"{c.number}_") and c.notebook.endswith(".ipynb")
        assert chapters.by_number(c.number) is c is chapters.by_stem(c.stem)
    assert chapters.by_number(3) is chapters.by_number("03")
    with pytest.raises(KeyError, match="the chapters are"):
        chapters.by_number("99")


def test_listed_exercises_are_defined_by_the_modules_the_index_names():
    """Each exercise is in its module's EXERCISES, of the kind the index files it under, and
    names its chapter's notebook; no name is listed twice."""
    names = [n for c in chapters.chapters() for n in c.exercises]
    assert len(names) == len(set(names))
    for c in chapters.chapters():
        for kind, modules in (("build", c.builds), ("challenge", c.challenges)):
            for module, listed in modules.items():
                defined = {ex.name: ex for ex in importlib.import_module(
                    f"kvlab.workbook.exercises.{module}").EXERCISES}
                for name in listed:
                    assert name in defined, f"chapter {c.number}: {module} defines no {name!r}"
                    assert defined[name].kind == kind and defined[name].chapter == c.stem


def test_make_solved_covers_exactly_the_chapters_with_exercises():
    solved = chapters.with_exercises()
    assert solved and all(c.exercises for c in solved)
    assert all(not c.exercises for c in chapters.chapters() if c not in solved)


def test_figures_modules_exist_and_each_is_some_chapter_s():
    """Every kvlab.workbook.viz module a chapter lists imports; every module there but `axes`
    (what all figures share) belongs to a chapter."""
    listed = {m for c in chapters.chapters() for m in c.figures}
    for module in listed:
        importlib.import_module(f"kvlab.workbook.viz.{module}")
    on_disk = {p.stem for p in (ROOT / "kvlab" / "workbook" / "viz").glob("*.py")}
    assert listed == on_disk - {"__init__", "axes"}


def test_bench_subcommands_exist():
    subparsers = next(a for a in parser()._actions if a.dest == "command")
    for c in chapters.chapters():
        unknown = set(c.bench) - set(subparsers.choices)
        assert not unknown, f"chapter {c.number}: no `python -m kvlab.bench` {sorted(unknown)}"


def test_reproduce_experiments_belong_to_the_chapter_that_lists_them():
    """Each experiment, in process and through the API, is listed by exactly the chapter it
    says it reproduces."""
    for table, field, chapter_of in ((EXPERIMENTS, "reproduce", lambda e: e.chapter),
                                     (API_EXPERIMENTS, "reproduce_api", lambda e: e[0])):
        listed = {n: c.number for c in chapters.chapters() for n in getattr(c, field)}
        assert sum(len(getattr(c, field)) for c in chapters.chapters()) == len(listed)
        assert listed == {name: chapter_of(e) for name, e in table.items()}, field

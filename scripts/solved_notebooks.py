"""The instructor's copies: every exercise and challenge cell of a chapter holds kvlab's answer.

    python scripts/solved_notebooks.py              (or: make solved) into build/solved/
    python scripts/solved_notebooks.py --out DIR

Made from one source, `kvlab.workbook.exercises`: each cell whose source is an exercise's stub is replaced
by what `exercises.solution(name)` prints (its imports, then the reference), and every output is
cleared, so the copy runs top to bottom and each check passes. The participants' notebooks are
never touched; build/ is not committed (tests/workbook/test_build_track.py makes the copies and checks
that every stub was replaced and every answer passes its fast cases). Which chapters have
exercises is the chapter index's to say (kvlab/workbook/chapters.py: `with_exercises()`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BANNER = ("> **Instructor's copy.** Every *Your turn* and *Challenge* cell below holds kvlab's "
          "answer, made by `scripts/solved_notebooks.py` from `kvlab.workbook.exercises`; the "
          "participants' notebook is `notebooks/{name}`. Do not hand this one out before the "
          "session.")


def solve(path: Path):
    """The notebook at `path` with every stub replaced; returns (notebook, names replaced)."""
    import nbformat

    from kvlab.workbook import exercises

    nb = nbformat.read(path, as_version=4)
    stubs = {ex.stub.strip(): ex for ex in exercises.by_chapter(path.stem)}
    replaced = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            ex = stubs.get(cell.source.strip())
            if ex is not None:
                cell.source = ex.solution_source().rstrip("\n")
                cell.metadata.setdefault("tags", []).append("solution")
                replaced.append(ex.name)
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("jupyter", None)
            cell.metadata.pop("collapsed", None)
    missing = set(ex.name for ex in stubs.values()) - set(replaced)
    if missing:
        raise SystemExit(f"{path.name}: no stub cell for {sorted(missing)}; the notebook and "
                         f"kvlab.workbook.exercises disagree")
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(BANNER.format(name=path.name)))
    nb.metadata.pop("widgets", None)
    return nb, replaced


def main(argv=None) -> None:
    import nbformat

    from kvlab.workbook import chapters

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "solved")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in chapters.notebook_paths(ROOT, chapters.with_exercises()):
        nb, replaced = solve(path)
        nbformat.write(nb, args.out / path.name)
        print(f"{args.out / path.name}: {len(replaced)} answers ({', '.join(replaced)})")


if __name__ == "__main__":
    main(sys.argv[1:])

"""A chapter's two layers, and the workshop clock computed from them.

Every chapter notebook is a *path* (what the room reads and does in session) followed by one
`## Going further` heading, folded by default in JupyterLab (the heading cell's
`jp-MarkdownHeadingCollapsed` metadata), under which everything else stays, still executed.
The chapter's last section, `## Before the next chapter` (the cell that frees the kernel's
memory), comes after it and belongs to the path again.

The clock models a chapter's minutes in session from the notebook itself:

    path words / 180  +  the path's measured run time  +  5 per exercise or challenge
                      +  2 per prediction

where the run time is the sum of the path's code cells' own execution times, read from the
timestamps Jupyter saves in each executed cell (`metadata.execution`), so it is the committed
run's, on the machine that executed the notebooks (notebooks/timings.json names it). An exercise
is a cell tagged `exercise-check` (one per "Your turn" and per "Challenge"), a prediction a code
cell that sets `prediction_... =` (its guess, None until typed). notebooks/FACILITATOR.md's agenda is rendered from
`SESSIONS` by scripts/execute_notebooks.py, and tests/workbook/test_agenda.py holds it to the
model: no slot shorter than its chapter's model, no session over three hours.

    from kvlab.workbook import agenda
    agenda.chapter_clock("notebooks/03_continuous_batching.ipynb")["model_minutes"]
"""

from __future__ import annotations

import datetime
import json
import math
import re
from pathlib import Path

GOING_FURTHER = "## Going further"
BEFORE_NEXT = "## Before the next chapter"
FOLDED = "jp-MarkdownHeadingCollapsed"  # JupyterLab's own metadata for a collapsed heading

READING_WORDS_PER_MINUTE = 180
MINUTES_PER_EXERCISE = 5  # each "Your turn" and each "Challenge" on the path
MINUTES_PER_PREDICTION = 2  # type a guess, run, talk about it
PATH_WORDS_LIMIT = 1000  # "about 1,000 words": the test allows this and 10% more
SESSION_MINUTES = 180
BREAK_MINUTES = 10
ARRIVAL_MINUTES = 10  # the first load of the model while the facilitator introduces the day

PREDICTION = re.compile(r"^prediction_\w+\s*=", re.MULTILINE)  # one question a cell

# The plan: which chapters each three-hour session covers. One 10-minute break per session,
# after the chapter named. 06 is never last in a session where a delay would eat it.
SESSIONS: tuple[dict, ...] = (
    {"name": "Session 1", "chapters": ("00", "01", "02", "03"), "break_after": "01"},
    {"name": "Session 2", "chapters": ("04", "05", "06", "07", "08"), "break_after": "05"},
    # 09 and 10 made session 2 longer than three hours at the cold readers' pace (173 minutes
    # of reading for 160 left after arrival and the break): beyond the pool, a session of
    # its own.
    {"name": "Session 3", "chapters": ("09", "10"), "break_after": "09"},
)


# The paths as two cold readers timed them as participants (2026-12-06, reading, predicting,
# writing the exercises, running the cells; minutes per chapter). The model above is a floor:
# these are what a session's reserve must absorb, and what the readiness check leaves for
# slower cells (kvlab/workbook/ready.py).
COLD_READ_MINUTES = {"00": 35, "01": 23, "02": 31, "03": 42, "04": 25, "05": 24, "06": 30,
                     "07": 19, "08": 25,
                     # 09 is not a timing: its one cold reader (2026-12-06) read and wrote the
                     # path in minutes no participant would. Chapter 08's figure stands in, the
                     # chapter nearest it in shape (two predictions, one build on the path).
                     "09": 25,
                     # 10 is not a timing either: no one has read it cold as a participant yet.
                     # Chapter 09's stand-in stands in again (three predictions and one build
                     # on the path, as 08 and 09).
                     "10": 25}


def _source(cell) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def _heading(cell) -> str:
    return _source(cell).lstrip().split("\n", 1)[0].strip() if cell["cell_type"] == "markdown" else ""


def layers(nb) -> tuple[list[int], list[int]]:
    """(path cell indices, Going further cell indices). Going further runs from its heading to
    the next level-1 or level-2 heading (in practice `## Before the next chapter`)."""
    cells = nb["cells"]
    start = next((i for i, c in enumerate(cells) if _heading(c) == GOING_FURTHER), None)
    if start is None:
        return list(range(len(cells))), []
    end = next((j for j in range(start + 1, len(cells))
                if re.match(r"^#{1,2} ", _heading(cells[j]))), len(cells))
    further = list(range(start, end))
    return [i for i in range(len(cells)) if i not in set(further)], further


def words(cells) -> int:
    """Markdown words: what a reader reads (code cells are run, not read as prose)."""
    return sum(len(_source(c).split()) for c in cells if c["cell_type"] == "markdown")


def _time(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def run_seconds(cells) -> float:
    """The code cells' own execution times, from the timestamps Jupyter saved in each one. A
    code cell without them (never executed) raises: the clock needs the committed run."""
    total = 0.0
    for c in cells:
        if c["cell_type"] != "code":
            continue
        ex = c.get("metadata", {}).get("execution")
        if not ex or "iopub.execute_input" not in ex or "shell.execute_reply" not in ex:
            raise ValueError("a code cell carries no execution timestamps: execute the notebook "
                             "with scripts/execute_notebooks.py first")
        total += (_time(ex["shell.execute_reply"]) - _time(ex["iopub.execute_input"])).total_seconds()
    return total


def count_exercises(cells) -> int:
    return sum("exercise-check" in c.get("metadata", {}).get("tags", ()) for c in cells)


def count_predictions(cells) -> int:
    return sum(bool(PREDICTION.search(_source(c))) for c in cells if c["cell_type"] == "code")


def chapter_clock(path) -> dict:
    """The two layers' sizes and the path's modelled minutes for one notebook."""
    nb = json.loads(Path(path).read_text())
    path_idx, further_idx = layers(nb)
    path_cells = [nb["cells"][i] for i in path_idx]
    further_cells = [nb["cells"][i] for i in further_idx]
    w, run = words(path_cells), run_seconds(path_cells)
    ex, pred = count_exercises(path_cells), count_predictions(path_cells)
    model = (w / READING_WORDS_PER_MINUTE + run / 60 + MINUTES_PER_EXERCISE * ex
             + MINUTES_PER_PREDICTION * pred)
    return {"path_words": w, "further_words": words(further_cells),
            "path_run_s": round(run, 1), "exercises": ex, "predictions": pred,
            "model_minutes": round(model, 1),
            "folded": bool(further_idx) and bool(nb["cells"][further_idx[0]]
                                                 .get("metadata", {}).get(FOLDED))}


def slot(model_minutes: float) -> int:
    """A chapter's slot: its model rounded up to five minutes."""
    return 5 * math.ceil(model_minutes / 5)


def plan(notebooks: dict[str, Path]) -> list[dict]:
    """Each session's rows (clock, chapter, slot, model) from SESSIONS and the notebooks:
    `notebooks` maps a chapter number to its notebook."""
    sessions = []
    for s in SESSIONS:
        rows, clock = [], 0
        rows.append({"clock": clock, "chapter": "arrival", "minutes": ARRIVAL_MINUTES, "model": None})
        clock += ARRIVAL_MINUTES
        for number in s["chapters"]:
            c = chapter_clock(notebooks[number])
            rows.append({"clock": clock, "chapter": number, "minutes": slot(c["model_minutes"]),
                         "model": c["model_minutes"], **c})
            clock += rows[-1]["minutes"]
            if number == s["break_after"]:
                rows.append({"clock": clock, "chapter": "break", "minutes": BREAK_MINUTES,
                             "model": None})
                clock += BREAK_MINUTES
        sessions.append({"name": s["name"], "rows": rows, "total": clock})
    return sessions


def render_agenda(sessions: list[dict]) -> str:
    """The markdown tables FACILITATOR.md shows between its `<!-- agenda -->` markers."""
    out = []
    for s in sessions:
        out.append(f"**{s['name']}** ({s['total']} of {SESSION_MINUTES} minutes)\n")
        out.append("| clock | chapter | slot (min) | model (min) | path words | path run (s) "
                   "| exercises | predictions |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in s["rows"]:
            h, m = divmod(r["clock"], 60)
            if r["model"] is None:
                out.append(f"| {h}:{m:02d} | {r['chapter']} | {r['minutes']} | | | | | |")
            else:
                out.append(f"| {h}:{m:02d} | {r['chapter']} | {r['minutes']} | {r['model']} "
                           f"| {r['path_words']} | {r['path_run_s']:.0f} | {r['exercises']} "
                           f"| {r['predictions']} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"

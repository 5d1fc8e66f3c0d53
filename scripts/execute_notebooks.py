"""Execute notebooks top to bottom on this machine, save them clean, and record their wall times.

    python scripts/execute_notebooks.py                      (or: make execute) every chapter
    python scripts/execute_notebooks.py notebooks/03_*.ipynb one chapter
    python scripts/execute_notebooks.py --render-only        only rewrite the docs' minutes

Clean means: kernel name python3, execution counts kept, `metadata.widgets` removed (GitHub
refuses to render a notebook whose widget metadata carries no state). Folded means: the saved
outputs that answer a prediction (each code cell after a `prediction_... =` cell, up to the
first that reads the prediction) open collapsed (`jupyter.outputs_hidden`), so a participant
predicts before seeing them; JupyterLab unfolds a cell's output when the cell runs.
`--fold-only` refolds the committed notebooks without executing them. Every chapter is every
notebook the chapter index lists (kvlab/workbook/chapters.py).

Each notebook's wall time (kernel start included) and its kernel's peak resident memory (Linux
VmHWM, read after every cell) go into notebooks/timings.json with the machine, the date and the 1-minute load average just before it started (notebooks run back to
back, so that average includes the previous notebook's own kernel; it is kept as a hint, not a
proof of a quiet machine). The "minutes here" and "peak GB here" columns of the chapter tables in README.md and
notebooks/FACILITATOR.md, and the line between their `<!-- timings -->` markers, are rewritten
from that file after every notebook; tests/workbook/test_session.py checks that they agree with it. Run
it alone on a quiet machine: the times are what the README promises. It refuses to run with
KVLAB_SIZE set to anything but "full": the committed outputs are the full run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
TIMINGS = NOTEBOOKS / "timings.json"
DOCS = (ROOT / "README.md", NOTEBOOKS / "FACILITATOR.md")
COLUMN = "minutes here"
PEAK_COLUMN = "peak GB here"  # the kernel's peak resident memory (Linux VmHWM)
MARKERS = ("<!-- timings -->", "<!-- /timings -->")


PREDICTION = re.compile(r"^(prediction_\w+)\s*=", re.MULTILINE)
EXERCISE_TAGS = {"exercise", "exercise-check", "exercise-compare"}


def answer_cells(cells) -> list[int]:
    """Indices of the code cells whose saved outputs answer a prediction: after each cell that
    sets `prediction_...`, every code cell up to and including the first that reads one of its
    names (an exercise's own cells excepted: they print no measurement)."""
    found = set()
    for i, cell in enumerate(cells):
        names = PREDICTION.findall(cell["source"]) if cell["cell_type"] == "code" else []
        if not names:
            continue
        reads = re.compile(r"\b(" + "|".join(names) + r")\b")
        for j in range(i + 1, len(cells)):
            later = cells[j]
            if later["cell_type"] != "code":
                continue
            if not EXERCISE_TAGS & set(later.get("metadata", {}).get("tags", [])):
                found.add(j)
            if reads.search(later["source"]):
                break
    return sorted(found)


def fold_answers(nb) -> None:
    for i in answer_cells(nb.cells):
        meta = nb.cells[i].metadata
        meta.setdefault("jupyter", {})["outputs_hidden"] = True
        meta["collapsed"] = True


def execute(path: Path) -> float:
    """Run one notebook in a fresh python3 kernel, in its own folder; save it; return seconds."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    peak = {"mib": None}

    def after_cell(**_):  # the kernel is alive here; its peak only grows, so the last one counts
        peak["mib"] = kernel_peak_mib(client) or peak["mib"]

    client.on_cell_executed = after_cell
    client.execute()
    seconds = time.perf_counter() - t0
    fold_answers(nb)
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, path)
    return seconds, peak["mib"]


def kernel_peak_mib(client) -> float | None:
    """The kernel process's peak resident memory so far, in MiB (Linux's VmHWM); None where
    /proc is not there or the kernel is not a local process."""
    try:
        pid = client.km.provisioner.pid
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (AttributeError, OSError, ValueError, TypeError):
        return None
    return None


def machine() -> str:
    """What ran the notebooks, in words: CPU model, cores, OS (the README quotes it)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def load_timings(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"machine": None, "notebooks": {}}


def record(timings: dict, stem: str, seconds: float, load: float,
           peak_mib: float | None = None) -> None:
    timings["machine"] = machine()
    timings["notebooks"][stem] = {"seconds": round(seconds, 1),
                                  "date": datetime.date.today().isoformat(),
                                  "load_1min_before": round(load, 2)}
    if peak_mib is not None:
        timings["notebooks"][stem]["peak_mib"] = round(peak_mib)
    timings["notebooks"] = dict(sorted(timings["notebooks"].items()))


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def summary(timings: dict) -> str:
    """The words between the markers: where, when, and the whole workbook's time."""
    runs = timings["notebooks"]
    if not runs:
        return "not measured yet (`python scripts/execute_notebooks.py` measures them)."
    dates = sorted({r["date"] for r in runs.values()})
    total = sum(r["seconds"] for r in runs.values())
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return (f"each notebook executed top to bottom by "
            f"`scripts/execute_notebooks.py` on {timings['machine']}, {when}; "
            f"{len(runs)} notebook{'s' if len(runs) > 1 else ''}, {minutes(total)} minutes in all.")


def _peak_gb(run: dict) -> str:
    return f"{run['peak_mib'] / 1024:.1f}" if run.get("peak_mib") else "–"


# The measured columns: header -> (a notebook's value, the total row's value).
MEASURED = {
    COLUMN: (lambda run: minutes(run["seconds"]),
             lambda runs: minutes(sum(r["seconds"] for r in runs))),
    PEAK_COLUMN: (_peak_gb,  # the total row: the largest one chapter needs, not a sum
                  lambda runs: max((_peak_gb(r) for r in runs if r.get("peak_mib")),
                                   key=float, default="–")),
}


def render(text: str, timings: dict) -> str:
    """`text` with every measured cell ("minutes here", "peak GB here") and the marked summary
    filled from `timings`.

    A table takes part when its header has one of those columns; its rows name a notebook in
    their first cell (`00_the_model_and_its_kv_cache`) or are a "total" row. Anything else is
    left as it is, so other columns can be edited freely. A notebook not measured gets a dash.
    """
    runs = timings["notebooks"]
    out, columns = [], None
    for line in text.splitlines(keepends=True):
        cells = line.rstrip("\n").split("|")
        if not line.startswith("|"):
            columns = None
        elif columns is None:
            names = [c.strip() for c in cells]
            columns = {names.index(h): h for h in MEASURED if h in names}
        elif (columns and min(columns) < len(cells)
              and not set(cells[min(columns)].strip()) <= set("-: ")):
            key = cells[1].strip().strip("`*")
            for index, header in columns.items():
                if index >= len(cells):
                    continue
                one, total = MEASURED[header]
                if key in runs:
                    value = one(runs[key])
                elif key == "total" and runs:
                    value = total(list(runs.values()))
                else:
                    value = "–"
                cells[index] = f" {value} "
            line = "|".join(cells) + ("\n" if line.endswith("\n") else "")
        out.append(line)
    text = "".join(out)
    start, end = (re.escape(m) for m in MARKERS)
    return re.sub(f"{start}.*?{end}", lambda _: f"{MARKERS[0]}{summary(timings)}{MARKERS[1]}",
                  text, flags=re.S)


AGENDA_MARKERS = ("<!-- agenda -->\n", "<!-- /agenda -->")


def render_agenda(text: str) -> str:
    """`text` with the block between the agenda markers replaced by the agenda that
    `kvlab.workbook.agenda` computes from the committed notebooks (their path words, the path's
    run time saved in each executed cell, exercises and predictions). A notebook with a cell not
    executed yet leaves the block as it was, with a warning: the test then says it is stale."""
    if AGENDA_MARKERS[0] not in text:
        return text
    from kvlab.workbook import agenda, chapters

    try:
        table = agenda.render_agenda(agenda.plan(
            {c.number: NOTEBOOKS / c.notebook for c in chapters.CHAPTERS}))
    except ValueError as e:
        print(f"agenda not rewritten: {e}", file=sys.stderr)
        return text
    start, end = (re.escape(m) for m in AGENDA_MARKERS)
    return re.sub(f"{start}.*?{end}", lambda _: f"{AGENDA_MARKERS[0]}{table}{AGENDA_MARKERS[1]}",
                  text, flags=re.S)


def write_reference(timings: dict) -> None:
    """The readiness check's reference (kvlab/workbook/ready.py): each chapter's path run time,
    its slot's slack and its kernel's peak, from the committed notebooks and timings."""
    from kvlab.workbook import chapters, ready

    try:
        ready.write_chapters_part({c.number: NOTEBOOKS / c.notebook for c in chapters.CHAPTERS},
                                  timings)
    except ValueError as e:
        print(f"kvlab/workbook/reference.json not rewritten: {e}", file=sys.stderr)


def render_docs(timings: dict, docs=DOCS) -> None:
    for doc in docs:
        if doc.exists():
            text = render_agenda(render(doc.read_text(encoding="utf-8"), timings))
            doc.write_text(text, encoding="utf-8")


def chapter_notebooks() -> list[Path]:
    """Every chapter's notebook, in order: the chapter index's (kvlab/workbook/chapters.py)."""
    from kvlab.workbook import chapters

    return chapters.notebook_paths(ROOT)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="default: every chapter (kvlab/workbook/chapters.py)")
    parser.add_argument("--timings", type=Path, default=TIMINGS,
                        help="where the wall times are kept (default: notebooks/timings.json)")
    parser.add_argument("--docs", type=Path, nargs="*", default=list(DOCS),
                        help="files whose 'minutes here' column is rewritten (default: README.md "
                             "notebooks/FACILITATOR.md; none: --docs with no file)")
    parser.add_argument("--render-only", action="store_true",
                        help="execute nothing: rewrite the docs from the timings file")
    parser.add_argument("--fold-only", action="store_true",
                        help="execute nothing: fold the saved outputs that answer a prediction")
    args = parser.parse_args(argv)
    if args.fold_only:
        import nbformat

        for path in args.notebooks or chapter_notebooks():
            nb = nbformat.read(path, as_version=4)
            fold_answers(nb)
            nbformat.write(nb, path)
        return
    timings = load_timings(args.timings)
    if not args.render_only and os.environ.get("KVLAB_SIZE", "full").strip().lower() != "full":
        parser.error(f"KVLAB_SIZE={os.environ['KVLAB_SIZE']!r}: the committed notebooks are the "
                     "full run; unset it (or set it to full) to execute them")
    if not args.render_only:
        for path in args.notebooks or chapter_notebooks():
            load = os.getloadavg()[0]
            seconds, peak_mib = execute(path)
            peak = "" if peak_mib is None else f", kernel peak {peak_mib / 1024:.1f} GB"
            print(f"{path}: executed in {seconds:.0f} s{peak} (load {load:.2f} before)",
                  flush=True)
            record(timings, path.stem, seconds, load, peak_mib)
            # Written after every notebook: an interrupted run keeps what it measured.
            args.timings.write_text(json.dumps(timings, indent=2) + "\n")
            render_docs(timings, args.docs)
    render_docs(timings, args.docs)
    if args.timings == TIMINGS:  # the committed timings, not a test's
        write_reference(timings)


if __name__ == "__main__":
    main(sys.argv[1:])

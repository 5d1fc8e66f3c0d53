"""The readiness check a participant runs the day before (kvlab/workbook/ready.py): its verdict
follows the measured threshold, and its reference is the committed notebooks' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.workbook import chapters, ready

ROOT = Path(__file__).resolve().parents[2]

REFERENCE = {"machine": "ref CPU", "decode_tok_s": 100.0,
             "chapters": {"00": {"path_run_s": 60.0, "peak_mib": 2000},
                          "01": {"path_run_s": 120.0, "peak_mib": 3000}},
             "sessions": {"Session 1": {"path_run_s": 60.0, "reserve_minutes": 2.0},
                          "Session 2": {"path_run_s": 120.0, "reserve_minutes": 1.0}}}


def score(rate):
    return {"decode_tok_s": rate, "decode_tok_s_runs": [rate] * 3, "load_s": 2.0}


def test_the_threshold_is_the_session_with_least_room_for_slower_cells():
    # Session 1: k <= 1 + 60 * 2 / 60 = 3; session 2: k <= 1 + 60 * 1 / 120 = 1.5 -> 100 / 1.5.
    rate, session = ready.threshold(REFERENCE)
    assert session == "Session 2" and rate == pytest.approx(100 / 1.5)


def test_each_session_reserve_is_three_hours_less_its_cold_read_minutes():
    from kvlab.workbook import agenda

    notebooks = {c.number: ROOT / "notebooks" / c.notebook for c in chapters.CHAPTERS}
    timings = json.loads((ROOT / "notebooks" / "timings.json").read_text())
    part = ready.chapters_part(notebooks, timings)
    for s in agenda.SESSIONS:
        cold = sum(agenda.COLD_READ_MINUTES[n] for n in s["chapters"])
        assert part["sessions"][s["name"]]["reserve_minutes"] == (
            agenda.SESSION_MINUTES - agenda.ARRIVAL_MINUTES - agenda.BREAK_MINUTES - cold) > 0


def test_verdict_ready_too_slow_and_short_of_memory():
    need = 3000 + ready.BROWSER_MIB
    ok, lines = ready.verdict(score(70.0), REFERENCE, need + 1)
    assert ok and lines[-1] == "READY"
    ok, lines = ready.verdict(score(60.0), REFERENCE, need + 1)
    assert not ok and any(line.startswith("TOO SLOW") for line in lines)
    assert "too slow below 67 tokens/s" in lines[1]
    ok, lines = ready.verdict(score(200.0), REFERENCE, need - 1)
    assert not ok and any(line.startswith("NOT ENOUGH MEMORY") for line in lines)
    ok, _ = ready.verdict(score(200.0), REFERENCE, None)  # memory unknown: not held against it
    assert ok


def test_the_committed_reference_is_the_committed_notebooks_own():
    ref = json.loads(ready.REFERENCE.read_text())
    timings = json.loads((ROOT / "notebooks" / "timings.json").read_text())
    notebooks = {c.number: ROOT / "notebooks" / c.notebook for c in chapters.CHAPTERS}
    expected = ready.chapters_part(notebooks, timings)
    assert {k: ref[k] for k in expected} == expected, (
        "stale: python scripts/execute_notebooks.py --render-only rewrites it")
    # The benchmark was recorded on the machine that executed the notebooks.
    assert ref["decode_tok_s"] > 0 and ref["benchmark_machine"] == timings["machine"]


def test_the_reference_ships_in_the_wheel():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"workbook/reference.json"' in text

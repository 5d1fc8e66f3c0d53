"""Every figure reads from the back of a room: no type under 9 points in kvlab's figures.

A static check of kvlab/workbook/viz: every `fontsize=` / `labelsize=` / `size=` given as a
number is at least 9, and none is a relative size below matplotlib's default ("small" and
smaller are under 9 points at the default 10). The explorer's own floor (10 points, checked in
the browser at 1280x720) is tests/workbook/test_explorer.py's and test_browser.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

VIZ = Path(__file__).resolve().parents[2] / "kvlab" / "workbook" / "viz"
NUMBER = re.compile(r"\b(?:fontsize|labelsize|title_fontsize)\s*=\s*([0-9.]+)")
RELATIVE = re.compile(r"\b(?:fontsize|labelsize|title_fontsize)\s*=\s*[\"'](xx-small|x-small|small)[\"']")
MIN_PT = 9


def too_small(source: str) -> list[str]:
    found = [m.group(0) for m in NUMBER.finditer(source) if float(m.group(1)) < MIN_PT]
    return found + [m.group(0) for m in RELATIVE.finditer(source)]


@pytest.mark.parametrize("path", sorted(VIZ.glob("*.py")), ids=lambda p: p.name)
def test_no_figure_type_under_nine_points(path):
    assert too_small(path.read_text()) == []


def test_the_check_catches_small_type_and_spares_nine_and_up():
    assert too_small('ax.legend(fontsize=8); ax.tick_params(labelsize="small")') == [
        "fontsize=8", 'labelsize="small"']
    assert too_small("ax.text(0, 0, 's', fontsize=9); ax.set_title('t', fontsize=FONT_PT)") == []

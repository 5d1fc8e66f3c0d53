"""Every number in a chapter's prose is printed by one of its cells, or is a cited figure.

A number typed into markdown goes stale when the workload changes (KVLAB_SIZE=small, a GPU, a
new default); a figure from elsewhere must say where it is from. So each number in a committed
chapter's markdown must appear in that chapter's saved outputs, in kvlab.workbook.cited's table (a
figure, its setup or where it sits in its source), or in the code right below the text (the
setup it describes, on screen beside it: edit one and the test asks for the other).

Not numbers in this sense: years, versions, arXiv ids, pull-request numbers, section numbers
(§7.2), HTTP status codes, chapter numbers (00-08), single digits (counts read off a picture:
"two blocks", "3 chunks"), the options of a prediction (after "Pick one:"), and what sits in
code spans, formulas and link targets.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab.workbook import chapters, cited

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = chapters.notebook_paths(ROOT)
# A number, with its thousands commas; "9.2x" counts, "Qwen3-1.7B" and "135M" (names) do not.
NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?![^\W\dx]|x\w|[.,]\d)")
NOT_NUMBERS = [
    r"`[^`]*`",  # code spans
    r"\$\$.*?\$\$|\$[^$]*\$",  # formulas
    r"\]\([^)]*\)",  # link targets
    r"\b\d+\.\d+\.\d+\b",  # versions
    r"\b\d{4}\.\d{4,5}\b",  # arXiv ids
    r"#\d+",  # pull requests
    r"\b(?:19[5-9]\d|20[0-3]\d)-\d\d(?:-\d\d)?\b",  # dates
    r"(?<![\d.,])0\d(?![\d]|[.,]\d)",  # chapter numbers
    r"HTTP \d{3}",  # status codes
    r"§\s*\d+(?:\.\d+)*",  # a paper's section numbers
    r"Pick one:.*?(?:\n\s*\n|$)",  # a prediction's options
]


def _canon(number: str) -> str:
    number = number.replace(",", "")
    return number[:-2] if number.endswith(".0") else number


def numbers_in(text: str) -> set[str]:
    return {_canon(m.group(1)) for m in NUMBER.finditer(text)}


def prose_numbers(markdown: str) -> set[str]:
    for pattern in NOT_NUMBERS:
        markdown = re.sub(pattern, " ", markdown, flags=re.S)
    found = numbers_in(markdown)
    is_year = re.compile(r"19[5-9]\d|20[0-3]\d")
    return {n for n in found if not (len(n) == 1 or is_year.fullmatch(n))}


def printed_numbers(nb: dict) -> set[str]:
    out = set()
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            texts = [output.get("text", "")]
            texts += [v for k, v in output.get("data", {}).items()
                      if k in ("text/plain", "text/html", "text/markdown")]
            for text in texts:
                out |= numbers_in("".join(text))
    return out


def cited_numbers() -> set[str]:
    out = set()
    for f in cited.FIGURES:
        values = f.value if isinstance(f.value, tuple) else (f.value,)
        out |= {_canon(f"{v:g}") for v in values} | {_canon(str(v)) for v in values}
        out |= numbers_in(f" {f.where} {f.setup} {f.hardware} ")
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem[:2] for p in CHAPTERS])
def test_every_number_in_the_prose_is_printed_or_cited(path):
    nb = json.loads(path.read_text())
    allowed = printed_numbers(nb) | cited_numbers()
    cells = nb["cells"]
    stray = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        below = set()
        for code in cells[index + 1:]:
            if code["cell_type"] != "code":
                break
            below |= numbers_in("".join(code["source"]))
        text = "".join(cell["source"])
        for number in sorted(prose_numbers(text) - allowed - below):
            stray.append(f"cell {index}: {number}")
    assert not stray, (f"{path.name}: numbers in the prose that no cell printed and "
                       f"kvlab.workbook.cited does not hold: {stray}")


def test_the_rules_catch_a_typed_number_and_spare_what_is_not_one():
    typed = "A 2,560-token pool holds 160 blocks of 16, and 1.5x more."
    assert prose_numbers(typed) == {"2560", "160", "16", "1.5"}
    spared = ("vLLM 0.33.0 (arXiv 2309.06180, #10980, §7.2), chapter 05, 2026-10-27, in 2023, "
              "`block_size=64`, $2 \\times 28$, [doc](https://x.org/v/12), 3 chunks.\n"
              "Pick one: `\"a\"` under 1.5x, `\"b\"` 1.5-5x.")
    assert prose_numbers(spared) == set()


def test_every_cited_figure_names_its_source_and_hardware():
    for f in cited.FIGURES:
        assert f.source and f.where and f.hardware, f.key
    assert cited.value("remeasure.default.c16.tok_s") == 1683.1
    with pytest.raises(KeyError, match="no cited figure"):
        cited.value("nowhere")


def test_show_prints_a_figure_with_its_source_where_and_hardware(capsys):
    cited.show("remeasure.default.c16.tok_s", "paged.kv_used_by_tokens")
    first, second = capsys.readouterr().out.splitlines()
    assert "1,683.1 tok/s" in first and "[Remeasure]" in first and "laptop GPU" in first
    assert "20.4-38.2 %" in second and "arXiv 2309.06180" in second and "A100" in second

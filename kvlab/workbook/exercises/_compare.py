"""`exercises.compare(name, impl)`: your code beside kvlab's chapter-sized answer, on demand.

It is what a participant asks for after an attempt (passed or not): every fast case run on
their code, each named with what it got wrong (unlike `check`, it does not stop at the first
failure), their source beside kvlab's answer, then one paragraph on what kvlab's full engine
adds to that answer and which chapter teaches it. Before an attempt (the stub still raises
NotImplementedError) it shows no answer: it says how to ask for one. Nothing here runs the
real model: `check` does that.
"""

from __future__ import annotations

import html
import inspect
import linecache
import re
from dataclasses import dataclass, field

from kvlab.workbook.exercises._common import Exercise
from kvlab.workbook.exercises._report import Failure, run_case


@dataclass
class Comparison:
    """What `compare` returns: prints as text, renders as two columns in a notebook."""

    name: str
    title: str
    yours: str  # the participant's source, or why it could not be read
    kvlabs: str  # kvlab's answer (what `exercises.solution` prints)
    passed: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    not_done: bool = False
    skipped: list[str] = field(default_factory=list)
    full_version: str = ""

    @property
    def same_behaviour(self) -> bool:
        return not self.failed and not self.not_done and bool(self.passed)

    def differences(self) -> list[str]:
        """What differs, in words: one line per failed case (or why nothing could run)."""
        if self.not_done:
            return ["yours still raises NotImplementedError: there is no behaviour to compare"]
        lines = []
        for f in self.failed:
            what = f"expected {f.expected}, got {f.got}" if f.expected else f.got
            lines.append(f"{f.case}: {what}".rstrip(": "))
        return lines

    def summary(self) -> str:
        total = len(self.passed) + len(self.failed)
        if self.same_behaviour:
            return (f"Same behaviour as kvlab's answer on all {total} fast cases "
                    "(the real-model run is exercises.check's).")
        if self.not_done:
            return "Not done yet: " + self.differences()[0] + "."
        return f"Differs from kvlab's answer on {len(self.failed)} of {total} fast cases:"

    def report(self) -> str:
        lines = [f"compare {self.name} ({self.title})", self.summary()]
        if self.not_done:  # no attempt yet: the answer stays hidden until one is asked for
            lines.append(f"  Write yours first; kvlab's answer alone: "
                         f"exercises.solution({self.name!r})")
            return "\n".join(lines)
        if not self.same_behaviour and not self.not_done:
            lines += [f"  ✘ {d}" for d in self.differences()]
        lines += [f"  – skipped: {s}" for s in self.skipped]
        lines += ["", "── yours ──", self.yours.rstrip(), "", "── kvlab's answer ──",
                  self.kvlabs.rstrip()]
        if self.full_version:
            lines += ["", "── what kvlab's full engine adds ──", self.full_version]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.report()

    __str__ = __repr__

    def _repr_html_(self) -> str:
        esc = html.escape
        if self.not_done:
            return f'<pre style="border-left: 4px solid #8a6d00; padding-left: 8px">' \
                   f"{esc(self.report())}</pre>"
        items = "".join(f"<li>{esc(d)}</li>" for d in self.differences()) \
            if not self.same_behaviour and not self.not_done else ""
        color = "#2e7d32" if self.same_behaviour else "#c62828"
        pre = ('<pre style="font-size: 12px; overflow-x: auto; margin: 0; padding: 6px; '
               'background: #f6f6f6">{}</pre>')
        return (f'<div style="border-left: 4px solid {color}; padding-left: 8px">'
                f"<b>compare {esc(self.name)}</b> ({esc(self.title)}): {esc(self.summary())}"
                f"<ul>{items}</ul>"
                '<table style="width: 100%; table-layout: fixed"><tr>'
                '<th style="text-align: left">yours</th>'
                "<th style=\"text-align: left\">kvlab's answer</th></tr><tr>"
                f'<td style="vertical-align: top">{pre.format(esc(self.yours))}</td>'
                f'<td style="vertical-align: top">{pre.format(esc(self.kvlabs))}</td>'
                "</tr></table>"
                + (f"<p><b>What kvlab's full engine adds:</b> {esc(self.full_version)}</p>"
                   if self.full_version else "")
                + "</div>")


def source_of(impl) -> str:
    """The participant's source (IPython keeps each cell's text, so a cell's function has one)."""
    try:
        return inspect.getsource(impl)
    except (OSError, TypeError) as e:
        if inspect.isclass(impl):
            found = _class_source_from_its_methods(impl)
            if found:
                return found
        return f"(the source of {impl!r} cannot be read here: {e})"


def _class_source_from_its_methods(cls) -> str | None:
    """A class defined in a notebook cell: before Python 3.13, inspect finds a class's source
    through its module's file, which a cell's `__main__` does not have. Its methods' code still
    names the cell (IPython registers each cell's text with linecache), so read the class from
    there."""
    header = re.compile(rf"^\s*class\s+{re.escape(cls.__name__)}\b")
    for member in vars(cls).values():
        code = getattr(getattr(member, "__func__", member), "__code__", None)
        if code is None:
            continue
        lines = linecache.getlines(code.co_filename)
        for i in range(min(code.co_firstlineno, len(lines)) - 1, -1, -1):
            if header.match(lines[i]):
                return "".join(inspect.getblock(lines[i:]))
    return None


def compare(ex: Exercise, impl) -> Comparison:
    """Run every fast case on `impl` (each on its own, none stops the others) and pair its
    source with kvlab's answer."""
    out = Comparison(ex.name, ex.title, source_of(impl), ex.solution_source(),
                     full_version=ex.full_version)
    if impl is None or not callable(impl):
        out.failed.append(Failure("what you passed to compare", f"your {ex.entry_point}",
                                  f"{type(impl).__name__} {impl!r}"))
        return out
    for case in ex.cases:
        if case.real_model:
            continue
        outcome, failure = run_case(case, impl)
        if outcome == "not_done":
            out.not_done = True
            break
        if outcome == "skipped":
            out.skipped.append(f"{case.name} ({failure.detail})")
        elif outcome == "failed":
            out.failed.append(failure)
        else:
            out.passed.append(case.name)
    return out

"""Run an exercise's cases on a participant's code and report, in a few lines, what happened.

The runner never lets the participant's code raise out of `check` (only KeyboardInterrupt
passes): an exception becomes the report's failure, with the traceback cut to the participant's
own frames. NotImplementedError means "not done yet", which is not an error. A case that runs
longer than its time limit (an endless loop) fails instead of hanging the notebook.
"""

from __future__ import annotations

import html
import signal
import sysconfig
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.workbook.exercises._outcomes import Mismatch, Skip

if TYPE_CHECKING:  # only a type here: _common imports this module to run a check
    from kvlab.workbook.exercises._common import Exercise

FAST_TIMEOUT_S = 20.0  # a case without the real model; past this it is an endless loop
REAL_TIMEOUT_S = 300.0  # a case that runs the real model

_KVLAB_DIR = str(Path(__file__).resolve().parents[1])
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                            "platlib")})


@dataclass
class Failure:
    case: str
    expected: str = ""
    got: str = ""
    detail: str = ""
    traceback: str = ""  # the participant's frames and the exception, when their code raised
    hint: str = ""


@dataclass
class CheckResult:
    """What `exercises.check` returns. Truthy only when every case that ran passed."""

    name: str
    title: str
    passed: list[str] = field(default_factory=list)
    failed: Failure | None = None
    not_done: bool = False
    skipped: list[str] = field(default_factory=list)  # "case (why)": not run, or could not judge
    notes: dict[str, str] = field(default_factory=dict)  # case -> what a passed case measured
    hint: str = ""
    seconds: float = 0.0

    def __bool__(self) -> bool:
        return self.failed is None and not self.not_done and bool(self.passed)

    def report(self) -> str:
        lines = []
        if self.not_done:
            lines.append(f"… {self.name} ({self.title}): not done yet. Your code still raises "
                         "NotImplementedError; write it, then run this cell again.")
            lines.append(f"  Stuck? exercises.hint({self.name!r})")
            return "\n".join(lines)
        if self:
            lines.append(f"✔ {self.name} ({self.title}): all {len(self.passed)} checks passed.")
        else:
            lines.append(f"✘ {self.name} ({self.title}): {len(self.passed)} checks passed, "
                         "then one failed.")
        for name in self.passed:
            lines.append(f"  ✔ {name}")
            if name in self.notes:
                lines += [f"      {line}" for line in self.notes[name].splitlines()]
        f = self.failed
        if f is not None:
            lines.append(f"  ✘ {f.case}")
            if f.expected:
                lines.append(f"      expected: {f.expected}")
            if f.got:
                lines.append(f"      got:      {f.got}")
            if f.detail:
                lines += [f"      {line}" for line in f.detail.splitlines()]
            if f.traceback:
                lines += [f"      {line}" for line in f.traceback.rstrip().splitlines()]
            lines.append(f"  Hint: {f.hint or self.hint}")
            lines.append(f"  More: exercises.hint({self.name!r}); kvlab's answer: "
                         f"exercises.solution({self.name!r})")
        lines += [f"  – skipped: {name}" for name in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return self.report()

    def _repr_html_(self) -> str:
        color = "#2e7d32" if self else ("#8a6d00" if self.not_done else "#c62828")
        return (f'<pre style="border-left: 4px solid {color}; padding-left: 8px">'
                f"{html.escape(self.report())}</pre>")


class CheckTimeout(BaseException):
    """Raised into the participant's code when a case runs past its limit. A BaseException, so
    that an `except Exception:` in their loop cannot swallow it."""


@contextmanager
def time_limit(seconds: float | None):
    """SIGALRM-based limit; only in the main thread, and only if no other timer is running."""
    usable = (seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise CheckTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _is_theirs(filename: str) -> bool:
    """Frames the participant wrote: not kvlab's, not the standard library's or a package's."""
    path = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    return not path.startswith(_KVLAB_DIR) and not path.startswith(_LIBRARY_DIRS)


def their_traceback(exc: BaseException) -> str:
    """The exception, with the traceback cut to the participant's frames."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_theirs(f.filename)]
    text = "Traceback (your code):\n" + "".join(traceback.format_list(frames)) if frames else ""
    return text + "".join(traceback.format_exception_only(type(exc), exc))


def unwrap(exc: BaseException) -> BaseException:
    """The participant's own exception inside kvlab's EngineStepError, if that is what it is."""
    from kvlab.engine import EngineStepError

    while isinstance(exc, EngineStepError) and exc.cause is not None:
        exc = exc.cause
    return exc


def run_case(case, impl, *, fast_timeout_s: float = FAST_TIMEOUT_S,
             real_timeout_s: float = REAL_TIMEOUT_S) -> tuple[str, Failure | None]:
    """One case on the participant's code: ("passed", None), ("failed", Failure),
    ("not_done", None) for NotImplementedError, or ("skipped", Failure whose detail says why).
    A case that returns a string (a challenge's measurement) passes with it as the Failure
    record's detail, so the report can print what was measured."""
    limit = case.timeout_s or (real_timeout_s if case.real_model else fast_timeout_s)
    try:
        with time_limit(limit):
            note = case.run(impl)
    except KeyboardInterrupt:
        raise
    except BaseException as raw:  # noqa: BLE001 - nothing the participant does may escape
        exc = unwrap(raw)
        if isinstance(exc, Skip):
            return "skipped", Failure(case.name, detail=str(exc))
        if isinstance(exc, NotImplementedError):
            return "not_done", None
        if isinstance(exc, Mismatch):
            return "failed", Failure(case.name, exc.expected, exc.got, exc.detail, hint=case.hint)
        if isinstance(exc, CheckTimeout):
            return "failed", Failure(case.name, f"an answer within {limit:g} s",
                                     "no answer: is there an endless loop?",
                                     traceback=their_traceback(exc), hint=case.hint)
        return "failed", Failure(case.name, "", f"your code raised {type(exc).__name__}",
                                 traceback=their_traceback(exc), hint=case.hint)
    return "passed", (Failure(case.name, detail=note) if isinstance(note, str) else None)


def run_check(ex: Exercise, impl, *, real_model: bool = True,
              fast_timeout_s: float = FAST_TIMEOUT_S,
              real_timeout_s: float = REAL_TIMEOUT_S) -> CheckResult:
    """Run the cases in order and stop at the first failure."""
    start = time.perf_counter()
    result = CheckResult(ex.name, ex.title, hint=ex.hint)
    if impl is None or not callable(impl):
        result.failed = Failure("what you passed to check", f"your {ex.entry_point}",
                                f"{type(impl).__name__} {impl!r}",
                                hint=f"pass the function or class itself: "
                                     f"exercises.check({ex.name!r}, {ex.entry_point})")
        return result
    for case in ex.cases:
        if case.real_model and not real_model:
            result.skipped.append(f"{case.name} (real_model=False)")
            continue
        outcome, failure = run_case(case, impl, fast_timeout_s=fast_timeout_s,
                                    real_timeout_s=real_timeout_s)
        if outcome == "skipped":
            result.skipped.append(f"{case.name} ({failure.detail})")
            continue
        if outcome == "not_done":
            result.not_done = True
            break
        if outcome == "failed":
            result.failed = failure
            break
        result.passed.append(case.name)
        if failure is not None:
            result.notes[case.name] = failure.detail
    result.seconds = time.perf_counter() - start
    return result

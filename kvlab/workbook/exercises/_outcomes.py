"""How a case says it did not pass: the behaviour was wrong (`Mismatch`), or nobody can be judged
here (`Skip`). Apart from `_common` so that the runner (`_report`) and the exercises both raise and
catch them without importing each other."""

from __future__ import annotations


class Mismatch(Exception):
    """A case saw the wrong behaviour. `expected` and `got` are short phrases."""

    def __init__(self, expected: str, got: str, detail: str = "") -> None:
        super().__init__(f"expected {expected}, got {got}")
        self.expected = expected
        self.got = got
        self.detail = detail


class Skip(Exception):
    """A case that cannot judge anyone here (e.g. timings too noisy on this machine)."""

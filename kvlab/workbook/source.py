"""Print kvlab's own source in a notebook, so a chapter shows the code it runs."""

from __future__ import annotations

import inspect


def show_source(obj) -> None:
    """Print the source of a kvlab function or class.

    Printing the live source (rather than a copy pasted into the notebook) keeps the notebook
    and the package from drifting apart.
    """
    print(inspect.getsource(obj).rstrip())

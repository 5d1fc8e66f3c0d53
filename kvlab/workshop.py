"""The workshop's one size setting: `KVLAB_SIZE=small` runs the long sweeps smaller.

Introduced in the Setup section of every notebook; the long measurements of chapters 02-07 pick
their sizes through `sized`. The default is `full`, and the committed notebooks are the full run.
A participant on a slow laptop sets it in a cell (`%env KVLAB_SIZE=small`) or before starting
JupyterLab (`KVLAB_SIZE=small make lab`).
"""

from __future__ import annotations

import os
from typing import TypeVar

ENV_VAR = "KVLAB_SIZE"
SIZES = ("full", "small")

T = TypeVar("T")


def size() -> str:
    """The current size, "full" or "small", read from KVLAB_SIZE (unset or empty: "full").

    Read at every call, not at import, so `%env KVLAB_SIZE=small` in a running kernel takes
    effect in the next cell without a restart.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower() or "full"
    if value not in SIZES:
        # A typo must not silently run the full 10-minute version on a slow laptop.
        raise ValueError(f"{ENV_VAR} must be one of {SIZES}, got {value!r}")
    return value


def sized(full: T, small: T) -> T:
    """`full`, or `small` when KVLAB_SIZE=small: one sweep's size, both values in the cell."""
    return small if size() == "small" else full

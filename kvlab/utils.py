"""Small helpers the notebooks call: seeding and showing kvlab's own source."""

from __future__ import annotations

import inspect
import random

import numpy as np
import torch


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch, so a notebook's random choices repeat run after run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def show(obj) -> None:
    """Print the source of a kvlab function or class, so a notebook shows the code it runs.

    Printing the live source (rather than a copy pasted into the notebook) keeps the notebook
    and the package from drifting apart.
    """
    print(inspect.getsource(obj).rstrip())

"""Seeding: one call that makes a run's random choices repeat."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch, so a notebook's random choices repeat run after run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

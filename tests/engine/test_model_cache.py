"""The packaged model's first load is safe when a room starts several kernels at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import sys
from safetensors import safe_open
from kvlab.model import packaged_model_folder
folder = packaged_model_folder()
with safe_open(str(folder / "model.safetensors"), "pt") as f:  # complete and readable
    assert "model.embed_tokens.weight" in set(f.keys())
print(folder)
"""


@pytest.mark.slow
def test_three_first_loads_at_once_all_succeed(tmp_path):
    """Three processes converting the GGUF into one empty KVLAB_CACHE: before the lock, each
    replaced the folder another had just finished, and one failed to load it."""
    env = {**os.environ, "KVLAB_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0, err[-2000:]
    folders = {Path(out.strip().splitlines()[-1]) for out, _, _ in results}
    assert len(folders) == 1
    # One complete folder, no temporary folder left behind.
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [
        folders.pop().name]

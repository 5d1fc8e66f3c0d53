"""Execute notebooks top to bottom on this machine and save them clean (what is committed).

    python scripts/execute_notebooks.py notebooks/*.ipynb      (or: make execute)

Clean means: kernel name python3, execution counts kept, `metadata.widgets` removed (GitHub
refuses to render a notebook whose widget metadata carries no state).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, path)
    print(f"{path}: executed in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        execute(Path(arg))

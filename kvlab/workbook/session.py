"""The workshop's one size setting: `KVLAB_SIZE=small` runs the long sweeps smaller.

Introduced in the Setup section of every notebook; the long measurements of chapters 03-07 pick
their sizes through `sized`. The default is `full`, and the committed notebooks are the full run.
A participant on a slow laptop sets it in a cell (`%env KVLAB_SIZE=small`) or before starting
JupyterLab (`KVLAB_SIZE=small make lab`).

And the end of a chapter: `release(globals())` frees what its kernel holds (engines, servers,
widgets, the loaded weights), so that a laptop has the memory for the next chapter.
"""

from __future__ import annotations

import os
import sys
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


def proc_mib(path: str, field: str) -> float | None:
    """A `field: N kB` line of a Linux /proc file, in MiB; None where there is no such file."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux: /proc; elsewhere psutil when installed)."""
    mib = proc_mib("/proc/self/status", "VmRSS")
    if mib is not None:
        return mib
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / 2**20


def release(namespace: dict) -> dict:
    """End a chapter: free what its kernel holds, so that the next chapter has the memory.

    A notebook's last cell calls `release(globals())`. It stops every running
    `BackgroundServer` of this process, closes every widget (a widget's callbacks keep its
    engine alive), empties IPython's output history (it keeps every displayed value alive),
    deletes every name in `namespace` whose value leads to the model's weights (an engine, a
    dict of engines, an explorer, a loaded model), and forgets the weights this process loaded.
    Names that hold none of it (results, tokenizers, your own functions) stay. The kernel
    stays usable: the next `LLM()` loads the weights again. Returns what it deleted, the
    resident memory before and after in MiB (None where this system does not say), and how
    many loaded models something still holds (0 when the chapter let go of everything)."""
    import gc

    from kvlab.model import forget_loaded_models, loaded_weights
    from kvlab.serve import BackgroundServer

    before = resident_mib()
    BackgroundServer.stop_all()
    widgets = sys.modules.get("ipywidgets")
    if widgets is not None:  # only if the chapter imported them: nothing to close otherwise
        widgets.Widget.close_all()
    shell = _ipython_shell(namespace)
    if shell is not None and shell.displayhook.do_full_cache:
        # IPython's own reset of its output history: Out, _N (also in its hidden namespace)
        # and the display hook's _, __, ___, each of which keeps a displayed value alive.
        shell.displayhook.flush()
    hidden = [] if shell is None else [shell.user_ns_hidden]
    for names in (namespace, *hidden):  # the same for a plain namespace, and whatever is left
        for name in list(names):
            if name in ("_", "__", "___") or (name[:1] == "_" and name[1:].isdigit()):
                del names[name]
    for history in (namespace.get("Out"), namespace.get("_oh")):
        if isinstance(history, dict):
            history.clear()
    targets = {id(w) for w in loaded_weights()}
    # Not followed: modules and their dicts, the namespace itself (a function refers to its
    # globals: every function would lead everywhere) and IPython's shell (its `exit`,
    # `get_ipython` and the like lead to all of it). Built once for all the names.
    stop = {id(namespace), id(sys.modules)}
    stop |= {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    if shell is not None:
        stop.add(id(shell))
    deleted, safe = [], set()
    for name, value in list(namespace.items()):
        if not name.startswith("_") and _leads_to(value, targets, safe, stop):
            del namespace[name]
            deleted.append(name)
    value = None  # the loop's last value would otherwise keep what it leads to alive
    forget_loaded_models()
    gc.collect()
    _return_freed_heap()
    after = resident_mib()
    memory = ("" if before is None or after is None else
              f": resident memory {before:,.0f} MiB before, {after:,.0f} MiB after")
    return {"deleted": deleted, "rss_before_mib": before, "rss_after_mib": after,
            "summary": f"released {', '.join(deleted) or 'nothing'}{memory}",
            "weights_held": len(loaded_weights())}


def _leads_to(value, targets: set[int], safe: set[int], stop: set[int]) -> bool:
    """Whether the objects `value` refers to, followed all the way, include one of `targets`.

    Neither `stop` (ids) nor classes and modules are followed. `safe` collects objects already
    searched to the end without a hit, so later names skip them."""
    import gc
    import types

    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        key = id(obj)
        if key in targets:
            return True
        if key in seen or key in safe or key in stop or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(key)
        stack.extend(gc.get_referents(obj))
    safe |= seen
    return False


def _ipython_shell(namespace: dict):
    """The IPython shell whose namespace this is, or None (a script, a test's dict)."""
    get_ipython = namespace.get("get_ipython")
    shell = getattr(get_ipython, "__self__", None)
    return shell if shell is not None and getattr(shell, "user_ns", None) is namespace else None


def _return_freed_heap() -> None:
    """glibc keeps freed heap pages for reuse; give them back so the resident size says what
    is still held (no-op on other C libraries)."""
    from kvlab.model import libc

    malloc_trim = getattr(libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)

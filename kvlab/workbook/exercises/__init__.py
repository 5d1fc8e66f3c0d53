"""The build track: in each chapter you write the mechanism, and kvlab checks it on the real engine.

    from kvlab.workbook import exercises
    exercises.check("block_pool", TinyBlockPool)   # behaviour tests, then the real model
    exercises.hint("block_pool")                   # a nudge
    exercises.compare("block_pool", TinyBlockPool) # after your attempt: yours beside kvlab's
    exercises.solution("block_pool")               # kvlab's answer, printed

A check first runs fast cases (small hand-made examples, then seeded random ones compared with
kvlab's own code), then plugs your code into a fresh small engine on the real model: the tokens
must equal kvlab's own and the bookkeeping must hold (no leaked block, consistent ref counts). It
reports what passed, the first failing case in words, and a hint. It never raises on wrong code:
if your code raises, the report shows your traceback.

Exercises, by chapter:
    00 decode_attention    attention of one decode token over its request's KV cache
    01 block_pool          the pool of blocks: handing them out and taking them back
    01 allocate_slots      how many blocks a request needs now
    01 paged_attention     the same attention, through the block table
    02 copy_on_write       what a sequence does before it writes into blocks it may share
    03 schedule            one scheduling step when memory runs short
    04 chunked_prefill     each request's share of the token budget
    05 block_hashes        the keys of a prompt's blocks, with a tenant's salt
    05 longest_cache_hit   how much of a prompt the prefix cache can serve
    06 timing_attack       read a cache hit off the clock
    08 quantize_int8       K/V stored in int8, and read back
    09 window_blocks       what a sliding-window group gives back while a request runs
    10 tier_hit            how many of a waiting request's tokens the second tier can load

Challenges (kind "challenge": a decision, measured on the real model against the best one):
    01 kv_pool_size        the smallest KV pool for a burst, contiguous and paged
    02 fork_pool_size      the smallest KV pool for n forked samples
    03 max_num_seqs        the concurrency limit for a KV budget
    04 chunk_budget        the token budget that keeps a decode's worst gap under a target
    06 salt_scheme         the salt a server attaches, so that a stolen salt opens nothing
    07 tuning_lab          the settings that keep a workload within a latency SLO (goodput)
    08 kv_precision        a kv_cache_dtype and a pool in bytes for a burst, within a KL bound
    09 hybrid_pool         the bytes a burst needs on a model with sliding-window layers
    10 tier_size           the smallest second tier that keeps tenants' documents between turns

Which chapter holds which exercise, and the module that defines it (chNN_*.py here, one per
build or challenge topic), is the chapter index's to say: kvlab/workbook/chapters.py.
"""

from __future__ import annotations

import importlib

from kvlab.workbook import chapters
from kvlab.workbook.exercises._common import Case, Exercise, IdPool, Mismatch, RequestView
from kvlab.workbook.exercises._compare import Comparison
from kvlab.workbook.exercises._report import CheckResult


def _registry() -> dict[str, Exercise]:
    """Every exercise the chapter index (kvlab/workbook/chapters.py) lists, in chapter order,
    each taken from the module the index names for it."""
    registry: dict[str, Exercise] = {}
    for chapter in chapters.chapters():
        for kind, modules in (("build", chapter.builds), ("challenge", chapter.challenges)):
            for module, names in modules.items():
                defined = {ex.name: ex for ex in
                           importlib.import_module(f"{__name__}.{module}").EXERCISES}
                for name in names:
                    ex = defined.get(name)
                    # The index and the modules must agree, or a notebook's check would be
                    # missing or silently another one: say which entry is wrong, at import.
                    if ex is None or ex.kind != kind or ex.chapter != chapter.stem:
                        raise ImportError(
                            f"kvlab/workbook/chapters.py lists {kind} {name!r} of chapter "
                            f"{chapter.number} in {module}.py, which defines "
                            f"{[(e.name, e.kind, e.chapter) for e in defined.values()]}")
                    registry[name] = ex
    return registry


EXERCISES: dict[str, Exercise] = _registry()


def _get(name: str) -> Exercise:
    try:
        return EXERCISES[name]
    except KeyError:
        raise KeyError(f"no exercise {name!r}; the exercises are {sorted(EXERCISES)}") from None


def check(name: str, impl, *, real_model: bool = True) -> CheckResult:
    """Run exercise `name`'s checks on your function or class; returns a printable result,
    truthy only when every check passed. `real_model=False` skips the real-model run."""
    return _get(name).check(impl, real_model=real_model)


def hint(name: str) -> None:
    """Print a hint for exercise `name`."""
    print(_get(name).hint)


def compare(name: str, impl) -> Comparison:
    """Your code beside kvlab's chapter-sized answer, after you tried: every fast case run on
    yours (each failure named), both sources, and what kvlab's full engine adds, and where."""
    from kvlab.workbook.exercises._compare import compare as _compare

    return _compare(_get(name), impl)


def solution(name: str) -> None:
    """Print kvlab's answer (with the imports it needs): paste it into a cell and it runs."""
    print(_get(name).solution_source())


def stub(name: str) -> str:
    """The source you start from (what the notebook's 'your turn' cell holds)."""
    return _get(name).stub


def by_chapter(chapter: str) -> list[Exercise]:
    """The exercises of one notebook, by its file stem ("03_continuous_batching")."""
    return [ex for ex in EXERCISES.values() if ex.chapter == chapter]


__all__ = ["EXERCISES", "Exercise", "Case", "CheckResult", "Comparison", "IdPool", "Mismatch",
           "RequestView", "check", "compare", "hint", "solution", "stub", "by_chapter"]

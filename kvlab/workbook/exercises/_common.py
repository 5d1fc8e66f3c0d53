"""What every exercise shares: the `Exercise` record, a check `Case`, and the small views a
participant's code is handed (`IdPool`, `RequestView`).

A case runs the participant's code and raises `Mismatch` (what was expected, what came back, in
words) when the behaviour is wrong. Cases look only at behaviour: what a function returns, what a
pool holds afterwards, which tokens the real engine produces. Never at names or private state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from kvlab.block_pool import BlockPool
from kvlab.kv_cache import cdiv  # noqa: F401  (the exercises import it from here)
from kvlab.workbook.exercises._outcomes import Mismatch, Skip  # noqa: F401  (the exercises import both from here)


def positive_int(value, expected: str = "an int >= 1") -> int:
    """A participant's number (not a bool, not a float, at least 1), or a Mismatch saying so."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Mismatch(expected, repr(value))
    return value


@dataclass
class Case:
    """One behaviour test. `name` says, in words, what is being checked."""

    name: str
    run: Callable[[object], None]
    hint: str = ""  # why the rule holds, shown when this case fails
    real_model: bool = False  # runs the real model (skipped by check(..., real_model=False))
    timeout_s: float | None = None  # None: the runner's default


@dataclass
class Exercise:
    """One 'your turn' cell: what to write, how it is checked, and kvlab's answer."""

    name: str
    chapter: str  # the notebook's file stem, e.g. "01_contiguous_vs_paged"
    title: str
    prompt: str  # 2-4 sentences of instructions
    stub: str  # the source the participant starts from (imports, signature, docstring)
    hint: str
    solution: object  # the reference: a top-level function or class
    cases: list[Case] = field(default_factory=list, repr=False)
    imports: str = ""  # the import lines the solution (and the stub) need
    # What kvlab's engine does beyond this chapter-sized answer, and which chapter teaches it:
    # the paragraph `exercises.compare` ends with.
    full_version: str = ""
    # "build": write a mechanism; "challenge": choose a setting, which the check measures.
    kind: str = "build"

    @property
    def entry_point(self) -> str:
        """The name the stub and the solution define."""
        return self.solution.__name__

    def solution_source(self) -> str:
        """What `solution(name)` prints: the imports, then the reference's own source."""
        source = inspect.getsource(self.solution).rstrip()
        return f"{self.imports.strip()}\n\n\n{source}\n" if self.imports.strip() else source + "\n"

    def check(self, impl, *, real_model: bool = True):
        from kvlab.workbook.exercises._report import run_check

        return run_check(self, impl, real_model=real_model)


class IdPool:
    """kvlab's `BlockPool` seen through block ids: what the exercises of chapters 01-02 receive.

    pool.get_num_free_blocks()   -> int
    pool.get_new_blocks(n)       -> list of n block ids, from the head of the free queue
    pool.free_blocks(block_ids)  drop one reference each (a block at 0 joins the queue's tail)
    pool.touch(block_ids)        add one reference each (a free block leaves the queue)
    pool.ref_cnt(block_id)       -> how many block tables hold this block
    """

    def __init__(self, pool: BlockPool | int) -> None:
        # A count: a plain pool of that many blocks, no null block (the exercise is the data
        # structure); an engine's pool keeps its block 0 out of reach.
        self.block_pool = (pool if isinstance(pool, BlockPool)
                           else BlockPool(pool, null_block=False))

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"get_new_blocks needs a count >= 0, got {num_blocks!r}")
        return [blk.block_id for blk in self.block_pool.get_new_blocks(num_blocks)]

    def free_blocks(self, block_ids) -> None:
        self.block_pool.free_blocks(self._blocks(block_ids))

    def touch(self, block_ids) -> None:
        self.block_pool.touch(self._blocks(block_ids))

    def ref_cnt(self, block_id: int) -> int:
        return self._blocks([block_id])[0].ref_cnt

    def free_block_ids(self) -> list[int]:
        """The free queue, head first (for checks and pictures)."""
        return list(self.block_pool.free_queue)

    def _blocks(self, block_ids):
        out = []
        for i in list(block_ids):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_blocks:
                raise ValueError(f"no block {i!r} in a pool of {self.num_blocks} blocks")
            out.append(self.block_pool.blocks[i])
        return out

    def __repr__(self) -> str:
        refs = {b.block_id: b.ref_cnt for b in self.block_pool.blocks if b.ref_cnt}
        return f"IdPool(free queue {self.free_block_ids()}, ref_cnt {refs})"


@dataclass(frozen=True)
class RequestView:
    """What the scheduling exercises (03-04) see of one request."""

    request_id: str
    num_tokens: int  # prompt + generated so far
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_blocks: int = 0  # blocks its block table holds now


def short(value, limit: int = 120) -> str:
    """repr, cut to one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

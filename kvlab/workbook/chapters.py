"""The one index of the workbook's chapters: what each one is made of, in one place.

A chapter is a notebook in notebooks/, the exercises (builds and challenges) it asks for and the
modules of `kvlab.workbook.exercises` that define them, the modules of `kvlab.workbook.viz` its
figures come from, and its entries in `python -m kvlab.bench`: subcommands, and the names of
`reproduce` experiments (in process, and through an API with `--base-url`). Everything else
that needs the list of chapters reads it from here: the exercise registry, the scripts that
execute and solve the notebooks, and the tests (tests/project/test_chapters.py holds this index
to the files it names). docs/adding_a_chapter.md says how to add one.

    from kvlab.workbook import chapters
    chapters.by_number("03").notebook    # "03_continuous_batching.ipynb"
    [c.number for c in chapters.with_exercises()]   # what `make solved` covers
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Chapter:
    number: str  # "03": the notebook's prefix, and the chapter of its bench experiments
    notebook: str  # its file in notebooks/
    # Module of kvlab.workbook.exercises -> the names of the exercises it defines: the
    # "Your turn" cells (kind "build") and the "Challenge" cells (kind "challenge").
    builds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    challenges: dict[str, tuple[str, ...]] = field(default_factory=dict)
    figures: tuple[str, ...] = ()  # modules of kvlab.workbook.viz its figures come from
    bench: tuple[str, ...] = ()  # `python -m kvlab.bench COMMAND` subcommands
    reproduce: tuple[str, ...] = ()  # `python -m kvlab.bench reproduce NAME`
    reproduce_api: tuple[str, ...] = ()  # `python -m kvlab.bench reproduce --base-url URL NAME`

    @property
    def stem(self) -> str:
        """The notebook's name without .ipynb: what `Exercise.chapter` holds."""
        return self.notebook.removesuffix(".ipynb")

    @property
    def exercises(self) -> tuple[str, ...]:
        """Every exercise's name, the builds first, as `exercises.EXERCISES` orders them."""
        return tuple(name for group in (self.builds, self.challenges)
                     for names in group.values() for name in names)

    @property
    def exercise_modules(self) -> tuple[str, ...]:
        """The modules of kvlab.workbook.exercises that define this chapter's exercises."""
        return tuple(dict.fromkeys([*self.builds, *self.challenges]))

    @property
    def solved(self) -> bool:
        """Whether `make solved` (scripts/solved_notebooks.py) makes an instructor's copy: a
        chapter with exercises has one, every stub replaced by its answer."""
        return bool(self.exercises)


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00", "00_the_model_and_its_kv_cache.ipynb",
            builds={"ch00_attention": ("decode_attention",)},
            figures=("memory_plots",)),
    Chapter("01", "01_contiguous_vs_paged.ipynb",
            builds={"ch01_block_pool": ("block_pool", "allocate_slots"),
                    "ch01_paged_attention": ("paged_attention",)},
            challenges={"ch01_kv_pool_size": ("kv_pool_size",)},
            figures=("memory_plots", "snapshot"),
            reproduce=("paged-admission",)),
    Chapter("02", "02_copy_on_write.ipynb",
            builds={"ch02_copy_on_write": ("copy_on_write",)},
            challenges={"ch02_fork_pool_size": ("fork_pool_size",)},
            figures=("memory_plots", "snapshot"),
            bench=("cow",), reproduce=("cow",)),
    Chapter("03", "03_continuous_batching.ipynb",
            builds={"ch03_scheduling": ("schedule",)},
            challenges={"ch03_max_num_seqs": ("max_num_seqs",)},
            figures=("scheduling_plots", "snapshot"),
            bench=("sched",), reproduce=("continuous-batching", "kv-capacity"),
            reproduce_api=("concurrency",)),
    Chapter("04", "04_chunked_prefill.ipynb",
            builds={"ch04_chunked_prefill": ("chunked_prefill",)},
            challenges={"ch04_chunk_budget": ("chunk_budget",)},
            figures=("scheduling_plots", "snapshot"),
            bench=("sched",), reproduce=("chunked-prefill",),
            reproduce_api=("generation-stall",)),
    Chapter("05", "05_prefix_caching.ipynb",
            builds={"ch05_prefix_caching": ("block_hashes", "longest_cache_hit")},
            figures=("prefix_plots", "snapshot"),
            bench=("prefix",), reproduce=("prefix-cache",), reproduce_api=("prefix-cache",)),
    Chapter("06", "06_cache_salt.ipynb",
            builds={"ch06_cache_salt": ("timing_attack",)},
            challenges={"ch06_salt_scheme": ("salt_scheme",)},
            figures=("prefix_plots",),
            bench=("prefix",), reproduce=("cache-salt",), reproduce_api=("cache-salt",)),
    Chapter("07", "07_capstone.ipynb",
            challenges={"ch07_tuning_lab": ("tuning_lab",)},
            figures=("bench_plots",),
            bench=("reproduce", "speed", "peers", "roofline", "serve-peers", "client")),
    Chapter("08", "08_kv_precision.ipynb",
            builds={"ch08_kv_precision": ("quantize_int8",)},
            challenges={"ch08_kv_precision": ("kv_precision",)},
            figures=("precision_plots",),
            bench=("kv-dtype", "weights-dtype")),
    Chapter("09", "09_sliding_window.ipynb",
            builds={"ch09_sliding_window": ("window_blocks",)},
            challenges={"ch09_hybrid_pool": ("hybrid_pool",)},
            figures=("hybrid_plots",)),
    Chapter("10", "10_offloading.ipynb",
            builds={"ch10_offloading": ("tier_hit",)},
            challenges={"ch10_tier_size": ("tier_size",)},
            figures=("offload_plots",)),
)


def chapters() -> tuple[Chapter, ...]:
    """Every chapter, in order."""
    return CHAPTERS


def by_number(number: str | int) -> Chapter:
    """The chapter numbered `number` ("03", or 3)."""
    key = f"{number:02d}" if isinstance(number, int) else number
    for chapter in CHAPTERS:
        if chapter.number == key:
            return chapter
    raise KeyError(f"no chapter {number!r}; the chapters are {[c.number for c in CHAPTERS]}")


def by_stem(stem: str) -> Chapter:
    """The chapter whose notebook is `stem`.ipynb ("03_continuous_batching")."""
    for chapter in CHAPTERS:
        if chapter.stem == stem:
            return chapter
    raise KeyError(f"no chapter {stem!r}; the chapters are {[c.stem for c in CHAPTERS]}")


def with_exercises() -> tuple[Chapter, ...]:
    """The chapters that ask for exercises: those `make solved` makes an instructor's copy of."""
    return tuple(c for c in CHAPTERS if c.solved)


def notebook_paths(root: Path | str, among: tuple[Chapter, ...] | None = None) -> list[Path]:
    """The notebooks of `among` (default: every chapter), in order, under the repository `root`."""
    return [Path(root) / "notebooks" / c.notebook for c in (CHAPTERS if among is None else among)]

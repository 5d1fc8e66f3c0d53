"""Everything that exists for the workbook's chapters, on top of the engine and the benchmarks.

    chapters.py        the one index of chapters: notebook, exercises, figures, bench entry
    exercises/         the build track: stubs, checks, comparisons, challenges
    viz/               every figure, as pure functions of numbers or an engine snapshot
    explorer.py        the engine explorer's data: a snapshot of a stepping engine
    widgets.py         ipywidgets sliders and the explorer's buttons over viz/ and explorer.py
    allocator_sim.py   chapter 01's model-free allocator simulation
    cited.py           the one table of figures the chapters cite from elsewhere
    session.py         the workshop's size setting (KVLAB_SIZE) and a chapter's release()
    source.py          show_source(): print the live source of a kvlab function

Nothing here is imported by the engine (`kvlab/*.py`); a test holds it to that.
"""

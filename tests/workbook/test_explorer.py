"""The engine explorer: snapshots of a real engine say what the pool, the queues and the step's
SchedulerOutput say; the picture is drawn from a snapshot alone; every widget draws as ordinary
cell outputs that its controls redraw in place."""

from __future__ import annotations

from dataclasses import replace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from tests.helpers import assert_no_blocks_held  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.workbook import widgets
from kvlab.workbook.explorer import (  # noqa: E402
    CACHED, FREE, HELD, NULL, SHARED, BlockView, EngineExplorer, EngineSnapshot, RequestView,
    snapshot,
)
from kvlab.workbook.viz import COPY_EDGE, SHARED_COLOUR, draw_snapshot, format_queues  # noqa: E402


def assert_matches_engine(snap: EngineSnapshot, llm) -> None:
    """Every block, table and queue in the snapshot is what the engine holds now."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    for view, blk in zip(snap.blocks, kv.block_pool.blocks, strict=True):
        assert view.ref_cnt == blk.ref_cnt, view
        assert (view.key is not None) == (blk.block_hash is not None), view
        holders = {rid for rid, blocks in kv.req_to_blocks.items() if blk in blocks}
        assert set(view.owners) == holders and len(view.owners) == blk.ref_cnt, view
    assert snap.count(FREE) + snap.count(CACHED) == kv.block_pool.get_num_free_blocks()
    assert snap.block_tables == engine.block_tables()
    assert snap.running == [r.request_id for r in engine.scheduler.running]
    assert snap.waiting == [r.request_id for r in engine.scheduler.waiting]
    assert snap.step == engine.num_steps


def kinds(snap: EngineSnapshot) -> list[tuple[str, str | None]]:
    return [(e.kind, e.request_id) for e in snap.events]


def test_blocks_queues_and_budget_follow_the_engine_step_by_step(text_ids):
    # 16 usable blocks of 4 slots (1..16; block 0 is vLLM's null block); a 16-token budget, so
    # the second prompt is chunked. A cold engine: the finished requests' blocks end up free,
    # not cached (chapter 05's prefix caching is vLLM's default, off here).
    llm = LLM(block_size=4, kv_cache_tokens=64, max_model_len=64, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    ex = EngineExplorer(llm, max_tokens=4)
    ex.add_request(text_ids[:10])
    snap = ex.add_request(text_ids[20:32])
    assert snap.waiting == ["r0", "r1"] and snap.running == [] and snap.count(FREE) == 16
    assert kinds(snap) == [("added", "r1")] and "12 prompt tokens" in snap.events[0].detail
    assert_matches_engine(snap, llm)

    snap = ex.step()  # r0's 10 prompt tokens, then 6 of r1's 12: the budget is spent
    sched = llm.llm_engine.last_scheduler_output
    assert [(r.request_id, n) for r, n in sched.scheduled] == [("r0", 10), ("r1", 6)]
    assert (snap.num_decode_tokens, snap.num_prefill_tokens, snap.token_budget) == (0, 16, 16)
    assert kinds(snap) == [("admitted", "r0"), ("admitted", "r1")]
    assert snap.block_tables == {"r0": [1, 2, 3], "r1": [4, 5]} and snap.count(HELD) == 5
    assert snap.blocks[0].state == NULL and snap.count(NULL) == 1
    assert [b.num_filled for b in snap.blocks[1:6]] == [4, 4, 2, 4, 2]
    assert_matches_engine(snap, llm)
    assert "running (2): r0 [10/11 tokens in KV, 1/4 out], r1 [6/12" in format_queues(snap)

    snap = ex.step()  # r0 decodes one token, r1 finishes its prompt (6 tokens)
    record = llm.llm_engine.step_trace[-1]  # the engine's own record of the step
    assert (snap.num_decode_tokens, snap.num_prefill_tokens) == (1, 6)
    assert (record.num_decode_tokens, record.num_prefill_tokens) == (1, 6)
    assert snap.events == []  # both were running already: no admission
    assert_matches_engine(snap, llm)

    snap = ex.run_to_end()
    assert {rid for kind, rid in kinds(snap) if kind == "finished"} == {"r0", "r1"}
    assert snap.running == snap.waiting == [] and snap.count(FREE) == 16
    assert_no_blocks_held(llm)


def test_steps_taken_outside_the_explorer_are_not_pinned_on_the_next_one(text_ids):
    llm = LLM(block_size=4, kv_cache_tokens=64, max_model_len=64)
    ex = EngineExplorer(llm, max_tokens=6)
    ex.add_request(text_ids[:10])
    ex.add_request(text_ids[20:30])
    llm.llm_engine.step()  # admits both, outside the explorer
    llm.llm_engine.step()
    snap = ex.step()
    # Admissions come from each step's own SchedulerOutput, so none is pinned on this one.
    assert snap.events == []
    assert_matches_engine(snap, llm)
    ex.run_to_end()


def test_evictions_come_from_kv_cache_events_even_in_steps_taken_elsewhere(text_ids):
    """The block pool's BlockRemoved events (vllm/distributed/kv_events.py) name each evicted
    block, stamped with the step it happened in, whoever stepped the engine."""
    llm = LLM(block_size=4, kv_cache_tokens=16, max_model_len=16, enable_prefix_caching=True)
    engine = llm.llm_engine
    ex = EngineExplorer(llm, max_tokens=2)
    ex.add_request(text_ids[:9])  # two full keyed blocks + one partial
    ex.run_to_end()
    assert ex.snap.count(CACHED) == 2
    ex.add_request(text_ids[40:53])  # 13 + 2 tokens need 4 blocks: both cached ones go
    engine.step()  # outside the explorer
    step = engine.num_steps
    snap = ex.step()
    evicted = [e for e in snap.events if e.kind == "evicted"]
    assert len(evicted) == 2 and {e.step for e in evicted} == {step}
    assert [k for _, k in [(s, type(e).__name__) for s, e in engine.kv_events]].count(
        "BlockRemoved") == 2
    # r0's two keyed blocks (1 and 2; block 0 is the null block) were the ones evicted, after
    # its unkeyed one and the unused.
    assert sorted(e.detail.split(",")[0] for e in evicted) == ["block 1", "block 2"]
    ex.run_to_end()
    assert llm.reset_prefix_cache()
    snap = ex.step()  # nothing to run; the reset is reported
    assert any(e.kind == "cache_cleared" for e in snap.events)
    assert_no_blocks_held(llm)


def test_a_small_pool_preempts_the_newest_and_the_snapshot_says_so(text_ids):
    # 4 usable blocks of 4 (and block 0, the null block): two 6-token prompts take two blocks
    # each; at the 9th token r0 needs a third. No prefix cache: the preemption is the story (with
    # it on, r1's freed blocks keep their keys and r0's new block evicts one in the same step).
    llm = LLM(block_size=4, kv_cache_tokens=16, max_model_len=16, enable_prefix_caching=False)
    ex = EngineExplorer(llm, max_tokens=8)
    ex.add_request(text_ids[:6])
    ex.add_request(text_ids[10:16])
    for _ in range(3):
        snap = ex.step()
        assert ("preempted", "r1") not in kinds(snap)
    assert snap.count(HELD) == 4 and snap.count(FREE) == 0
    snap = ex.step()
    assert kinds(snap) == [("preempted", "r1")]
    assert [r.request_id for r in llm.llm_engine.last_scheduler_output.preempted] == ["r1"]
    assert snap.running == ["r0"] and snap.waiting == ["r1"]
    assert snap.requests["r1"].num_computed_tokens == 0  # recompute: its K/V was dropped
    assert snap.stats["num_preemptions"] == 1 == llm.stats()["num_preemptions"]
    assert "waiting (1): r1 (preempted) [0/" in format_queues(snap)
    assert_matches_engine(snap, llm)
    snap = ex.run_to_end()
    assert ("resumed", "r1") in kinds(snap)  # readmitted once r0 ended
    assert [rid for kind, rid in kinds(snap) if kind == "finished"] == ["r0", "r1"]
    assert_no_blocks_held(llm)


def test_fork_shares_blocks_then_copy_on_write_marks_the_copies(text_ids):
    # Chapter 02's fork (vLLM v1's default for n > 1 is child requests, chosen by name here).
    llm = LLM(block_size=4, kv_cache_tokens=128, max_model_len=64, parallel_sampling="fork")
    ex = EngineExplorer(llm)
    ex.add_request(text_ids[:6], params=SamplingParams(n=3, max_tokens=3, temperature=0.8,
                                                       seed=1))
    snap = ex.step()  # sample 0 computes the prompt; samples 1 and 2 fork from it
    assert ("forked", "0_r0") in kinds(snap) and "1_r0, 2_r0" in snap.events[-1].detail
    # The prompt's blocks are 1 and 2 (block 0 is the null block).
    assert [(b.state, b.ref_cnt) for b in snap.blocks[:3]] == [(NULL, 0), (SHARED, 3),
                                                               (SHARED, 3)]
    assert snap.running == ["0_r0", "1_r0", "2_r0"]
    assert_matches_engine(snap, llm)

    snap = ex.step()  # each sample writes position 6, in shared block 2: two copy it first
    copies = llm.llm_engine.last_scheduler_output.cow_copies
    assert len(copies) == 2
    cow = [e for e in snap.events if e.kind == "copy_on_write"]
    assert [e.request_id for e in cow] == ["0_r0", "1_r0"]
    assert [e.detail for e in cow] == [f"block {s} -> {d}" for s, d in copies]
    assert {b.block_id for b in snap.blocks if b.just_copied} == {d for _, d in copies}
    assert snap.blocks[1].state == SHARED and snap.blocks[1].ref_cnt == 3
    assert snap.blocks[2].state == HELD and snap.blocks[2].owners == ("2_r0",)  # the last keeps it
    assert snap.stats["num_cow_copies"] == 2
    assert_matches_engine(snap, llm)

    snap = ex.step()  # nothing copied this step: the marks go
    assert not any(b.just_copied for b in snap.blocks)
    ex.run_to_end()
    assert_no_blocks_held(llm)


def test_prefix_hits_and_evictions_appear_as_they_happen(text_ids):
    # 8 usable blocks of 4 (1..8; block 0 is the null block) with prefix caching.
    llm = LLM(block_size=4, kv_cache_tokens=32, max_model_len=32, enable_prefix_caching=True)
    ex = EngineExplorer(llm, max_tokens=2)
    ex.add_request(text_ids[:10])
    snap = ex.run_to_end()
    # r0's two full blocks keep their keys after it ends: cached, free; its third block does not.
    assert snap.count(CACHED) == 2 and snap.count(FREE) == 6
    assert [b.state for b in snap.blocks[:4]] == [NULL, CACHED, CACHED, FREE]
    assert_no_blocks_held(llm)

    # An unrelated 26-token prompt needs 7 blocks: the free queue is r0's unkeyed block 3 (at
    # the head), the never-used 4..8, then r0's keyed blocks in the order they were freed (last
    # first): 2, whose key is evicted, then 1.
    ex.add_request(text_ids[100:126], params=SamplingParams(max_tokens=1, ignore_eos=True))
    snap = ex.step()
    evicted = [e for e in snap.events if e.kind == "evicted"]
    assert len(evicted) == 1 and evicted[0].detail.startswith("block 2, key ")
    assert not any(e.kind == "prefix_hit" for e in snap.events)
    assert snap.blocks[1].state == CACHED  # r0's first block survives

    # r0's prompt again: only block 1 is still found (the chain breaks at block 2).
    ex.add_request(text_ids[:10])
    snap = ex.step()
    hits = [e for e in snap.events if e.kind == "prefix_hit"]
    assert [(e.request_id, e.num_tokens) for e in hits] == [("r2", 4)]
    assert llm.llm_engine.parents["r2"][0].num_cached_tokens == 4
    assert snap.stats["prefix_cache_hits"] == llm.stats()["prefix_cache_hits"] == 4
    assert_matches_engine(snap, llm)
    ex.run_to_end()
    assert_no_blocks_held(llm)


def test_reset_gives_every_block_back_and_salted_prompts_are_added(text_ids):
    llm = LLM(block_size=4, kv_cache_tokens=64, max_model_len=64, enable_prefix_caching=True)
    ex = EngineExplorer(llm, max_tokens=6)
    ex.add_request("The capital of France is", shared_prefix="Answer briefly. ")
    snap = ex.add_request("The capital of France is", shared_prefix="Answer briefly. ",
                          cache_salt="tenant-b")
    assert "salt 'tenant-b'" in snap.events[-1].detail
    assert llm.llm_engine.parents["r1"][0].cache_salt == "tenant-b"
    assert (llm.llm_engine.parents["r0"][0].prompt_token_ids
            == llm.get_tokenizer()("Answer briefly. The capital of France is").input_ids)
    ex.step()
    snap = ex.step()
    assert snap.count(HELD) + snap.count(SHARED) > 0
    snap = ex.reset()
    assert kinds(snap) == [("reset", None)]
    assert snap.running == snap.waiting == [] and snap.count(HELD) + snap.count(SHARED) == 0
    assert_no_blocks_held(llm)
    assert_matches_engine(snap, llm)


def test_block_0_is_the_null_block_drawn_black_and_named_in_the_legend(text_ids):
    """vLLM's null block (block 0, BlockPool.null_block in vllm/v1/core/block_pool.py) is never
    handed out: the snapshot shows it in a state of its own from the start, the picture draws it
    black and counts it in no state of the title, and the legend says what it is."""
    llm = LLM(block_size=4, kv_cache_tokens=32, max_model_len=32)
    ex = EngineExplorer(llm, max_tokens=2)
    snap = ex.snap  # before any request
    assert [(b.block_id, b.is_null) for b in snap.blocks if b.state == NULL] == [(0, True)]
    assert snap.count(FREE) == llm.stats()["num_usable_blocks"] == len(snap.blocks) - 1 == 8
    ex.add_request(text_ids[:6])
    snap = ex.step()
    null = snap.blocks[0]
    assert (null.state, null.ref_cnt, null.owners, null.key) == (NULL, 0, (), None)
    assert snap.block_tables == {"r0": [1, 2]}  # handed out from block 1
    assert_matches_engine(snap, llm)
    fig = draw_snapshot(snap)
    pool = fig.axes[0]
    cells = [p for p in pool.patches if p.get_gid() == "block-0"]
    assert len(cells) == 1 and matplotlib.colors.same_color(cells[0].get_facecolor(), "black")
    assert pool.get_title().endswith(": 2 held, 6 free")  # 8 usable blocks; block 0 in neither
    labels = _legend_labels(fig)
    assert labels[2] == "block 0: vLLM's null block, never handed out"  # after free and held
    assert sum("null" in label for label in labels) == 1
    ex.run_to_end()
    assert_no_blocks_held(llm)


def handmade_snapshot() -> EngineSnapshot:
    """A snapshot with every block state, built without any engine."""
    blocks = [BlockView(0, 2, ("a", "b"), 4, "ab12", False),  # shared
              BlockView(1, 1, ("a",), 3, None, False),  # held, partly written
              BlockView(2, 1, ("b",), 1, None, True),  # held, just copied
              BlockView(3, 0, (), 0, "cd34", False),  # cached, free
              BlockView(4, 0, (), 0, None, False)]  # free
    reqs = {rid: RequestView(rid, "running", 6, 7, 1, 4) for rid in ("a", "b")}
    reqs["c"] = RequestView("c", "waiting", 9, 0, 0, 4)
    return EngineSnapshot(step=5, block_size=4, kv_layout="paged", blocks=blocks,
                          block_tables={"a": [0, 1], "b": [0, 2]}, waiting=["c"],
                          running=["a", "b"], requests=reqs, token_budget=16,
                          num_decode_tokens=2, num_prefill_tokens=9,
                          colours={"a": 0, "b": 1, "c": 2})


def _legend_labels(fig) -> list[str]:
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    return labels


def test_the_legend_names_only_the_states_on_screen():
    """Chapter 01's explorer must not list chapter 05's states: a state is in the legend
    once a block is in it (free and held always)."""
    snap = handmade_snapshot()
    everything = _legend_labels(draw_snapshot(snap))
    assert len(everything) == 7 and "dot: has a prefix-cache key" in everything
    assert everything[-1] == "0, 16, ...: the row's first block id"  # the numbers left of the grid
    plain = replace(snap, blocks=[replace(b, ref_cnt=b.ref_cnt and 1, owners=b.owners[:1],
                                          key=None, just_copied=False)
                                  for b in snap.blocks])
    assert {b.state for b in plain.blocks} <= {HELD, FREE}
    fig = draw_snapshot(plain)
    assert "shared" not in fig.axes[0].get_title() and "cached" not in fig.axes[0].get_title()
    assert _legend_labels(fig) == ["free", "held by a request (solid: K/V written)",
                                   "0, 16, ...: the row's first block id"]


def test_the_picture_is_drawn_from_the_snapshot_alone():
    snap = handmade_snapshot()
    assert [b.state for b in snap.blocks] == [SHARED, HELD, HELD, CACHED, FREE]
    fig = draw_snapshot(snap)
    assert isinstance(fig, Figure)
    pool, budget, text = fig.axes
    cells = {p.get_gid(): p for p in pool.patches if (p.get_gid() or "").startswith("block-")}
    assert sorted(cells) == [f"block-{i}" for i in range(5)]
    assert matplotlib.colors.same_color(cells["block-0"].get_facecolor(), SHARED_COLOUR)
    assert "x2" in [t.get_text() for t in pool.texts]
    assert matplotlib.colors.same_color(cells["block-2"].get_edgecolor(), COPY_EDGE)
    assert matplotlib.colors.same_color(cells["block-4"].get_facecolor(), "white")
    assert "2 held, 1 shared, 1 cached, 1 free" in pool.get_title()
    bars = {p.get_gid(): p.get_width() for p in budget.patches}
    assert bars == {"budget-decode": 2, "budget-prefill": 9, "budget-unused": 5}
    lines = {t.get_text(): t for t in text.texts}
    shown = " ".join(" ".join(t.get_text().split()) for t in text.texts)  # wrapped lines joined
    assert all(" ".join(q.split()) in shown for q in format_queues(snap).splitlines())
    # Each block table is written in its request's colour: the picture's legend for requests.
    a_line, b_line = (next(t for k, t in lines.items() if k.strip().startswith(f"{r}:"))
                      for r in "ab")
    assert a_line.get_text().strip() == "a: [0(x2), 1]"
    assert matplotlib.colors.same_color(a_line.get_color(), cells["block-1"].get_facecolor()[:3]
                                        + (1,))
    assert not matplotlib.colors.same_color(a_line.get_color(), b_line.get_color())
    plt.close(fig)
    queues = format_queues(snap).splitlines()
    assert queues[1].startswith("running (2): a [7/7 tokens in KV, 1/4 out], b")
    assert queues[2] == "waiting (1): c [0/9 tokens in KV, 0/4 out]"


def test_drawing_an_old_snapshot_reads_nothing_from_the_engine(text_ids):
    llm = LLM(block_size=4, kv_cache_tokens=64, max_model_len=64)
    ex = EngineExplorer(llm, max_tokens=3)
    ex.add_request(text_ids[:10])
    old = ex.step()
    ex.run_to_end()  # the engine moves on; the old snapshot must still draw step 1
    fig = draw_snapshot(old)
    assert "after step 1" in fig.axes[0].get_title() and "3 held" in fig.axes[0].get_title()
    # One cell per block: the 16 usable ones and block 0, the null block.
    assert len([p for p in fig.axes[0].patches
                if (p.get_gid() or "").startswith("block-")]) == 16 + 1
    plt.close(fig)
    # snapshot() without the step's SchedulerOutput: no budget, no step events.
    bare = snapshot(llm.llm_engine)
    assert (bare.num_decode_tokens, bare.num_prefill_tokens, bare.events) == (0, 0, [])


# ---- widgets: the buttons and sliders redraw their own cell outputs in place ---------------
class Shown(list):
    """What widgets display as ordinary cell outputs (outside any widget), in order: each
    output's current object, replaced when the widget redraws it in place."""

    def display(self, obj, display_id=None):
        assert display_id is True  # redrawable: every widget output takes a display id
        index = len(self)
        self.append(repr(obj) if isinstance(obj, widgets._Text) else obj)
        shown = self

        class Handle:
            def update(self, new):
                shown[index] = repr(new) if isinstance(new, widgets._Text) else new
                shown.updates += 1

        return Handle()


@pytest.fixture
def shown(monkeypatch):
    calls = Shown()
    calls.updates = 0
    monkeypatch.setattr(widgets, "display", calls.display)
    return calls


def test_engine_explorer_widget_draws_one_picture_and_its_buttons_step(text_ids, shown,
                                                                        capsys):
    llm = LLM(block_size=4, kv_cache_tokens=64, max_model_len=64)
    ex = EngineExplorer(llm, max_tokens=4)
    ex.add_request(text_ids[:10])
    ex.step()
    box = widgets.engine_explorer(ex, prompt="Hello")
    assert "The engine explorer (redrawn in place" in capsys.readouterr().out
    assert len(shown) == 1 and isinstance(shown[0], Figure)  # one picture, no second copy
    first = shown[0]
    assert "after step 1" in first.axes[0].get_title()
    buttons = {b.description: b for b in box.children[0].children}
    assert list(buttons) == ["Step", "Run to end", "Reset", "Add request"]
    queues = next(w for w in box.children if "kvlab-explorer-queues" in w._dom_classes)
    assert "running (1): r0" in queues.value
    buttons["Add request"].click()
    assert "waiting (1): r1" in queues.value and ex.snap.waiting == ["r1"]
    buttons["Step"].click()
    assert llm.llm_engine.num_steps == 2 and "running (2): r0" in queues.value
    assert len(shown) == 1 and shown[0] is not first  # the same output, redrawn
    assert "after step 2" in shown[0].axes[0].get_title()
    buttons["Run to end"].click()
    assert "running (0): -" in queues.value
    assert box.explorer is ex
    assert_no_blocks_held(llm)


def test_block_size_and_hash_chain_sliders_redraw_their_outputs_in_place(shown, capsys):
    lengths = [10, 100, 300]
    box = widgets.block_size_slider(lengths, value=16)
    assert "(redrawn in place by the controls below" in capsys.readouterr().out
    text, fig = shown
    assert text == widgets.viz.block_size_summary(lengths, 16) and isinstance(fig, Figure)
    box.children[0].value = 32  # what dragging does
    assert shown[0] == widgets.viz.block_size_summary(lengths, 32)
    assert shown[1] is not fig and isinstance(shown[1], Figure) and shown.updates == 2
    prompts = {"A": [1, 2, 3, 4, 5], "B": [1, 2, 3, 4, 6]}
    box = widgets.hash_chain_slider(prompts, value=2)
    assert shown[2] == "block_size=2:\n" + widgets.viz.format_hash_chain(prompts, 2)
    box.children[0].value = 4
    assert shown[2] == "block_size=4:\n" + widgets.viz.format_hash_chain(prompts, 4)
    assert len(shown) == 3  # redrawn, never appended


def test_a_failing_redraw_is_shown_in_the_controls(shown, monkeypatch):
    box = widgets.block_size_slider([10, 100], value=16)

    def broken(*args):
        raise RuntimeError("no picture")

    monkeypatch.setattr(widgets.viz, "plot_block_size_tradeoff", broken)
    box.children[0].value = 8
    assert "redraw failed" in box.children[-1].value and "no picture" in box.children[-1].value


def test_live_output_outside_ipython_and_a_part_it_was_made_without(capsys):
    """No IPython shell (a plain script): no display handles, each new text is printed. A part
    not made at the start cannot appear later (from a callback it would belong to no cell)."""
    live = widgets.LiveOutput("caption", text="first", fig=plt.figure())
    live.update(text="second", fig=plt.figure())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("caption (redrawn in place")
    assert lines[1] == "first" and lines[-1] == "second"  # the text itself, not a mimebundle
    assert plt.get_fignums() == []  # every figure closed
    only_text = widgets.LiveOutput("caption", text="x")
    with pytest.raises(ValueError, match="without a fig"):
        only_text.update(text="y", fig=plt.figure())
    assert plt.get_fignums() == []


def test_real_model_sliders_run_their_default_once_and_redraw_in_place(shown, monkeypatch,
                                                                        capsys):
    import kvlab.bench
    import kvlab.bench.scheduling
    from kvlab.bench.scheduling import StallRun

    cow_calls, stall_calls = [], []

    def fake_cow_run(kind, k, prompt_ids, max_tokens, share):
        cow_calls.append((kind, k, share))
        return {"peak_blocks": 4 if share else 8, "cow_copies": k - 1,
                "blocks_per_step": [1, 2, 4 if share else 8]}

    def fake_stall(budget, long_len):
        stall_calls.append(budget)
        return StallRun(budget, [0.0, 0.1, 0.5, 0.6], 0.15, 0.4, 0.4, 3)

    monkeypatch.setattr(kvlab.bench, "cow_run", fake_cow_run)
    monkeypatch.setattr(kvlab.bench.scheduling, "chunked_prefill_stall", fake_stall)
    w = widgets.cow_slider([1, 2, 3], max_tokens=2, value=3)
    # The first drawing is one pair of runs; the controls do not run it again.
    assert cow_calls == [("beam", 3, True), ("beam", 3, False)]
    assert shown[0].startswith("beam, k=3: peak 4 blocks shared vs 8 unshared: 50% saved")
    assert isinstance(shown[1], Figure) and len(shown) == 2
    w.children[1].value = 2  # moving the slider runs the new value, drawn in place
    assert cow_calls[2:] == [("beam", 2, True), ("beam", 2, False)]
    assert shown[0].startswith("beam, k=2:") and len(shown) == 2
    # The figure's own title names what the slider set, so a screenshot of it says so too.
    assert shown[1].axes[0].get_title() == "beam width 2, 3-token prompt, 2 new tokens"
    w.children[1].value = 3  # back to a value already run: no new runs
    assert len(cow_calls) == 4 and shown[0].startswith("beam, k=3:")
    w = widgets.chunk_size_slider(long_len=64, value=32)
    assert stall_calls == [32] and shown[2].startswith("budget 32: 3 prefill steps")
    w.children[0].value = 64
    assert stall_calls == [32, 64] and shown[2].startswith("budget 64:")
    assert "A decode's gaps" in capsys.readouterr().out
    plt.close("all")


def test_the_budget_bar_shows_one_token_and_wears_no_requests_colour():
    """One decode token in a budget of 8,192 is still a visible sliver; decode and prefill are
    black and hatched, colours no request has; the marks of the text are explained."""
    snap = replace(handmade_snapshot(), token_budget=8192, num_decode_tokens=1,
                   num_prefill_tokens=0)
    fig = draw_snapshot(snap)
    pool, budget, text = fig.axes
    bars = {p.get_gid(): p for p in budget.patches}
    assert bars["budget-decode"].get_width() >= 0.005 * 8192
    assert bars["budget-prefill"].get_width() == 0
    widths = sum(p.get_width() for p in bars.values())
    assert abs(widths - 8192) < 1e-6  # the sliver is taken from the unused part
    from kvlab.workbook.viz.axes import _colour
    requests = {matplotlib.colors.to_hex(_colour(i)) for i in range(20)}
    assert len(requests) == 20  # twenty requests, twenty colours
    assert matplotlib.colors.to_hex(bars["budget-decode"].get_facecolor()) not in requests
    assert bars["budget-prefill"].get_hatch()
    key = "\n".join(t.get_text() for t in text.texts)  # the key may wrap over two lines
    assert "tokens in KV" in key and "new tokens made" in key
    legend_text = [t.get_fontsize() for t in pool.get_legend().get_texts()]
    assert min(legend_text) >= 8  # readable on a projector
    plt.close(fig)


def test_a_quantized_pool_shows_its_precision_bytes_per_token_and_blocks(text_ids):
    """Chapter 08: at a lower precision the explorer says what a token costs and how many
    blocks the same bytes hold; at "auto" (every other chapter) the title is unchanged."""
    titles = {}
    for dtype in ("auto", "int8_per_token_head"):
        llm = LLM(block_size=4, kv_cache_memory_bytes=4 * 2**20, max_model_len=32,
                  kv_cache_dtype=dtype)
        ex = EngineExplorer(llm, max_tokens=2)
        ex.add_request(text_ids[:6])
        snap = ex.step()
        assert snap.kv_cache_dtype == dtype
        assert snap.kv_bytes_per_token == llm.stats()["kv_bytes_per_token"]
        fig = draw_snapshot(snap)
        titles[dtype] = fig.axes[0].get_title()
        plt.close(fig)
    assert "bytes/token" not in titles["auto"]
    stats = llm.stats()
    assert (f"kv_cache_dtype int8_per_token_head: {stats['kv_bytes_per_token']:,} bytes/token"
            in titles["int8_per_token_head"])
    assert f"{stats['num_blocks']} blocks" in titles["int8_per_token_head"]


def test_the_explorer_reads_from_the_back_of_a_room():
    """The queue and block-table text is at least 8 points, and the pool's legend sits right
    under the grid: no empty band between the blocks and their key."""
    snap = handmade_snapshot()
    fig = draw_snapshot(snap)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pool, _, text = fig.axes
    assert min(t.get_fontsize() for t in text.texts) >= 8
    lowest_block = min(p.get_window_extent(renderer).y0 for p in pool.patches
                       if (p.get_gid() or "").startswith("block-"))
    block_height = max(p.get_window_extent(renderer).height for p in pool.patches
                       if (p.get_gid() or "").startswith("block-"))
    legend_top = pool.get_legend().get_window_extent(renderer).y1
    assert 0 <= lowest_block - legend_top < 0.6 * block_height
    plt.close(fig)


def test_the_picture_reads_on_a_projector():
    """No text under FONT_PT (14 px at the notebook's 100 dpi), each held block names its owner
    (two near colours are told apart by more than hue), and the budget bar takes a thin line,
    not a panel: most of the picture is the pool and the text."""
    from matplotlib.text import Text

    from kvlab.workbook.viz.snapshot import FONT_PT

    snap = handmade_snapshot()
    fig = draw_snapshot(snap)
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip()]
    sizes += [tick.label1.get_fontsize() for ax in fig.axes
              for tick in ax.xaxis.get_major_ticks() if ax.axison]  # axes drawn
    assert min(sizes) >= FONT_PT >= 11
    pool, budget, _ = fig.axes
    owners = {t.get_gid(): t.get_text() for t in pool.texts if (t.get_gid() or "").startswith("owner-")}
    assert owners == {"owner-1": "a", "owner-2": "b"}  # the held blocks; shared shows "x2"
    fig.canvas.draw()
    height = lambda ax: ax.get_window_extent().height  # noqa: E731
    assert height(budget) < 0.1 * fig.bbox.height
    plt.close(fig)


def test_the_explorer_shows_a_tier_and_a_request_waiting_for_its_load(text_ids):
    """Chapter 10: with a second tier, a request whose prompt the pool lost waits for its
    load (the queue line says so), the step's load is an event, and the picture's text counts
    the tier's blocks in use."""
    llm = LLM(block_size=16, kv_cache_tokens=96, max_model_len=96, kv_offloading_size=0.01)
    ex = EngineExplorer(llm, max_tokens=2)
    doc = list(text_ids[:40])
    ex.add_request(doc)
    ex.run_to_end()
    ex.add_request(list(text_ids[50:120]))  # pushes the document out of the pool
    ex.run_to_end()
    ex.add_request(doc)
    snap = ex.step()
    assert snap.tier_blocks == llm.stats()["kv_offload_tier_blocks"] > 0
    assert len(snap.tier_keys) == llm.stats()["kv_offload_tier_blocks_used"] > 0
    assert any(e.kind == "tier_load" for e in snap.events), [str(e) for e in snap.events]
    assert "waiting for its KV to load" in format_queues(snap)
    fig = draw_snapshot(snap)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any(t.startswith("tier: ") and f"of {snap.tier_blocks} blocks" in t for t in texts)
    plt.close(fig)
    snap = ex.run_to_end()
    assert not snap.running and not snap.waiting
    assert_no_blocks_held(llm)

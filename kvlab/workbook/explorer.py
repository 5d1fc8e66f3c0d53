"""The engine explorer: step a real engine and see its KV pool, queues and token budget.

Introduced in notebook 01 and used again in 02-05 (each chapter points it at its own
mechanism: paged filling, fork and copy-on-write, admission and preemption, chunks, prefix hits
and eviction). Three layers, so that everything but the buttons is tested without a browser:

- `snapshot(engine, ...)` reads an `LLMEngine` into an `EngineSnapshot`: plain Python data,
  the pool block by block, the queues, the last step's token budget and what happened in it.
  It only reads; stepping the engine is someone else's job.
- `kvlab.workbook.viz.draw_snapshot(snap)` and `kvlab.workbook.viz.format_queues(snap)` draw it: pure functions
  of a snapshot, beside the other pictures.
- `EngineExplorer` drives an engine (add_request / step / run_to_end / reset) and returns a
  fresh snapshot after each call. `kvlab.workbook.widgets.engine_explorer` wires buttons to it.

vLLM has no such view; the pieces it reads are vLLM's own: the block pool's ref counts and free
queue (`vllm/v1/core/block_pool.py`), the block tables (`vllm/v1/core/kv_cache_manager.py`),
the `SchedulerOutput` of one step (`vllm/v1/core/sched/output.py`: who was admitted, with how
many prompt tokens found in the cache) and the block pool's KV cache events
(`vllm/distributed/kv_events.py`: which cached blocks were evicted). The engine's own step
observer (`engine.step_log`, kvlab/step_log.py) keeps the last SchedulerOutput and those events
(`engine.last_scheduler_output`, `engine.kv_events`) whoever stepped it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.kv_events import AllBlocksCleared, BlockRemoved
from kvlab.sampling import SamplingParams

# Block states, in the order the legend lists them.
FREE, CACHED, HELD, SHARED, NULL = "free", "cached", "held", "shared", "null"


@dataclass(frozen=True)
class BlockView:
    """One physical block as the snapshot saw it."""

    block_id: int
    ref_cnt: int
    owners: tuple[str, ...]  # request ids whose block table holds it (several when shared)
    num_filled: int  # slots holding computed K/V, for the most advanced owner
    key: str | None  # its prefix-cache key, in hex; None when it has none
    just_copied: bool  # written by a copy (copy-on-write, or a fork copy) in the last step
    is_null: bool = False  # block 0, vLLM's null block: never handed out
    group: int | None = None  # the KV cache group whose tables hold it (hybrid models only)

    @property
    def state(self) -> str:
        if self.is_null:
            return NULL
        if self.ref_cnt == 0:
            # A free block that still holds a keyed prefix can be hit again until it is reused:
            # cached but evictable (chapter 05). A free block without a key is just free.
            return CACHED if self.key is not None else FREE
        return SHARED if self.ref_cnt > 1 else HELD


@dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str  # "waiting" | "preempted" | "running" (vLLM's RequestStatus values)
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose K/V is in the pool
    num_output_tokens: int
    max_tokens: int
    cache_salt: str | None = None


@dataclass(frozen=True)
class Event:
    """Something one step (or the explorer) did. kind: added, admitted, resumed, prefix_hit,
    forked, preempted, copy_on_write, fork_copy, evicted, cache_cleared, finished, reset, and
    with a KV connector (chapter 10) tier_hit, tier_load, tier_store."""

    step: int
    kind: str
    request_id: str | None
    detail: str = ""
    num_tokens: int = 0  # prefix_hit: the prompt tokens found in the cache

    def __str__(self) -> str:
        who = f" {self.request_id}" if self.request_id else ""
        return f"step {self.step}: {self.kind.replace('_', ' ')}{who}" + (
            f" ({self.detail})" if self.detail else "")


@dataclass
class EngineSnapshot:
    """What the explorer draws: plain data, read from an engine right after a step."""

    step: int  # engine steps taken so far
    block_size: int
    kv_layout: str
    blocks: list[BlockView]
    block_tables: dict[str, list[int]]  # running requests only, admission order
    waiting: list[str]  # queue order: the head is admitted first
    running: list[str]  # admission order: the last is preempted first
    requests: dict[str, RequestView]  # every waiting and running request
    # The last step's token budget (vLLM's max_num_batched_tokens) and how it was spent.
    token_budget: int
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0  # prompt, prompt chunk, or recompute after a preemption
    events: list[Event] = field(default_factory=list)
    # Request id -> colour index, kept from snapshot to snapshot so a request keeps its colour.
    colours: dict[str, int] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    # How many KV cache events the engine had logged (engine.kv_events) when this was taken:
    # the next snapshot reads the ones after it.
    num_kv_events: int = 0
    # The pool's precision (vLLM's kv_cache_dtype) and what one token costs it, scales included.
    kv_cache_dtype: str = "auto"
    kv_bytes_per_token: int = 0
    # A hybrid model's KV cache groups, in group order ("window 32", "full attention"); empty
    # for one group. A request's block table is then one list per group.
    groups: list[str] = field(default_factory=list)
    # A second KV tier (chapter 10): its blocks, and which hold a block now (key hex -> slot);
    # 0 and empty without one.
    tier_blocks: int = 0
    tier_keys: dict[str, int] = field(default_factory=dict)

    def count(self, state: str) -> int:
        return sum(1 for b in self.blocks if b.state == state)


def _group_names(engine) -> list[str]:
    groups = getattr(engine, "kv_cache_groups", [])
    if len(groups) < 2:
        return []
    return [f"window {g.spec.sliding_window}" if hasattr(g.spec, "sliding_window")
            else "full attention" for g in groups]


def _key(block_hash: bytes | None) -> str | None:
    return None if block_hash is None else block_hash.hex()


def snapshot(engine, last_scheduler_output=None, previous: EngineSnapshot | None = None,
             extra_events: list[Event] = ()) -> EngineSnapshot:
    """Read `engine` (an `LLMEngine`) into an `EngineSnapshot`, without changing it.

    Pass the step's `SchedulerOutput` (`engine.last_scheduler_output`) right after
    `engine.step()` for the token budget and the step's admissions (with their prefix hits),
    preemptions, forks, copies and finishes. Evictions come from the engine's KV cache events
    since `previous` (the snapshot before; `EngineExplorer` keeps it), stamped with the step
    they happened in, even a step someone else took.
    """
    sched = last_scheduler_output
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    pool, bs = kv.block_pool, kv.block_size
    live = list(scheduler.running) + list(scheduler.waiting)
    computed = {r.request_id: r.num_computed_tokens for r in live}
    owners: dict[int, list[str]] = {}
    filled: dict[int, int] = {}
    group_of: dict[int, int] = {}
    tables = kv.block_tables_by_group()
    for g, by_request in enumerate(tables):
        for rid, blocks in by_request.items():
            n = computed.get(rid, 0)
            for i, blk in enumerate(blocks):
                if blk.is_null:  # a window's given-back block (chapter 09): no one holds it
                    continue
                owners.setdefault(blk.block_id, []).append(rid)
                filled[blk.block_id] = max(filled.get(blk.block_id, 0),
                                           max(0, min(bs, n - i * bs)))
                if len(tables) > 1:
                    group_of[blk.block_id] = g
    copies = [] if sched is None else list(sched.fork_copies) + list(sched.cow_copies)
    copied = {dst for _, dst in copies}
    blocks = [BlockView(blk.block_id, blk.ref_cnt, tuple(owners.get(blk.block_id, ())),
                        filled.get(blk.block_id, 0), _key(blk.block_hash),
                        blk.block_id in copied, blk.is_null, group_of.get(blk.block_id))
              for blk in pool.blocks]
    requests = {
        r.request_id: RequestView(r.request_id, r.status.value,
                                  r.num_prompt_tokens, r.num_computed_tokens,
                                  len(r.output_token_ids), r.sampling_params.max_tokens,
                                  r.cache_salt)
        for r in live
    }
    colours = dict(previous.colours) if previous is not None else {}
    for rid in [*requests, *(o for b in blocks for o in b.owners)]:
        colours.setdefault(rid, len(colours))

    step = engine.num_steps
    events = list(extra_events)
    num_decode = num_prefill = 0
    if sched is not None:
        num_decode = sched.num_decode_tokens
        num_prefill = sched.total_num_scheduled_tokens - num_decode
        events += _step_events(step, sched, owners)
    events += _cache_events(engine, previous, blocks)
    return EngineSnapshot(
        step=step, block_size=bs, kv_layout=engine.config.kv_layout, blocks=blocks,
        block_tables={r.request_id: kv.get_block_ids(r.request_id) for r in scheduler.running},
        waiting=[r.request_id for r in scheduler.waiting],
        running=[r.request_id for r in scheduler.running],
        requests=requests, token_budget=engine.config.max_num_batched_tokens,
        num_decode_tokens=num_decode, num_prefill_tokens=num_prefill, events=events,
        colours=colours, num_kv_events=engine.num_kv_events,
        kv_cache_dtype=engine.kv_cache_dtype.name, kv_bytes_per_token=engine.kv_bytes_per_token,
        groups=_group_names(engine),
        tier_blocks=getattr(engine.kv_connector, "num_slots", 0),
        tier_keys={_key(k): slot
                   for k, slot in getattr(engine.kv_connector, "index", {}).items()},
        stats={"num_preemptions": scheduler.num_preemptions, "num_cow_copies": kv.num_cow_copies,
               "prefix_cache_hits": kv.prefix_cache_hits},  # first admissions, as vLLM
    )


def _cache_events(engine, previous: EngineSnapshot | None,
                  blocks: list[BlockView]) -> list[Event]:
    """Evictions and resets from the engine's KV cache events since `previous` was taken."""
    log = engine.kv_events
    if previous is not None:  # everything logged since, up to what the log still holds
        n = min(engine.num_kv_events - previous.num_kv_events, len(log))
        new = list(log)[len(log) - n:] if n > 0 else []
    else:  # no earlier snapshot: this step's events only
        new = [(s, e) for s, e in log if s >= engine.num_steps]
    events = []
    for s, event in new:
        if isinstance(event, BlockRemoved):
            for block_id, key in zip(event.block_ids, event.block_hashes):
                now = blocks[block_id]
                holder = f", now held by {now.owners[0]}" if now.owners else ""
                events.append(Event(s, "evicted", None,
                                    f"block {block_id}, key {key.hex()[:4]}{holder}"))
        elif isinstance(event, AllBlocksCleared):
            events.append(Event(s, "cache_cleared", None, "reset_prefix_cache(): every key "
                                                          "dropped"))
    return events


def _step_events(step: int, sched, owners: dict[int, list[str]]) -> list[Event]:
    """What one SchedulerOutput did, read after the step ran (requests have advanced);
    `owners`: block id -> the requests whose tables hold it."""
    events = [Event(step, "preempted", r.request_id, "its blocks freed; it will recompute")
              for r in sched.preempted]
    # Chapter 10: a KV connector's loads (into blocks held while the request waits) and stores.
    meta = sched.kv_connector_metadata
    for job in (meta.loads if meta else ()):
        events.append(Event(step, "tier_load", job.req_id,
                            f"{len(job.block_ids)} blocks loaded into {job.block_ids[:4]}"
                            + ("..." if len(job.block_ids) > 4 else ""),
                            num_tokens=len(job.block_ids)))
    for job in (meta.stores if meta else ()):
        events.append(Event(step, "tier_store", job.req_id,
                            f"{len(job.block_ids)} blocks written to the tier"))
    for new in sched.scheduled_new_reqs:
        num_new = sched.num_scheduled_tokens[new.req_id]
        resumed = new.req_id in sched.resumed_req_ids
        events.append(Event(step, "resumed" if resumed else "admitted", new.req_id,
                            f"{num_new} token{'s' * (num_new != 1)} this step"))
        if new.num_computed_tokens > 0:  # the scheduler's prefix-cache hit at admission
            where = "in the cache" if meta is None else "in the cache or loaded from the tier"
            events.append(Event(step, "prefix_hit", new.req_id,
                                f"{new.num_computed_tokens} prompt tokens found {where}",
                                num_tokens=new.num_computed_tokens))
    for parent, children in sched.forked.items():
        events.append(Event(step, "forked", parent,
                            "shares its blocks with " + ", ".join(c.request_id for c in children)))
    for kind, pairs in (("fork_copy", sched.fork_copies), ("copy_on_write", sched.cow_copies)):
        for src, dst in pairs:  # a copy's destination has one holder, the request it was for
            holder = owners.get(dst, [None])[-1]
            events.append(Event(step, kind, holder, f"block {src} -> {dst}"))
    seen = set()
    for r, _ in sched.scheduled:
        for x in [r, *sched.forked.get(r.request_id, [])]:
            if x.is_finished and x.request_id not in seen:
                seen.add(x.request_id)
                events.append(Event(step, "finished", x.request_id,
                                    f"{x.finish_reason}, {len(x.output_token_ids)} tokens"))
    return events


# ---- the driver -------------------------------------------------------------------------------
class EngineExplorer:
    """Step an engine by hand and get a snapshot after each call (what the widget's buttons
    call). Takes an `LLM` or an `LLMEngine`; requests it adds are named r0, r1, ...

    Defaults suit a picture: greedy, `ignore_eos` (so a request runs its `max_tokens` and the
    picture does not depend on when the model happens to stop) and few tokens.

    The explorer runs its engine's synchronous loop (schedule, run, read: one step per press),
    so that each picture is one step's. vLLM's default loop, async scheduling, schedules the
    next step before it reads this one's tokens (`EngineConfig.async_scheduling`); the blocks
    and tokens are the same, one step apart (chapter 03 shows both loops).
    """

    def __init__(self, llm_or_engine, max_tokens: int = 8) -> None:
        self.engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
        if self.engine.batch_queue:
            raise ValueError("the engine has steps in flight: give the explorer an idle engine")
        # The engine's own (resolved) config: only this engine runs the synchronous loop.
        self.engine.config.async_scheduling = False
        self.max_tokens = max_tokens
        self.num_added = 0
        self.snap = snapshot(self.engine)

    def _next_id(self) -> str:
        while f"r{self.num_added}" in self.engine.parents:
            self.num_added += 1
        rid = f"r{self.num_added}"
        self.num_added += 1
        return rid

    def add_request(self, prompt, shared_prefix=None, cache_salt: str | None = None, *,
                    params: SamplingParams | None = None,
                    request_id: str | None = None) -> EngineSnapshot:
        """Queue one request: `shared_prefix + prompt` (both text, or both token id lists), with
        an optional `cache_salt` (chapter 06). Nothing runs until the next step."""
        if shared_prefix:
            prompt = shared_prefix + prompt
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        spec = {key: prompt if isinstance(prompt, str) else list(prompt)}
        if cache_salt:
            spec["cache_salt"] = cache_salt
        if params is None:
            params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        request_id = request_id or self._next_id()
        self.engine.add_request(request_id, spec, params)
        n = len(self.engine.parents[request_id][0].prompt_token_ids)
        salt = f", salt {cache_salt!r}" if cache_salt else ""
        added = Event(self.engine.num_steps, "added", request_id,
                      f"{n} prompt tokens, n={params.n}{salt}")
        return self._read(None, [added])

    def step(self) -> EngineSnapshot:
        """One engine step (schedule -> forward -> update), then a snapshot."""
        self.engine.step()
        return self._read(self.engine.last_scheduler_output)

    def run_to_end(self, max_steps: int = 10_000) -> EngineSnapshot:
        """Step until no request is left; the snapshot lists every step's events."""
        events: list[Event] = []
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            events += self.step().events
        self.snap.events = events
        return self.snap

    def reset(self) -> EngineSnapshot:
        """Abort every unfinished request: all their blocks go back to the pool. Blocks that
        still hold a prefix-cache key stay findable (cached, free), as after any request."""
        for rid in list(self.engine.parents) + list(self.engine.beam_groups):
            self.engine.abort_request(rid)
        return self._read(None, [Event(self.engine.num_steps, "reset", None,
                                       "every request aborted")])

    def _read(self, sched, extra: list[Event] = ()) -> EngineSnapshot:
        self.snap = snapshot(self.engine, sched, previous=self.snap, extra_events=extra)
        return self.snap

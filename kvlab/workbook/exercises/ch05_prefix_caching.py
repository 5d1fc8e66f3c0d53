"""Chapter 05 exercises: the block hash chain, and the longest cache hit.

`block_hashes` teaches the key that stands for a whole prefix: a full block's key hashes its
parent's key, its own tokens and its extra keys, so equal keys at block i mean equal tokens from
the first token through block i. Only full blocks get keys (a partial block's tokens are not
final), and the cache salt (chapter 06) is an extra key of the request's first block only: the
chain carries it on.

`longest_cache_hit` teaches the lookup: walk the keys from the request's first block, stop at the
first one that is not cached (nothing after a broken chain can be the same prefix), and never
cover the last token, which must be computed so that there are logits to sample from.

Both are checked on hand-made and random inputs against kvlab's own `prefix_cache` and
`KVCacheManager.get_computed_blocks`, then inside a real engine with prefix caching on: the same
tokens, and the same number of cached tokens per request, as kvlab.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch, RequestView, short
from kvlab.workbook.exercises.ch03_scheduling import _request
from kvlab.block_pool import BlockPool
from kvlab.kv_cache import KVCacheManager
from kvlab.prefix_cache import extend_block_hashes, hash_block_tokens
from kvlab.sampling import RequestOutputKind, SamplingParams

IMPORTS = "from kvlab.prefix_cache import hash_block_tokens"


# ---- block_hashes ----------------------------------------------------------------------------
def block_hashes(token_ids, block_size, cache_salt=None):
    """The prefix-cache key of every full block of `token_ids`."""
    keys = []
    # Full blocks only: a partly filled block's tokens are not final, so it gets no key yet.
    for i in range(len(token_ids) // block_size):
        # The parent's key stands for every token before this block, so equal keys mean equal
        # tokens from the very first token, not merely an equal block.
        parent = keys[i - 1] if i > 0 else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        # The salt is an extra key of the request's first block only: every later key chains from
        # that block's key, so a different salt already changes all of them.
        extra_keys = (("cache_salt", cache_salt),) if i == 0 and cache_salt is not None else ()
        keys.append(hash_block_tokens(parent, block, extra_keys))
    return keys


HASH_STUB = '''from kvlab.prefix_cache import hash_block_tokens


def block_hashes(token_ids, block_size, cache_salt=None):
    """The prefix-cache keys of one request: for any tokens, block size and salt, the row that
    the table of keys above prints (the same keys, as bytes, in block order; the table shows
    each key's first 8 hex digits, key.hex()[:8]).

    token_ids: a list of ints; block_size: an int >= 1; cache_salt: None (no salt) or a str
    ("" too is a salt). Each key is one hash_block_tokens(parent, tokens, extra_keys) call on
    one block's tokens, token_ids[i * block_size:(i + 1) * block_size], with parent None or
    another key, and extra_keys () or (("cache_salt", cache_salt),).
    Example: block_hashes([5, 6, 7, 8], 4) == [hash_block_tokens(None, [5, 6, 7, 8], ())]
    """
    raise NotImplementedError("your turn")
'''


def _kvlab_keys(token_ids, block_size, cache_salt=None) -> list[bytes]:
    keys: list[bytes] = []
    extend_block_hashes(keys, lambda a, b: list(token_ids[a:b]), len(token_ids), block_size,
                        cache_salt)
    return keys


def _diagnose(token_ids, block_size, cache_salt, got) -> str:
    """Name a usual mistake when the keys match one."""
    n = len(token_ids) // block_size

    def chain(parent_of, extra_of, count=n):
        keys = []
        for i in range(count):
            block = list(token_ids[i * block_size : (i + 1) * block_size])
            keys.append(hash_block_tokens(parent_of(keys, i), block, extra_of(i)))
        return keys

    salt = (("cache_salt", cache_salt),) if cache_salt is not None else ()
    guesses = {
        "the salt is in every block's extra keys, not the first block's only":
            chain(lambda k, i: k[-1] if k else None, lambda i: salt),
        "the keys are not chained: each block is hashed without its parent's key":
            chain(lambda k, i: None, lambda i: salt if i == 0 else ()),
        "the salt is missing": chain(lambda k, i: k[-1] if k else None, lambda i: ()),
        "the partly filled last block got a key too":
            chain(lambda k, i: k[-1] if k else None, lambda i: salt if i == 0 else (), n + 1)
            if len(token_ids) % block_size else None,
    }
    for words, keys in guesses.items():
        if keys is not None and keys == got:
            return f"It looks like {words}."
    return ""


def _hash_compare(impl, token_ids, block_size, cache_salt=None, what="") -> None:
    want = _kvlab_keys(token_ids, block_size, cache_salt)
    got = impl(list(token_ids), block_size, cache_salt)
    try:
        got = list(got)
    except TypeError:
        raise Mismatch(f"a list of {len(want)} keys", short(got)) from None
    situation = (what or f"{len(token_ids)} tokens, block_size {block_size}, "
                 f"cache_salt {cache_salt!r}")
    if len(got) != len(want):
        raise Mismatch(f"{len(want)} keys (one per full block)", f"{len(got)} keys",
                       f"{situation}. {_diagnose(token_ids, block_size, cache_salt, got)}".strip())
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            raise Mismatch(f"key {i} = {w.hex()[:12]}...",
                           f"{g.hex()[:12] + '...' if isinstance(g, bytes) else short(g)}",
                           f"{situation}. {_diagnose(token_ids, block_size, cache_salt, got)}"
                           .strip())


def _hash_case(token_ids, block_size, cache_salt=None):
    return lambda impl: _hash_compare(impl, token_ids, block_size, cache_salt)


def _hash_chained(impl) -> None:
    """Same later blocks behind different first blocks must give different keys."""
    a = _keys_of(impl, [1, 2, 3, 4, 5, 6], 2)
    b = _keys_of(impl, [9, 9, 3, 4, 5, 6], 2)
    if len(a) == 3 and len(b) == 3 and a[1] == b[1]:
        raise Mismatch("different keys for block 1 of [1, 2 | 3, 4 | 5, 6] and [9, 9 | 3, 4 | "
                       "5, 6]: their prefixes differ", "the same key",
                       _diagnose([1, 2, 3, 4, 5, 6], 2, None, a))
    _hash_compare(impl, [1, 2, 3, 4, 5, 6], 2)


def _keys_of(impl, token_ids, block_size, cache_salt=None):
    try:
        return list(impl(list(token_ids), block_size, cache_salt))
    except TypeError:
        return []


def _hash_random(impl) -> None:
    rng = random.Random(6)
    for _ in range(200):
        block_size = rng.choice([1, 2, 3, 4, 16])
        tokens = [rng.randrange(0, 50_000) for _ in range(rng.randint(0, 40))]
        salt = rng.choice([None, None, "tenant-a", "b", ""])
        _hash_compare(impl, tokens, block_size, salt)


class _HashManager(KVCacheManager):
    """kvlab's KVCacheManager with the participant's keys in each request's block_hashes
    (kvlab's own hashing then finds every key already there and adds none)."""

    impl = None

    def _fill(self, request, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        if len(request.block_hashes) >= num_full:
            return
        keys = self.impl(request.token_ids(0, num_full * self.block_size), self.block_size,
                         request.cache_salt)
        keys = list(keys)
        if len(keys) != num_full:
            raise Mismatch(f"{num_full} keys for {num_full * self.block_size} tokens",
                           f"{len(keys)}")
        if keys[: len(request.block_hashes)] != request.block_hashes:
            raise Mismatch("the same keys for the same tokens, every time",
                           "keys that changed between two calls")
        for key in keys:
            hash(key)  # a key must be usable in a dict
        request.block_hashes[:] = keys

    def get_computed_blocks(self, request):
        if self.enable_prefix_caching:
            self._fill(request, request.num_tokens)
        return super().get_computed_blocks(request)

    def cache_blocks(self, request, num_tokens=None) -> None:
        if self.enable_prefix_caching:
            n = request.num_computed_tokens if num_tokens is None else num_tokens
            self._fill(request, min(n, request.num_tokens))
        super().cache_blocks(request, num_tokens)


_ENGINE = dict(block_size=4, max_model_len=96, kv_cache_tokens=1024, enable_prefix_caching=True)
_SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)


def _batches():
    """One request at a time: salted and unsalted copies of a document, a shared prefix, and a
    prompt of whole blocks sent twice (its last block is recomputed, never a hit)."""
    doc, other, whole = _real_engine.prompt_ids([22, 9, 16], offset=3)
    plan = [("doc-a", doc, "a"), ("doc-a-again", doc, "a"), ("doc-b", doc, "b"),
            ("doc-none", doc, None), ("prefix-a", doc[:13] + other, "a"),
            ("doc-none-again", doc, None), ("whole", whole, None), ("whole-again", whole, None)]
    batches = []
    for rid, tokens, salt in plan:
        prompt = {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}
        batches.append([(rid, prompt, _SHORT)])
    return batches




def _compare_cached(expected, got) -> None:
    for rid, n in expected.cached.items():
        if got.cached.get(rid) != n:
            raise Mismatch(f"request {rid!r} to find {n} cached tokens, as kvlab does",
                           f"{got.cached.get(rid)}")


def _real_model(manager_cls):
    def run(impl):
        expected = _real_engine.reference_workload(
            "prefix_cache", _ENGINE, _batches,
            lambda _e, out: out.cached["doc-a-again"] > 0 and out.cached["doc-b"] == 0)
        engine, got = _real_engine.run_with(
            _ENGINE, _batches,
            kv_cache_manager_cls=_real_engine.with_attrs(manager_cls, impl=impl))
        _compare_cached(expected, got)
        _real_engine.compare_tokens(expected, got, "your code")
        _real_engine.check_bookkeeping(engine)
    return run


BLOCK_HASHES = Exercise(
    name="block_hashes",
    chapter="05_prefix_caching",
    title="The block hash chain",
    prompt=(
        "Write the keys under which prefix caching files a request's blocks. Work out from rows "
        "A to D of the table above which blocks get a key, what a key depends on besides its "
        "block's tokens, and where the salt goes: reproduce a few printed keys with "
        "`hash_block_tokens` first. The check compares your keys with kvlab's, then runs the "
        "real engine with prefix caching on your keys."
    ),
    full_version=(
        "kvlab computes a request's keys incrementally (extend_block_hashes in "
        "kvlab/prefix_cache.py): a block's key is computed when its tokens are known and "
        "entered in the cache when allocate_slots hands it out, the blocks its generated tokens "
        "fill included, so a request that continues a conversation can hit them. The hash is "
        "sha256 of a canonical encoding by default, like vLLM's sha256_cbor (vLLM's default, "
        "sha256, pickles: vllm/utils/hashing.py), and the salt's extra key is chapter 06's "
        "subject."
    ),
    stub=HASH_STUB,
    hint=(
        "Start with row C: its blocks 1-3 hold A's tokens, yet none of its keys is A's, so a "
        "key depends on more than its own block. Which parent makes "
        "hash_block_tokens(parent, A[4:8], ()) print A's second key? Then try D's salt in "
        "block 0's extra keys alone, and in every block's: which prints D's row? And count "
        "the keys of A's row against its 18 tokens."
    ),
    solution=block_hashes,
    imports=IMPORTS,
    cases=[
        Case("fewer tokens than a block: no keys", _hash_case([5, 6, 7], 4),
             "Chapter 05's table of keys: the 2 tokens of rows A and C past their last full "
             "block get no key. A partly filled block's tokens are not final yet."),
        Case("the first block: parent None, its tokens, no extra keys", _hash_case([5, 6, 7, 8], 4),
             "Chapter 05's printed check: hash_block_tokens(None, A[0:4], ()) is A's first key "
             "(the docstring's example too)."),
        Case("the keys are chained: the second block hashes the first's key", _hash_chained,
             "Chapter 05's table, row C: its blocks 1-3 hold A's tokens, yet no key equals A's. "
             "A key depends on every block before it, through its parent: the key just before "
             "it (None for block 0), so equal keys mean equal prefixes."),
        Case("one key per full block; the partly filled last block has none",
             _hash_case(list(range(100, 110)), 4),
             "Chapter 05's table: A's 18 tokens in blocks of 4 have four keys, and the 2 tokens "
             "in a partial block none. Here 10 tokens: two full blocks, two keys."),
        Case("a chain of many blocks (block_size 1)", _hash_case([3, 1, 4, 1, 5, 9, 2, 6], 1),
             "Chapter 05's table, row C, at block size 1: each key's parent is the key just "
             "before it."),
        Case("cache_salt enters the first block's extra keys", _hash_case([5, 6, 7, 8], 4, "tenant-a"),
             "Chapter 05's table, row D: its first key already differs from A's, so block 0's "
             "extra_keys hold the salt: (('cache_salt', cache_salt),)."),
        Case("cache_salt only in the first block: the chain carries it on",
             _hash_case(list(range(20, 32)), 4, "tenant-a"),
             "Chapter 05's table, row D: every key differs from A's, yet only block 0's extra "
             "keys hold the salt. Each later key's parent already carries it (row C's lesson); "
             "later blocks have extra_keys ()."),
        Case("no salt: no extra keys in any block", _hash_case(list(range(20, 32)), 4, None),
             "Chapter 05's table, rows A to C: with cache_salt None every block's extra_keys "
             "is ()."),
        Case("200 random token lists, block sizes and salts, compared with kvlab",
             _hash_random,
             "Chapter 05's table at other sizes: a key per full block, the key before it as its "
             "parent, the salt (any str, \"\" too) in block 0's extra keys only."),
        Case("real model: prefix caching on your keys, same hits and tokens as kvlab",
             _real_model(_HashManager),
             "Chapter 05's explorer: r1 and r2 hit the document's blocks under their keys; r3, "
             "salted, finds none. Equal keys must mean equal prefixes and salts.",
             real_model=True),
    ],
)


# ---- longest_cache_hit -----------------------------------------------------------------------
def longest_cache_hit(block_hashes, num_tokens, block_size, cached):
    """The cached block ids that start this request (prefix-cache hits)."""
    hits = []
    # Never the whole sequence: the last token must be computed, so that the model has logits
    # to sample the next token from. Only blocks that end before the last token can be hits.
    max_blocks = (num_tokens - 1) // block_size
    for block_hash in block_hashes[:max_blocks]:
        block_id = cached.get(block_hash)
        if block_id is None:
            break  # the chain is broken: no later block can hold the same prefix
        hits.append(block_id)
    return hits


HIT_STUB = '''def longest_cache_hit(block_hashes, num_tokens, block_size, cached):
    """The prefix-cache hits of a request: the ids of the cached blocks that its block table
    starts with, in order. The engine computes every token after them.

    block_hashes: the request's keys, key i for its full block i (tokens i * block_size to
    (i + 1) * block_size - 1); num_tokens: the request's length; cached: a read-only mapping
    key -> block id of the blocks in the cache (cached.get(key) is None when the key is not
    there; block ids are ints >= 0, and 0 is a block like any other).
    Must hold: hit i is cached.get(block_hashes[i]), and len(hits) * block_size is the count
    of cached tokens the engine reports: the table "What a warm request finds" above shows
    how long a lookup may go. Example: block_size 4, num_tokens 10, keys [k0, k1],
    cached {k0: 3, k1: 5} -> [3, 5].
    """
    raise NotImplementedError("your turn")
'''


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return [hash_block_tokens(None, [seed, i]) for i in range(n)]


def _kvlab_hits(block_hashes, num_tokens, block_size, cached) -> list[int]:
    """kvlab's own lookup (KVCacheManager.get_computed_blocks) over the same cache."""
    manager = KVCacheManager(max([0, *cached.values()]) + 2, block_size,
                             enable_prefix_caching=True)
    # The exercise's block ids are any ids, 0 included: a plain pool (no null block) to look up.
    manager.block_pool = BlockPool(manager.num_blocks, null_block=False)
    for key, block_id in cached.items():
        manager.block_pool.cache_block(manager.block_pool.blocks[block_id], key)
    request = _request(RequestView("r", num_tokens))
    request.block_hashes = list(block_hashes)
    hits, _ = manager.get_computed_blocks(request)
    return [blk.block_id for blk in hits]


class _CacheView(Mapping):
    """Read-only key -> block id mapping over a dict (what the participant gets)."""

    def __init__(self, data: dict) -> None:
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def _hit_compare(impl, num_tokens, block_size, cached_blocks: dict[int, int], seed=0) -> None:
    """cached_blocks: block index -> block id for the indexes that are cached."""
    keys = _keys(num_tokens // block_size, seed)
    cached = {keys[i]: b for i, b in cached_blocks.items() if i < len(keys)}
    want = _kvlab_hits(keys, num_tokens, block_size, cached)
    got = impl(list(keys), num_tokens, block_size, _CacheView(cached))
    try:
        got = list(got)
    except TypeError:
        raise Mismatch(f"a list of block ids {want}", short(got)) from None
    if got != want:
        picture = " ".join(f"k{i}:{'blk ' + str(cached_blocks[i]) if i in cached_blocks else '-'}"
                           for i in range(len(keys)))
        raise Mismatch(str(want), str(got), f"num_tokens {num_tokens}, block_size {block_size}, "
                       f"cached: {picture}")


def _hit_case(num_tokens, block_size, cached_blocks):
    return lambda impl: _hit_compare(impl, num_tokens, block_size, cached_blocks)


def _hit_random(impl) -> None:
    rng = random.Random(7)
    for trial in range(300):
        block_size = rng.choice([1, 2, 4, 16])
        num_tokens = rng.randint(1, 8 * block_size)
        n = num_tokens // block_size
        ids = rng.sample(range(64), k=n) if n else []
        cached = {i: ids[i] for i in range(n) if rng.random() < 0.8}
        _hit_compare(impl, num_tokens, block_size, cached, seed=trial)


class _LookupManager(KVCacheManager):
    """kvlab's KVCacheManager whose prefix-cache lookup is the participant's function."""

    impl = None

    def get_computed_blocks(self, request):
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(request.block_hashes, request.token_ids, request.num_tokens,
                            self.block_size, request.cache_salt, self.hash_algo)
        pool = self.block_pool
        cached = _CacheView({key: next(iter(copies)) for key, copies
                             in pool.cached_block_hash_to_block.items()})
        ids = list(self.impl(list(request.block_hashes), request.num_tokens, self.block_size,
                             cached))
        limit = (request.num_tokens - 1) // self.block_size
        if len(ids) > limit:
            raise Mismatch(f"at most {limit} hit blocks for {request.num_tokens} tokens",
                           f"{len(ids)}", "Chapter 05's table What a warm request finds: the "
                           "block holding the last token is never a hit (its logits are needed).")
        for i, block_id in enumerate(ids):
            if cached.get(request.block_hashes[i]) != block_id:
                raise Mismatch(f"hit {i} to be the block cached under key {i}",
                               f"block {short(block_id)}", "The docstring: hit i is "
                               "cached.get(block_hashes[i]); the engine skips only a request's "
                               "first tokens.")
        hits = [pool.blocks[b] for b in ids]
        return hits, len(hits) * self.block_size


LONGEST_CACHE_HIT = Exercise(
    name="longest_cache_hit",
    chapter="05_prefix_caching",
    title="The longest cache hit",
    prompt=(
        "Write the prefix-cache lookup: from a request's block keys and the cache, the blocks "
        "it need not compute. Work out from the table above (What a warm request finds) how "
        "many of its cached blocks a request may take. The check compares you with kvlab's "
        "lookup, then runs the real engine with prefix caching on your lookup."
    ),
    full_version=(
        "kvlab's KVCacheManager.get_computed_blocks (kvlab/kv_cache.py) does this walk over the "
        "pool's key map; the scheduler then takes the hits (touch: a free hit leaves the free "
        "queue), counts the lookup in the prefix-cache metrics, skips the lookup for a request "
        "that asks for prompt logprobs (they need every prompt token computed), and records the "
        "hit tokens as the request's num_cached_tokens (the API's cached_tokens, chapter 07)."
    ),
    stub=HIT_STUB,
    hint=(
        "In the table above, compare the first 8 and the first 9 tokens: both hold two cached "
        "full blocks, yet the first 8 find only one. Which token must a request always compute, "
        "and what does the model need it for? Then: hit i must be the block under key i, so "
        "what can a missing key be followed by? Block id 0 is a real block."
    ),
    solution=longest_cache_hit,
    cases=[
        Case("nothing cached: no hits", _hit_case(12, 4, {}),
             "Chapter 05's Lookup and eviction: a hit is a block found under its key. Here the "
             "first key is not in cached, and a hit i is the block under key i: no hits."),
        Case("every full block cached, one token after them", _hit_case(9, 4, {0: 3, 1: 5}),
             "Chapter 05's table What a warm request finds: the first 9 tokens found 8 cached, "
             "both full blocks, since they end before the last token."),
        Case("whole blocks only, never the block holding the last token",
             _hit_case(8, 4, {0: 3, 1: 5}),
             "Chapter 05's table What a warm request finds: the first 8 tokens found 4 cached, "
             "not 8, and all 20 found 16. The block holding the last token is never a hit: that "
             "token is computed so that the model has logits to sample the next one from."),
        Case("stop at the first miss, even if later blocks are cached",
             _hit_case(17, 4, {0: 2, 2: 6, 3: 1}),
             "The docstring: hit i is the block cached under key i, since the engine skips only "
             "a request's first tokens. After a missing key nothing more can be a hit: a later "
             "block's KV was computed after the missing block's tokens (chapter 05's table: with "
             "block 1 changed, only 4 cached tokens). Here block 1 was evicted while blocks 2-3 "
             "stayed cached."),
        Case("a cached block id of 0 still counts", _hit_case(13, 4, {0: 0, 1: 4, 2: 1}),
             "The docstring: block ids are ints >= 0, and 0 is a block like any other. "
             "cached.get(key) returns None for a key not there: compare with None, not with "
             "truthiness."),
        Case("block_size 1", _hit_case(5, 1, {0: 7, 1: 8, 2: 9, 3: 2, 4: 3}),
             "Chapter 05's table, at block size 1: the last token's block is never a hit, so "
             "5 tokens give 4 hits at most."),
        Case("300 random caches, compared with kvlab's get_computed_blocks", _hit_random,
             "Chapter 05's table What a warm request finds: hits from block 0 on, up to the "
             "first key not cached, never the block holding the last token."),
        Case("real model: prefix caching with your lookup, same hits and tokens as kvlab",
             _real_model(_LookupManager),
             "Chapter 05's Verify: a warm request reports its hit tokens as num_cached_tokens, "
             "and its tokens equal the cold path's.",
             real_model=True),
    ],
)

EXERCISES = [BLOCK_HASHES, LONGEST_CACHE_HIT]

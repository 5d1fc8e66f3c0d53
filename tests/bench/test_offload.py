"""Chapter 10's experiments on the real model, small: what the chapter prints, held to what
must hold whatever the machine's speed (the counts, the tokens), never to a time."""

import pytest

from kvlab.bench import disagg, offload


def test_block_maps_show_where_a_load_starts_and_stops():
    rows = offload.block_maps()
    first, hole, whole = rows
    # The pool's hit first, then the tier from there on: every prompt token accounted for.
    assert first["map"] == "P P T T T"
    assert (first["pool"], first["tier"]) == (32, 48)
    assert first["computed"] == first["tokens"] - 80
    # A block knocked out of the tier ends the load there, though a later block is held.
    assert hole["map"] == "T T T . T" and hole["tier"] == 48 and hole["pool"] == 0
    # A prompt of whole blocks loads whole, and its last token is computed again.
    assert whole["map"] == "T T T T" and whole["tier"] == 64 and whole["computed"] == 1


def test_the_tier_sweep_finds_nothing_below_a_turn_and_everything_at_one():
    rows = offload.tier_size_sweep(tier_docs=(0, 2, 6), rounds=2)
    none, small, big = rows
    assert none["hit_rate"] == 0 and small["hit_rate"] == 0  # LRU on tenants in turn
    assert big["hit_rate"] == pytest.approx(big["ceiling"])  # every document's full blocks
    assert all(r["identical"] for r in rows)
    assert small["tier_blocks"] == 30 and big["tier_blocks"] == 90


def test_a_load_supplies_the_whole_prompt_and_gives_its_tokens():
    rows = offload.load_vs_recompute(lengths=(16, 64), repeats=1)
    assert [r["tier_tokens"] for r in rows] == [16, 64]
    assert all(r["load_gb_per_s"] > 0 for r in rows)


def test_preempted_requests_load_from_the_tier_what_the_pool_lost():
    rows = offload.preemption_restore(
        num_requests=6, min_len=200, max_len=260, max_tokens=64, kv_cache_tokens=640,
        block_size=16, modes=("recompute", "prefix cache", "prefix cache + tier"))
    recompute, cache, tier = rows
    assert recompute["preemptions"] > 0 and recompute["found_in_pool"] == 0
    assert all(r["identical"] and r["leaked_blocks"] == 0 for r in rows)
    # The tier never makes a re-admission compute more than the pool alone.
    assert tier["tokens_recomputed"] <= cache["tokens_recomputed"] <= recompute["tokens_recomputed"]


@pytest.mark.slow  # three engine processes, each loading the model
def test_the_pair_gives_one_engines_tokens_and_the_consumer_loads_every_full_block():
    r = disagg.disaggregated_pair(num_requests=3, prompt_len=100, max_tokens=8, rate=4.0)
    assert r["identical"]
    assert r["pair"]["cached"] == [96, 96, 96]  # every full block of each prompt, from the folder
    assert all(len(t) == 8 for t in r["pair"]["token_times"])
    assert all(t > 0 for t in r["pair"]["ttfts"] + r["one_engine"]["ttfts"])

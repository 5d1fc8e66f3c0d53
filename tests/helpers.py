"""What many test files share: the repository's root and the engine's leak checks."""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def assert_no_blocks_held(llm):
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.requests and not llm.llm_engine.parents
    llm.llm_engine.kv_cache_manager.block_pool.check_invariants()


def wait_idle(llm, timeout=30):
    """Wait until a server's engine holds no request and no block (the server frees them on its
    own thread, just after the response)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = llm.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_used_blocks"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(llm.stats())

"""What many test files share: the repository's root and the engine's leak checks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def assert_no_blocks_held(llm):
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"], stats
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


def llm_fixture(**llm_kwargs):
    """A module-scoped `llm` fixture: one engine with these knobs, shared by a file's tests."""
    from kvlab import LLM

    @pytest.fixture(scope="module")
    def llm():
        return LLM(**llm_kwargs)

    return llm


def make_request(request_id: str, prompt_token_ids, *, max_tokens: int = 16,
                 eos_token_ids=frozenset(), cache_salt: str | None = None,
                 ignore_eos: bool = False, stop_token_ids=None, priority: int = 0,
                 arrival_time: float = 0.0):
    """A bare engine `Request` (no model, no engine) for the pool, manager and scheduler tests.
    `priority` and `arrival_time` order it under policy="priority"."""
    from kvlab.metrics import RequestMetrics
    from kvlab.request import Request
    from kvlab.sampling import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                        stop_token_ids=list(stop_token_ids or []))
    return Request(request_id=request_id, prompt=None, prompt_token_ids=list(prompt_token_ids),
                   sampling_params=sp, eos_token_ids=frozenset(eos_token_ids),
                   metrics=RequestMetrics(arrival_time=arrival_time), cache_salt=cache_salt,
                   priority=priority)


def assert_no_text_under(figs: dict, points: float = 9) -> None:
    """Every visible text of each figure (name -> Figure) at least `points` tall; closes them."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    for name, fig in figs.items():
        fig.canvas.draw()
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < points]
        assert texts and not small, (name, small)
        plt.close(fig)


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus exposition (kvlab serve's /metrics) as {series (with labels): value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out

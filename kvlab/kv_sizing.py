"""How much KV a request holds, and the pool that holds a set of requests: the one rule.

Every chapter, exercise check, reference answer and hint that sizes a pool counts with these
functions, so that they cannot disagree (tests/engine/test_kv_sizing.py holds them to what the
engine allocates).

The rule, as the engine runs it:
- A request of p prompt tokens that ends with N output tokens has had K/V slots for
  p + N - 1 positions: the last token sampled is returned, never fed back (chapter 00).
- Under async scheduling (vLLM's default) a request that ends on a stop token (EOS or
  `stop_token_ids`) was given one slot more: the step after the stop token is scheduled, with
  a placeholder for its token, before the stop is seen (chapter 03). A request that ends on
  max_tokens is not: the scheduler knows it ends there.
- Slots come in whole blocks, and the pool's block 0 is vLLM's null block, never handed out
  (`BlockPool.null_block`, vllm/v1/core/block_pool.py): kvlab's `kv_cache_tokens = T` makes
  ceil(T / block_size) usable blocks beside it, while a pool sized in bytes
  (`kv_cache_memory_bytes`) spends one of its blocks on it, as vLLM's pool from
  `--kv-cache-memory-bytes` or `--num-gpu-blocks-override` does.
"""

from __future__ import annotations

from kvlab.kv_cache import cdiv


def tokens_held(prompt_len: int, num_output_tokens: int, *, ends_on_stop: bool = False,
                async_scheduling: bool = True) -> int:
    """The K/V slots a request has been given when it ends: p + N - 1, one more when it ends on
    a stop token under async scheduling."""
    if prompt_len < 1 or num_output_tokens < 1:
        raise ValueError(f"a request has at least one prompt and one output token, not "
                         f"prompt_len={prompt_len}, num_output_tokens={num_output_tokens}")
    extra = 1 if (ends_on_stop and async_scheduling) else 0
    return prompt_len + num_output_tokens - 1 + extra


def blocks_held(prompt_len: int, num_output_tokens: int, block_size: int, **loop) -> int:
    """The whole blocks those slots take (a last block half full is still a block)."""
    return cdiv(tokens_held(prompt_len, num_output_tokens, **loop), block_size)


def pool_tokens(num_blocks: int, block_size: int) -> int:
    """The `kv_cache_tokens` that gives exactly `num_blocks` usable blocks (the null block is
    added beside them)."""
    return num_blocks * block_size


def pool_bytes(num_blocks: int, block_size: int, bytes_per_token: int) -> int:
    """The `kv_cache_memory_bytes` that gives exactly `num_blocks` usable blocks: the bytes also
    pay for the null block."""
    return (num_blocks + 1) * block_size * bytes_per_token


def usable_blocks(kv_cache_tokens: int, block_size: int) -> int:
    """The blocks a pool of `kv_cache_tokens` hands out."""
    return cdiv(kv_cache_tokens, block_size)


def requests_at_once(num_blocks: int, prompt_len: int, num_output_tokens: int, block_size: int,
                     **loop) -> int:
    """How many equal requests `num_blocks` usable blocks hold to their end at once."""
    return num_blocks // blocks_held(prompt_len, num_output_tokens, block_size, **loop)


__all__ = ["cdiv", "tokens_held", "blocks_held", "pool_tokens", "pool_bytes", "usable_blocks",
           "requests_at_once"]

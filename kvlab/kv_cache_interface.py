"""What each layer's KV needs, the groups the pool is shared by, and what the pool holds.

Defined in notebook 09. vLLM describes each attention layer's cache with a spec
(`vllm/v1/kv_cache_interface.py`): a full-attention layer keeps every token's K/V, a
sliding-window layer only its last `sliding_window` tokens' worth. Layers with equal specs form
**KV cache groups** of equal size (`vllm/v1/core/kv_cache_planning.py`,
`_get_kv_cache_groups_uniform_page_size`); each group has its own block table per request, and
all groups draw their block ids from ONE pool. A block id names the same slot range in every
layer of every group: layer j of group A and layer j of group B share one tensor and never hold
the same block id at once. So a block costs one group's layers, not the model's, and a pool of
the same bytes holds more blocks the more groups there are.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that attends over every earlier token (vLLM's FullAttentionSpec)."""

    block_size: int
    page_size_bytes: int  # one layer's K and V for one block

    def max_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """The blocks a request of max_model_len holds at most: all of them."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A layer whose token at position p attends to positions p - sliding_window + 1 .. p
    (vLLM's SlidingWindowSpec; transformers' "sliding_attention" layers)."""

    block_size: int
    page_size_bytes: int
    sliding_window: int

    def max_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """vLLM's `SlidingWindowSpec.max_admission_blocks_per_request`: blocks are freed on the
        tokens already processed, so a request holds the window's last tokens plus whatever
        steps are still in flight, and one block more, since the window need not start at a
        block's edge (blocks of 4 and a 6-token window [CDEF] take two: [XXCD][EF])."""
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers (by index) that share one block table per request, and their common spec."""

    layers: tuple[int, ...]
    spec: KVCacheSpec


def layer_specs(layer_types: list[str], sliding_window: int | None, block_size: int,
                page_size_bytes: int) -> list[KVCacheSpec]:
    """One spec per layer, from transformers' `layer_types` ("full_attention" or
    "sliding_attention") and `sliding_window`, as vLLM's model code reads them
    (`vllm/model_executor/models/llama.py`)."""
    specs: list[KVCacheSpec] = []
    for i, kind in enumerate(layer_types):
        if kind == FULL_ATTENTION:
            specs.append(FullAttentionSpec(block_size, page_size_bytes))
        elif kind == SLIDING_ATTENTION:
            if sliding_window is None:
                raise ValueError(f"layer {i} is a sliding_attention layer but sliding_window "
                                 "is not set")
            specs.append(SlidingWindowSpec(block_size, page_size_bytes, sliding_window))
        else:
            raise ValueError(f"layer {i}: layer type {kind!r}; kvlab runs {FULL_ATTENTION!r} "
                             f"and {SLIDING_ATTENTION!r}")
    return specs


def get_kv_cache_groups(specs: list[KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group the layers as vLLM 0.33.0 does for specs of one page size
    (`_get_kv_cache_groups_uniform_page_size`): layers with equal specs together, in the order
    each spec first appears; then every group cut to one size, the smallest type's layer count
    (or the largest's, when no type has 1.5 times another's layers), type i's layers dealt out
    round-robin (`layers[i::num_groups]`). A type whose count is not a multiple of the size
    gets a short group: vLLM pads it with padding layers that cost memory; kvlab refuses it."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    if len(by_spec) == 1:
        (spec, layers), = by_spec.items()
        return [KVCacheGroupSpec(tuple(layers), spec)]
    sizes = [len(layers) for layers in by_spec.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for spec, layers in by_spec.items():
        if len(layers) % group_size:
            raise ValueError(
                f"{len(layers)} layers of one type cannot be cut into groups of {group_size}: "
                "vLLM would add padding layers (memory spent on no layer); kvlab runs layer "
                "patterns whose type counts divide evenly")
        num_groups = len(layers) // group_size
        groups += [KVCacheGroupSpec(tuple(layers[i::num_groups]), spec)
                   for i in range(num_groups)]
    return groups


def bytes_per_block(groups: list[KVCacheGroupSpec]) -> int:
    """One block id's memory: a page in every layer of the largest group (vLLM's
    `_get_kv_cache_bytes_per_block`)."""
    return max(len(g.layers) * g.spec.page_size_bytes for g in groups)


def max_concurrency(groups: list[KVCacheGroupSpec], num_blocks: int, max_model_len: int,
                    max_in_flight_tokens: int) -> float:
    """vLLM's `get_max_concurrency_for_kv_cache_config` (vllm/v1/core/kv_cache_utils.py): the
    pool's blocks over the blocks one request of max_model_len takes from every group's table
    at most (the null block included in the pool, as vLLM counts it)."""
    per_request = sum(g.spec.max_blocks_per_request(max_model_len, max_in_flight_tokens)
                      for g in groups)
    return num_blocks / per_request


def capacity_line(groups: list[KVCacheGroupSpec], num_blocks: int, max_model_len: int,
                  max_in_flight_tokens: int, device: str = "GPU") -> tuple[int, float, str]:
    """The start-up line vLLM 0.33.0 logs (`update_kv_cache_capacity`), its token count and
    its concurrency. Its "KV cache size" is the concurrency times max_model_len: on a hybrid
    model that is not the tokens the pool holds, which are more."""
    concurrency = max_concurrency(groups, num_blocks, max_model_len, max_in_flight_tokens)
    tokens = int(concurrency * max_model_len)
    line = (f"{device} KV cache size: {tokens:,} tokens, Maximum concurrency for "
            f"{max_model_len:,} tokens per request: {concurrency:.2f}x")
    return tokens, concurrency, line

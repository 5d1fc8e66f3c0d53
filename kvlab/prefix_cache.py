"""Block hashes for prefix caching: one key per full block that stands for the whole prefix.

Defined in notebook 05; the salt is the subject of 06. A full block's key is

    hash(parent block's key, this block's token ids, extra keys)

so two requests get the same key for block i only if their tokens agree from the first token
through the end of block i, and their extra keys agree. The only extra key today is
`cache_salt`, mixed into the first block alone: since every later key chains from the first,
a salt changes the whole chain. (vLLM's extra keys also carry LoRA adapter names and multimodal
input hashes; `block_extra_keys` is where those would go.)

Keys are cryptographic digests (hashlib, sha256 by default) over a canonical byte encoding.
Python's builtin `hash` is not used: it changes between processes (hash randomisation) and its
64 bits invite collisions, and a collision here would hand one request another's KV. vLLM moved
to sha256 by default for the same reasons.
"""

from __future__ import annotations

import hashlib
import struct

HASH_ALGOS = ("sha256", "sha512", "blake2b")
BlockHash = bytes


def encode_block(parent: BlockHash | None, token_ids, extra_keys: tuple) -> bytes:
    """A canonical, unambiguous byte string: every field tagged and length-prefixed."""
    parts = [b"P", struct.pack("<I", len(parent or b"")), parent or b""]
    parts += [b"T", struct.pack("<I", len(token_ids)), struct.pack(f"<{len(token_ids)}q", *token_ids)]
    for name, value in extra_keys:
        for field in (name, value):
            data = field.encode("utf-8")
            parts += [b"E", struct.pack("<I", len(data)), data]
    return b"".join(parts)


def hash_block_tokens(parent: BlockHash | None, token_ids, extra_keys: tuple = (),
                      algo: str = "sha256") -> BlockHash:
    return hashlib.new(algo, encode_block(parent, token_ids, extra_keys)).digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple:
    """Extra keys of one block: the salt goes into block 0 only (the chain carries it on)."""
    if block_index == 0 and cache_salt is not None:
        return (("cache_salt", cache_salt),)
    return ()


def extend_block_hashes(hashes: list[BlockHash], get_tokens, num_tokens: int, block_size: int,
                        cache_salt: str | None, algo: str = "sha256") -> None:
    """Append, in place, the keys of the full blocks among the first `num_tokens` tokens that
    are not hashed yet. `get_tokens(start, end)` returns tokens [start, end)."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else None
        block = get_tokens(i * block_size, (i + 1) * block_size)
        hashes.append(hash_block_tokens(parent, block, block_extra_keys(i, cache_salt), algo))


def get_request_block_hasher(block_size: int, algo: str = "sha256"):
    """The function that brings a request's block keys up to date, as vLLM's Request calls its
    block hasher (vllm/v1/request.py; get_request_block_hasher in
    vllm/v1/core/kv_cache_utils.py): when the request is created, for its prompt's full blocks,
    and whenever a token is appended, for a block that token fills."""

    def hash_request_blocks(request) -> None:
        extend_block_hashes(request.block_hashes, request.token_ids, request.num_tokens,
                            block_size, request.cache_salt, algo)

    return hash_request_blocks

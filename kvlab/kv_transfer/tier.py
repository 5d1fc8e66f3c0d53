"""Where blocks go when they leave the pool: files.

On a GPU vLLM's native offloading keeps its second tier in pinned host memory, a slower and
bigger place than the GPU's. Here the pool is host memory already, so the second tier is a
file: every block written is a `pwrite` through the kernel and every block read a `preadv`,
the bytes copied each way. The operating system may keep the file in its page cache; what a
load costs here is measured (chapter 10, `kvlab.bench.offload`), never assumed.

- `SlotFile`: one file of a fixed number of block-sized slots (the offloading tier; its size is
  `cpu_bytes_to_use`, as vLLM's CPU buffer is).
- `BlockFolder`: one file per block, named by the block's key, in a folder two processes
  share (disaggregated prefill); a file appears whole or not at all (written, then renamed).

A block here is one pool block across every layer: (layers, 2, block_size, kv heads,
head dim) values, the tier's block the pool's block, as vLLM's offloading defaults to.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> np.ndarray:
    """The pool's blocks `block_ids`, every layer, as host bytes: (n, block bytes)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    data = kv_cache.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    return data.view(torch.uint8).reshape(len(block_ids), -1).numpy()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], data: np.ndarray) -> None:
    """Write host bytes (n, block bytes) into the pool's blocks `block_ids`, every layer."""
    layers, two, _, bs, heads, dim = kv_cache.shape
    blocks = torch.from_numpy(data).view(kv_cache.dtype).reshape(
        len(block_ids), layers, two, bs, heads, dim).permute(1, 2, 0, 3, 4, 5)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    kv_cache.index_copy_(2, index, blocks.to(kv_cache.device))


def block_nbytes(kv_cache: torch.Tensor) -> int:
    layers, two, _, bs, heads, dim = kv_cache.shape
    return layers * two * bs * heads * dim * kv_cache.element_size()


class SlotFile:
    """A file of `num_slots` slots of `block_bytes` each, in `folder` (None: the system's
    temporary folder). The file has no name once open (a temporary file) and goes when the
    engine does."""

    def __init__(self, num_slots: int, block_bytes: int, folder: str | None = None) -> None:
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self._file = tempfile.TemporaryFile(dir=folder, prefix="kvlab-tier-")
        os.ftruncate(self._file.fileno(), num_slots * block_bytes)

    def write(self, slots: list[int], data: np.ndarray) -> None:
        fd = self._file.fileno()
        for slot, row in zip(slots, data):
            if os.pwrite(fd, row, slot * self.block_bytes) != self.block_bytes:
                raise OSError(f"short write to tier slot {slot}")

    def read(self, slots: list[int]) -> np.ndarray:
        out = np.empty((len(slots), self.block_bytes), dtype=np.uint8)
        fd = self._file.fileno()
        for slot, row in zip(slots, out):
            if os.preadv(fd, [row], slot * self.block_bytes) != self.block_bytes:
                raise OSError(f"short read from tier slot {slot}")
        return out

    def close(self) -> None:
        self._file.close()


class BlockFolder:
    """One file per block key in `folder`, which several processes may share."""

    def __init__(self, folder: str, block_bytes: int) -> None:
        self.folder, self.block_bytes = folder, block_bytes
        os.makedirs(folder, exist_ok=True)

    def path(self, key: bytes) -> str:
        return os.path.join(self.folder, key.hex() + ".kv")

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def write(self, keys: list[bytes], data: np.ndarray) -> None:
        for key, row in zip(keys, data):
            final = self.path(key)
            if os.path.exists(final):
                continue  # the same key is the same tokens: already there
            tmp = f"{final}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(row.tobytes())
            os.replace(tmp, final)  # whole or not at all, for a reader in another process

    def read(self, keys: list[bytes]) -> np.ndarray:
        out = np.empty((len(keys), self.block_bytes), dtype=np.uint8)
        for key, row in zip(keys, out):
            with open(self.path(key), "rb") as f:
                if f.readinto(memoryview(row)) != self.block_bytes:
                    raise OSError(f"short read of block {key.hex()[:12]}")
        return out

"""What the device decides: the dtype `dtype="auto"` means, and the default KV pool's size.

Defined for notebook 00 (`LLM()` with no arguments), read in 07 (the GPU section). vLLM keeps
the same decisions in `vllm/platforms/` (`supported_dtypes` in `cuda.py` and `cpu.py`) and
`vllm/config/model.py` (`_resolve_auto_dtype`). Everything here reads the device through
`torch.cuda`'s own queries, so tests fake a T4 or an H200 by monkeypatching them.
"""

from __future__ import annotations

import functools
import warnings

import torch

# The share of this process's GPU memory (after the weights) one engine's default KV pool
# takes. A notebook cell `llm = LLM(...)` builds the new engine while the old one still holds
# its pool (the name is rebound only after), so two pools live at once for a moment: two
# thirds of the memory, the last third for activations.
DEFAULT_GPU_KV_FRACTION = 1 / 3
DEFAULT_CPU_KV_BYTES = 512 * 2**20


def supported_dtypes(device: torch.device) -> list[torch.dtype]:
    """The dtypes this device computes natively, preferred first (vLLM's rule)."""
    if device.type != "cuda":
        # A CPU is exact and fast in fp32 (vLLM's CPU platform prefers bf16 on x86 servers; a
        # workshop laptop may lack native bf16, and kvlab's CPU tests compare exact tokens).
        return [torch.float32]
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 0):  # Ampere, Ada, Hopper, Blackwell
        return [torch.bfloat16, torch.float16, torch.float32]
    if (major, minor) >= (6, 0):
        # Pascal, Volta, Turing (the T4 of hosted notebooks): bf16 is emulated there, and
        # SDPA's memory-efficient kernel and Triton (compiled flex) refuse it.
        return [torch.float16, torch.float32]
    return [torch.float32]


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bfloat16 in hardware (x86: AVX512-BF16 or AMX), and what says
    so. Without it, torch runs bfloat16 matmuls by converting to float32 and back. vLLM's CPU
    platform lists bfloat16 first on every x86 CPU (`supported_dtypes` in
    vllm/platforms/cpu.py); kvlab only measures the difference (chapter 08)."""
    if torch.cpu._is_amx_tile_supported():
        return True, "AMX tiles"
    if torch.cpu._is_avx512_bf16_supported():
        return True, "AVX512-BF16"
    return False, f"no AVX512-BF16 or AMX (torch's CPU capability: " \
        f"{torch.backends.cpu.get_cpu_capability()})"


def resolve_auto_dtype(device: torch.device) -> torch.dtype:
    """`dtype="auto"`: the device's preferred dtype, with vLLM's warning when a GPU cannot take
    bfloat16 (the dtype auto picks on every newer GPU)."""
    dtype = supported_dtypes(device)[0]
    if device.type == "cuda" and dtype != torch.bfloat16:
        major, minor = torch.cuda.get_device_capability(device)
        warnings.warn(
            f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) does "
            f"not support bfloat16; dtype='auto' falls back to {str(dtype)[6:]}", stacklevel=3)
    return dtype


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse bfloat16 on a GPU below compute capability 8.0, as vLLM does
    (`check_if_supports_dtype` in `vllm/platforms/cuda.py`): there it is emulated, slow, and
    refused by SDPA's memory-efficient kernel and by Triton (compiled flex)."""
    if device.type == "cuda" and dtype == torch.bfloat16 and \
            torch.bfloat16 not in supported_dtypes(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"dtype='bfloat16' needs a GPU of compute capability 8.0 or more; "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use dtype='auto' "
            "(float16 there) or dtype='float16'")


def default_kv_tokens(device: torch.device, kv_bytes_per_token: int, weight_bytes: int) -> int:
    """The default KV pool, in tokens (when `kv_cache_tokens` is not given).

    On a GPU: a fixed share of the memory this process can use, less the weights, the same for
    every engine the process builds, so that engines in one notebook agree (and compiled flex,
    whose graphs depend on the pool's size, compiles for one pool). `weight_bytes` is a
    constant of the model, counted whether or not a copy is on the device yet.
    """
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES // kv_bytes_per_token
    usable = process_gpu_memory(str(device)) - weight_bytes
    return max(0, int(usable * DEFAULT_GPU_KV_FRACTION)) // kv_bytes_per_token


@functools.cache
def process_gpu_memory(device: str) -> int:
    """The GPU memory this process can use, measured once (at its first engine's start).

    What the driver reports free shrinks by every pool an engine holds and grows back when one
    is freed and `empty_cache` runs; free plus what torch's caching allocator already reserved
    (the weights, pools alive or freed, which this process reuses) does not: it is the device
    less the CUDA context and other processes. Measured once, so that what drifts outside
    torch (kernels loaded by a compile) cannot move the next engine's pool by a block.
    """
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)

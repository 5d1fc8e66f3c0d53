"""KV cache precision: vLLM's `kv_cache_dtype`, quantized where K/V are written, dequantized
where attention reads them.

The pool's bytes are the KV budget; storing each K/V value in fewer bits holds more
tokens in the same bytes. The names are vLLM 0.33.0's (`CacheDType` in `vllm/config/cache.py`);
the modes are its `KVQuantMode`s (`vllm/v1/kv_cache_interface.py`):

| kv_cache_dtype | stored as | scale | bytes per (token, KV head), K and V, D = head_dim |
|---|---|---|---|
| auto | the model's dtype | - | 2 * D * itemsize |
| float16, bfloat16 | that dtype | - | 2 * D * 2 |
| fp8 (= fp8_e4m3), fp8_e5m2 | float8 | one per tensor, 1.0 | 2 * D |
| fp8_per_token_head, int8_per_token_head | float8 / int8 | fp32 per (token, head) | 2 * (D + 4) |
| int4_per_token_head | two 4-bit values a byte | fp32 per (token, head) | 2 * (D / 2 + 4) |

Per-token-head scales are computed when the token is written: one absmax per (token, head) for
K and one for V (vLLM: `_reshape_cache_per_token_head` in
`vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`, scale = absmax / 127 (int8) or /448
(fp8), at least 1e-6, round half away from zero). int4 follows
`vllm/v1/attention/ops/int4_per_token_head.py`: each head's vector is first rotated by a
randomized Hadamard transform (sign flips, then Hadamard: outlier channels spread over all
channels, so 16 levels cover the vector better), then quantized asymmetrically (min to max in
15 steps, a 4-bit zero point), even channel in the low nibble, odd in the high; the zero point
hides in the low 4 mantissa bits of the fp32 scale, so the scale costs 4 bytes. The scales are
stored in a tensor of their own beside the pool, indexed by the same block ids, and count in the
pool's bytes (vLLM's Triton backend packs them into the same page: `customize_spec` in
`vllm/v1/attention/backends/triton_attn.py` adds 2 x 4 bytes per (token, head)).

Where kvlab differs from vLLM:
- Every backend dequantizes the blocks it reads into the compute dtype and attends as before;
  vLLM's kernels dequantize inside attention, tile by tile, and never hold a dequantized copy.
- int4 rotates K/V back after dequantizing (x = y R^T); vLLM rotates q instead and the output
  back (`unified_attention_int4`), which avoids rotating the whole context.
- fp8 per-tensor scales are 1.0: kvlab loads no checkpoint scales. vLLM reads per-layer
  k_scale/v_scale from a checkpoint and uses 1.0 when there are none (with a warning:
  `vllm/model_executor/layers/quantization/kv_cache.py`).
- vLLM requires an explicit float16/bfloat16 kv_cache_dtype to match the model's dtype
  (`VllmConfig._reject_mismatched_float_kv_cache`, `vllm/config/vllm.py`), and so does kvlab
  (`check_float_kv_cache_dtype`): bf16 K/V comes with a bf16 model.
- vLLM's CPU backend (`vllm/v1/attention/backends/cpu_attn.py`) takes auto, float16, bfloat16
  and the fp8 names, those only on AVX-512 or AMX, no per-token-head mode; here every mode runs
  on any CPU, in plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# What kvlab accepts. vLLM's other names (nvfp4, turboquant_*, ...) are refused by name.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                   "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")
ALIASES = {"fp8": "fp8_e4m3"}  # vLLM: fp8 means fp8_e4m3 (vllm/config/cache.py)
SCALE_MIN = 1e-6  # vLLM's floor on a per-token-head scale: an all-zero head stays finite


@dataclass(frozen=True)
class KVCacheDType:
    """One resolved kv_cache_dtype: how a K/V value is stored and scaled."""

    name: str  # vLLM's name, alias resolved ("fp8" -> "fp8_e4m3")
    storage: str | None  # torch dtype name of the stored values; None: the model's dtype
    scales: str = "none"  # "none" | "per_tensor" | "per_token_head"
    values_per_byte: int = 1  # int4: 2
    qmax: float = 0.0  # largest stored magnitude (int8: 127, float8_e4m3fn: 448)

    @property
    def is_quantized(self) -> bool:
        return self.scales != "none"

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.storage is None else getattr(torch, self.storage)

    def is_identity(self, model_dtype: torch.dtype) -> bool:
        """K/V stored exactly as the model computes them: the plain pool tensor."""
        return not self.is_quantized and self.storage_dtype(model_dtype) == model_dtype

    def bytes_per_token_head(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in one KV head of one layer, scales included."""
        itemsize = self.storage_dtype(model_dtype).itemsize
        scale = 4 if self.scales == "per_token_head" else 0  # one fp32 for K, one for V
        return 2 * (head_dim // self.values_per_byte * itemsize + scale)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int,
                        model_dtype: torch.dtype) -> int:
        """K and V of one token, every layer and KV head: what a token costs the pool."""
        return num_layers * num_kv_heads * self.bytes_per_token_head(head_dim, model_dtype)


_SPECS = {
    "auto": KVCacheDType("auto", None),
    "float16": KVCacheDType("float16", "float16"),
    "bfloat16": KVCacheDType("bfloat16", "bfloat16"),
    "fp8_e4m3": KVCacheDType("fp8_e4m3", "float8_e4m3fn", "per_tensor", qmax=448.0),
    "fp8_e5m2": KVCacheDType("fp8_e5m2", "float8_e5m2", "per_tensor", qmax=57344.0),
    "fp8_per_token_head": KVCacheDType("fp8_per_token_head", "float8_e4m3fn", "per_token_head",
                                       qmax=448.0),
    "int8_per_token_head": KVCacheDType("int8_per_token_head", "int8", "per_token_head",
                                        qmax=127.0),
    "int4_per_token_head": KVCacheDType("int4_per_token_head", "uint8", "per_token_head",
                                        values_per_byte=2, qmax=15.0),
}


def check_float_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> None:
    """vLLM refuses a float16/bfloat16 kv_cache_dtype that differs from the model's dtype
    (VllmConfig._reject_mismatched_float_kv_cache in vllm/config/vllm.py): storing a float32
    model's K/V in bfloat16 is not one of its options. Same rule, same message."""
    if name not in ("float16", "bfloat16"):
        return
    model_name = str(model_dtype).removeprefix("torch.")
    if model_name == name:
        return
    allowed = f"`auto` or `{model_name}`" if model_name in ("float16", "bfloat16") else "`auto`"
    raise ValueError(f'kv_cache_dtype="{name}" is incompatible with dtype="{model_name}". '
                     f"Please set `--kv-cache-dtype` to {allowed}.")


def get_kv_cache_dtype(name) -> KVCacheDType:
    """The KVCacheDType for a vLLM name; refuses an unknown name (listing the supported ones)
    and a dtype this torch build cannot store, before anything is allocated."""
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                        f"{type(name).__name__} {name!r}")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is not supported by kvlab; choose one of "
                         f"{KV_CACHE_DTYPES}")
    spec = _SPECS[ALIASES.get(name, name)]
    if spec.storage is not None and not isinstance(getattr(torch, spec.storage, None),
                                                   torch.dtype):
        raise ValueError(f"kv_cache_dtype={name!r} stores torch.{spec.storage}, which this "
                         f"torch build ({torch.__version__}) does not have; use "
                         "int8_per_token_head or bfloat16, or a newer torch")
    return spec


# ---- quantize (on write) and dequantize (on read), one (token, head) vector at a time --------


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (vLLM's kernels; torch.round would
    round halves to even)."""
    return torch.trunc(x + 0.5 * torch.sign(x))


def hadamard_rotation(head_dim: int, device, dtype=torch.float32) -> torch.Tensor:
    """An orthonormal (D, D) matrix R = diag(signs) H / sqrt(b), H the Sylvester Hadamard matrix
    of size b (the largest power of two dividing D; block-diagonal when b < D, as vLLM's
    single_rht). Fixed signs from a fixed seed, so every engine rotates the same way.
    y = x @ R spreads each channel over all channels; x = y @ R.T undoes it."""
    b = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = torch.ones((1, 1))
    while h.shape[0] < b:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    gen = torch.Generator(device="cpu").manual_seed(23)
    signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
    rot = torch.block_diag(*[h] * (head_dim // b)) / b**0.5
    return (signs[:, None] * rot).to(device=device, dtype=dtype)


def quantize(spec: KVCacheDType, x: torch.Tensor, storage: torch.dtype,
             rotation: torch.Tensor | None, kv_scale: float = 1.0):
    """x: (..., D) in the compute dtype -> (stored (..., D / values_per_byte), scales (...) fp32
    or None)."""
    if spec.scales == "none":
        return x.to(storage), None
    if spec.scales == "per_tensor":
        # Saturate: a value past the format's range would become NaN (e4m3fn has no inf).
        return (x.float() / kv_scale).clamp(-spec.qmax, spec.qmax).to(storage), None
    x = x.float()
    if spec.values_per_byte == 2:  # int4: rotate, then min..max in 15 steps
        x = x @ rotation
        lo, hi = x.amin(-1), x.amax(-1)
        scale = ((hi - lo) / spec.qmax).clamp_min(SCALE_MIN)
        zero = round_half_away(-lo / scale).clamp(0, spec.qmax)
        q = round_half_away(x / scale[..., None] + zero[..., None]).clamp(0, spec.qmax)
        q = q.to(torch.uint8)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)  # even channel low nibble, odd high
        # The zero point rides in the scale's 4 low mantissa bits (a relative change of at
        # most 2**-19): the scale still costs 4 bytes.
        bits = (scale.view(torch.int32) & -16) | zero.to(torch.int32)
        return packed, bits.view(torch.float32)
    scale = (x.abs().amax(-1) / spec.qmax).clamp_min(SCALE_MIN)  # symmetric, per (token, head)
    y = x / scale[..., None]
    if storage.is_floating_point:  # fp8: the cast rounds
        return y.clamp(-spec.qmax, spec.qmax).to(storage), scale
    return round_half_away(y).clamp(-spec.qmax - 1, spec.qmax).to(storage), scale  # int8


def dequantize(spec: KVCacheDType, stored: torch.Tensor, scales: torch.Tensor | None,
               dtype: torch.dtype, rotation: torch.Tensor | None,
               kv_scale: float = 1.0) -> torch.Tensor:
    """The inverse of `quantize`: (..., D / values_per_byte) -> (..., D) in `dtype`."""
    if spec.scales == "none":
        return stored.to(dtype)
    if spec.scales == "per_tensor":
        return (stored.float() * kv_scale).to(dtype)
    if spec.values_per_byte == 2:
        bits = scales.view(torch.int32)
        zero = (bits & 15).float()
        scale = (bits & -16).view(torch.float32)
        q = torch.stack((stored & 15, stored >> 4), dim=-1).flatten(-2).float()  # (..., D)
        y = (q - zero[..., None]) * scale[..., None]
        return (y @ rotation.T).to(dtype)
    return (stored.float() * scales[..., None]).to(dtype)


# ---- the pool ------------------------------------------------------------------------------


class QuantizedKVCache:
    """The KV pool at a precision other than the model's: the stored values

        data: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim / values_per_byte)

    and, for per-token-head modes, their scales beside them, indexed by the same block ids:

        scales: (num_layers, 2, num_blocks, block_size, num_kv_heads) float32

    `shape` and `dtype` are what attention reads: K/V of (.., head_dim) in the compute dtype.
    `kv_cache[layer]` is that layer's `QuantizedKVLayer`, which every backend reads through.
    """

    def __init__(self, spec: KVCacheDType, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if head_dim % spec.values_per_byte:
            raise ValueError(f"kv_cache_dtype={spec.name!r} packs {spec.values_per_byte} "
                             f"values a byte: head_dim {head_dim} must be a multiple of it")
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.shape = torch.Size((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim))
        self.storage = spec.storage_dtype(dtype)
        # Zeros, as the plain pool: padded reads of unused slots must be finite.
        self.data = torch.zeros((*self.shape[:-1], head_dim // spec.values_per_byte),
                                dtype=self.storage, device=device)
        self.scales = (torch.zeros(self.shape[:-1], dtype=torch.float32, device=device)
                       if spec.scales == "per_token_head" else None)
        self.kv_scale = 1.0  # per-tensor modes: vLLM's value when a checkpoint brings none
        self.rotation = (hadamard_rotation(head_dim, device) if spec.values_per_byte == 2
                         else None)

    @property
    def nbytes(self) -> int:
        """The pool's bytes, scales included (what kv_cache_memory_bytes pays for)."""
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def __getitem__(self, layer: int) -> QuantizedKVLayer:
        return QuantizedKVLayer(self, layer)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks, every layer: the values and their scales travel together."""
        self.data[:, :, dst] = self.data[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]


class QuantizedKVLayer:
    """One layer of a QuantizedKVCache: `write` quantizes a step's K/V into its slots; `gather`
    and `read_rows` dequantize blocks for attention."""

    def __init__(self, cache: QuantizedKVCache, layer: int) -> None:
        self.cache, self.spec = cache, cache.spec
        self.data = cache.data[layer]  # (2, num_blocks, block_size, Hkv, D / values_per_byte)
        self.scales = None if cache.scales is None else cache.scales[layer]  # (2, nb, bs, Hkv)
        self.shape = cache.shape[1:]  # (2, num_blocks, block_size, Hkv, D), as read
        self.dtype, self.device = cache.dtype, cache.device

    def _dequantize(self, stored, scales):
        c = self.cache
        return dequantize(self.spec, stored, scales, c.dtype, c.rotation, c.kv_scale)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: (T, Hkv, D) -> their slots, quantized (the scales into the same slots)."""
        num_kv_heads = k.shape[1]
        c = self.cache
        for i, x in enumerate((k, v)):
            stored, scales = quantize(self.spec, x, c.storage, c.rotation, c.kv_scale)
            self.data[i].view(-1, num_kv_heads, stored.shape[-1])[slot_mapping] = stored
            if scales is not None:
                self.scales[i].view(-1, num_kv_heads)[slot_mapping] = scales

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks, dequantized: each (len(block_ids), block_size, Hkv, D)."""
        s = self.scales
        k = self._dequantize(self.data[0][block_ids], None if s is None else s[0][block_ids])
        v = self._dequantize(self.data[1][block_ids], None if s is None else s[1][block_ids])
        return k, v

    def read_rows(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """The batched decode path's copy: rows of the layer seen as (2 * num_blocks, one block)
        (K blocks, then V blocks), dequantized into `out` (len(index), block_size * Hkv * D)."""
        _, num_blocks, block_size, num_kv_heads, head_dim = self.shape
        rows = self.data.view(2 * num_blocks, block_size, num_kv_heads, -1)[index]
        scales = None if self.scales is None else self.scales.view(
            2 * num_blocks, block_size, num_kv_heads)[index]
        out.view(len(index), block_size, num_kv_heads, head_dim).copy_(
            self._dequantize(rows, scales))

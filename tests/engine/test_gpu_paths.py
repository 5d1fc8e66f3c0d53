"""The CUDA paths, proved on a CPU: the GPU a participant brings is faked through torch.cuda's own
queries (capability, name, memory) and the device's tensors live on the meta device, where any
read of a value fails. Covers: the dtype `auto` picks per GPU, the default pool's size, the
eager-flex guard, the flex compile failure's message, SDPA calls a fused kernel accepts, and the
host syncs and copies of one decode step."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kvlab import LLM, SamplingParams, platforms
from kvlab.engine import EngineStepError, LLMEngine
from kvlab.flex_attention import FlexCompileError, check_eager_flex
from kvlab.model import resolve_dtype

CUDA = torch.device("cuda")


def fake_gpu(monkeypatch, capability, name="NVIDIA H200", free=100 * 2**30, reserved=0):
    """torch.cuda answers as if this GPU were present."""
    state = {"free": free, "reserved": reserved}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (state["free"], 141 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    platforms.process_gpu_memory.cache_clear()
    return state


@pytest.fixture(autouse=True)
def _clear_memory_cache():
    yield
    platforms.process_gpu_memory.cache_clear()


# ---------------------------------------------------------------- dtype="auto", per GPU


@pytest.mark.parametrize("capability, name, expected", [
    ((9, 0), "NVIDIA H200", torch.bfloat16),
    ((8, 0), "NVIDIA A100-SXM4-40GB", torch.bfloat16),
    ((8, 9), "NVIDIA L4", torch.bfloat16),
])
def test_auto_is_bfloat16_from_compute_capability_8(monkeypatch, capability, name, expected):
    fake_gpu(monkeypatch, capability, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on these
        assert resolve_dtype("auto", CUDA) == expected
    assert resolve_dtype("bfloat16", CUDA) == torch.bfloat16


@pytest.mark.parametrize("capability, name", [((7, 5), "Tesla T4"), ((7, 0), "Tesla V100"),
                                              ((6, 0), "Tesla P100")])
def test_auto_is_float16_with_a_warning_on_6_0_to_7_5(monkeypatch, capability, name):
    fake_gpu(monkeypatch, capability, name)
    with pytest.warns(UserWarning, match=f"{name}.*{capability[0]}.{capability[1]}.*float16"):
        assert resolve_dtype("auto", CUDA) == torch.float16
    # bfloat16 asked for explicitly is refused with the way out, as vLLM refuses it.
    with pytest.raises(ValueError, match="compute capability 8.0.*float16"):
        resolve_dtype("bfloat16", CUDA)
    assert resolve_dtype("float16", CUDA) == torch.float16
    assert resolve_dtype("float32", CUDA) == torch.float32


def test_auto_is_float32_before_6_0_and_on_a_cpu(monkeypatch):
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    fake_gpu(monkeypatch, (5, 2), "Tesla M60")
    with pytest.warns(UserWarning, match="float32"):
        assert resolve_dtype("auto", CUDA) == torch.float32


def test_the_real_model_s_activations_fit_float16(loaded):
    """On the T4 path the residual stream is float16. The packaged model's largest activation
    (a few outlier features, ~25,000 after layer 11 on these prompts) must stay below float16's
    65,504 with room to spare, and kvlab run in float16 must give finite logits and the fp32
    tokens."""
    from kvlab.bench.activations import largest_activations

    found = largest_activations(loaded)
    assert 1000 < found["max_abs"] < torch.finfo(torch.float16).max / 2, found
    llm16 = LLM(dtype="float16", device="cpu", kv_cache_tokens=512, max_model_len=256)
    llm32 = LLM(dtype="float32", device="cpu", kv_cache_tokens=512, max_model_len=256)
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    prompt = "The capital of France is"
    o16, o32 = llm16.generate(prompt, sp)[0].outputs[0], llm32.generate(prompt, sp)[0].outputs[0]
    assert all(torch.isfinite(torch.tensor(list(lp.values()))).all() for lp in o16.logprobs)
    assert o16.token_ids == o32.token_ids


# ---------------------------------------------------------------- the default KV pool


def test_every_engine_of_a_process_gets_the_same_default_pool(monkeypatch, loaded):
    gpu = fake_gpu(monkeypatch, (9, 0), free=100 * 2**30, reserved=3 * 2**30)
    engine = types.SimpleNamespace(loaded=loaded, device=CUDA, kv_bytes_per_token=23040)
    first = LLMEngine._default_kv_tokens(engine)
    weights = sum(p.numel() * p.element_size() for p in loaded.hf_model.parameters())
    usable = 103 * 2**30 - 2 * weights
    assert first == int(usable * platforms.DEFAULT_GPU_KV_FRACTION) // 23040
    # The first engine's pool, made on the meta device: it leaves the driver's free memory
    # and joins torch's reserved memory. The next engine's pool is the same size.
    pool = torch.empty((first, 23040), dtype=torch.uint8, device="meta")
    pool_bytes = pool.numel() * pool.element_size()
    gpu["free"] -= pool_bytes
    gpu["reserved"] += pool_bytes
    assert LLMEngine._default_kv_tokens(engine) == first
    # Also measured afresh: free + reserved did not move.
    platforms.process_gpu_memory.cache_clear()
    assert LLMEngine._default_kv_tokens(engine) == first
    # A compile's kernels load outside torch's allocator: the next engine still agrees.
    gpu["free"] -= 50 * 2**20
    assert LLMEngine._default_kv_tokens(engine) == first
    # Two pools alive at once (`llm = LLM(...)` builds the new one before the old one goes)
    # leave a third of the memory for activations.
    assert 2 * pool_bytes <= usable * 2 / 3 + 1


def test_the_cpu_default_pool_is_fixed():
    assert platforms.default_kv_tokens(torch.device("cpu"), 46080, 10**9) == \
        platforms.DEFAULT_CPU_KV_BYTES // 46080


# ---------------------------------------------------------------- flex on CUDA


def test_eager_flex_is_refused_on_cuda_beyond_a_small_pool():
    # An H200's default pool (millions of slots) under a 2,048-token budget: refused, with why.
    with pytest.raises(ValueError, match=r"enforce_eager=True.*9 heads x 2048 rows x "
                                         r"3000000 slots.*GiB.*kv_cache_tokens to \d+"):
        check_eager_flex(3_000_000, 9, 2048, CUDA, enforce_eager=True)
    check_eager_flex(3_000_000, 9, 2048, CUDA, enforce_eager=None)  # compiled on CUDA: fine
    check_eager_flex(3_000_000, 9, 2048, CUDA, enforce_eager=False)
    check_eager_flex(16_384, 9, 2048, CUDA, enforce_eager=True)  # a small pool: allowed
    check_eager_flex(3_000_000, 9, 2048, torch.device("cpu"), enforce_eager=True)  # CPU: allowed


def test_a_flex_compile_failure_names_the_way_out(monkeypatch, text_ids):
    """A GPU whose Triton cannot build the kernel (Turing's shared memory): the first step
    fails with one readable error naming backend='auto', and the engine stays usable."""
    import kvlab.flex_attention as fa

    def compiled():
        def kernel(*args, **kwargs):
            raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: shared "
                               "memory, Required: 98304, Hardware limit: 65536.\n...page 2...")
        return kernel

    monkeypatch.setattr(fa, "compiled_flex_attention", compiled)
    llm = LLM(backend="flex", enforce_eager=False, device="cpu", kv_cache_tokens=512,
              max_model_len=256)
    with pytest.raises(EngineStepError) as info:
        llm.generate({"prompt_token_ids": text_ids[:20]}, SamplingParams(max_tokens=2))
    cause = info.value.cause
    assert isinstance(cause, FlexCompileError)
    message = str(cause)
    assert "backend='auto'" in message and "shared memory" in message
    assert "page 2" not in message  # the first line only; the rest is in __cause__
    assert llm.stats()["num_used_blocks"] == 0


# ---------------------------------------------------------------- SDPA: fused kernels only


def test_sdpa_calls_need_no_gqa_broadcast_and_masks_match_the_queries(monkeypatch, text_ids,
                                                                    hf_greedy):
    """On CUDA no fused SDPA kernel takes `enable_gqa` beside a mask (and below compute
    capability 8.0, none takes it at all): every call must bring as many K/V heads as query
    heads, and a mask in the queries' dtype. Whole prompts, chunks after cached blocks and
    decodes all appear, and the tokens are still transformers'."""
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        calls.append((q.shape[-3], k.shape[-3], enable_gqa, is_causal,
                      None if attn_mask is None else attn_mask.dtype, q.dtype))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    prompts = [text_ids[:70], text_ids[:90], text_ids[5:30]]
    expected = [hf_greedy(p, 6) for p in prompts]  # transformers' own calls are not recorded
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    for backend in ("auto", "reference"):
        llm = LLM(backend=backend, device="cpu", max_num_batched_tokens=48,
                  enable_prefix_caching=True, kv_cache_tokens=1024, max_model_len=256)
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        for _ in range(2):  # the second pass starts after cached blocks: chunks with a mask
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls
    assert all(hq == hkv and not gqa for hq, hkv, gqa, *_ in calls)
    assert all(mask is None or mask == q for *_, mask, q in calls)
    assert any(causal for *_, causal, _, _ in calls)  # whole prompts
    assert any(mask is not None for *_, mask, _ in calls)  # chunks and decodes


# ---------------------------------------------------------------- syncs of one decode step


class TransferCounter(TorchFunctionMode):
    """Every host<->device transfer a step makes, with the device's tensors on meta: a value
    read from a meta tensor (item, tolist, bool(), torch.equal, .cpu()) is a sync on a GPU; an
    op that takes a host tensor (or Python data, for torch.tensor) and makes a meta tensor is
    a host-to-device copy."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
             "equal", "allclose", "__array__"}

    def __init__(self):
        super().__init__()
        self.syncs, self.copies = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_meta = any(t.device.type == "meta" for t in tensors)
        if name in self.READS and on_meta:
            self.syncs.append(name)
        out = func(*args, **kwargs)
        made_on_meta = isinstance(out, torch.Tensor) and out.device.type == "meta"
        from_host = any(t.device.type == "cpu" and t.dim() > 0 for t in tensors)
        if made_on_meta and (from_host or name in ("tensor", "as_tensor")):
            self.copies.append(name)
        if name == "to" and on_meta and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self.syncs.append("to(cpu)")
        return out


def meta_runner(engine: LLMEngine, backend: str, kv_cache_dtype: str = "auto"):
    """The engine's model runner rebuilt with the model and the pool on the meta device; its
    sampler answers token 7 for every row without reading the logits (the sampler's own one
    transfer is counted in tests/engine/test_sampling.py)."""
    from transformers import AutoModelForCausalLM

    from kvlab.attention import get_attention_backend
    from kvlab.kv_cache import allocate_kv_cache
    from kvlab.model import LoadedModel, Transformer
    from kvlab.model_runner import ModelRunner
    from kvlab.sampling import SamplerOutput

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(engine.loaded.config)
    meta = torch.device("meta")
    loaded = LoadedModel("meta", hf.eval(), engine.tokenizer, meta, torch.float32)
    model = Transformer(loaded, fast=True, attn_backend=get_attention_backend(backend, True))
    cfg = engine.config
    kv = allocate_kv_cache(model.num_layers, cfg.num_blocks, cfg.block_size, model.num_kv_heads,
                           model.head_dim, torch.float32, meta, kv_cache_dtype)

    class Sampler:
        def __call__(self, logits, params, generators):
            assert logits.device == meta and logits.shape[0] == len(params)
            return SamplerOutput([7] * len(params), [None] * len(params))

    return ModelRunner(model, kv, meta, Sampler())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8_per_token_head",
                                            "int4_per_token_head"])
@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_a_decode_step_makes_no_sync_and_two_copies(backend, kv_cache_dtype, text_ids,
                                                    monkeypatch):
    """Quantizing on write and dequantizing on read (`kv_cache_dtype`) add no sync and no copy: the
    scales live on the device beside the blocks, the int4 rotation is made once."""
    if backend == "flex":
        # FlexAttention refuses meta tensors: its kernel stands in (the mask it is given,
        # built and moved by kvlab each step, is what is counted).
        import torch.nn.attention.flex_attention as flex

        monkeypatch.setattr(flex, "flex_attention",
                            lambda q, k, v, block_mask=None, **kw: torch.empty_like(q))
    llm = LLM(backend=backend, device="cpu", kv_cache_tokens=1024, max_model_len=256)
    engine = llm.llm_engine
    engine.model_runner = meta_runner(engine, backend, kv_cache_dtype)
    engine.model.attn_backend = engine.model_runner.attn_backend
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": text_ids[i : i + 20 + 9 * i]},
                           SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.step()  # the prefills
    counted = []
    for _ in range(3):  # decode steps: every request one token
        with TransferCounter() as counter:
            engine.step()
        assert engine.last_scheduler_output.num_decode_tokens == 4
        counted.append((counter.syncs, counter.copies))
    # No value read from the device outside the sampler; one copy of the step's tokens,
    # positions and slots, one of the backend's metadata.
    assert counted == [([], ["to", "to"])] * 3, counted


def test_the_forward_is_timed_by_events_not_a_device_wide_sync(monkeypatch):
    """On CUDA the runner times the forward with two events and reads them once the sampler's
    transfer has waited for the device: never torch.cuda.synchronize(), one more stall."""
    from kvlab.model_runner import ForwardTimer

    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.name = f"event{sum(c == 'new' for c in calls)}"
            calls.append("new")

        def record(self):
            calls.append(f"record {self.name}")

        def synchronize(self):
            calls.append(f"synchronize {self.name}")

        def elapsed_time(self, end):
            calls.append(f"elapsed {self.name}->{end.name}")
            return 12.5  # ms

    def no_sync():
        raise AssertionError("torch.cuda.synchronize() called")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    timer = ForwardTimer(CUDA)
    timer.stop()
    assert timer.seconds() == 0.0125
    assert calls == ["new", "new", "record event0", "record event1", "synchronize event1",
                     "elapsed event0->event1"]

"""The process holds the weights once: the fast path's packed copies, not transformers' beside
them. transformers' pages go back to the kernel and return when transformers runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvlab.model import page_out


def file_resident_mib() -> float:
    """This process's resident pages that are mapped from files, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="page_out uses Linux's madvise(MADV_PAGEOUT)")


@linux_only
def test_page_out_drops_a_file_mapped_tensors_pages_and_its_values_come_back(tmp_path):
    values = np.arange(16 * 2**20, dtype=np.float32)  # 64 MiB
    path = tmp_path / "weights.bin"
    values.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c"))  # as safetensors maps
    expected = torch.from_numpy(values)
    assert torch.equal(mapped, expected)  # every page read: resident
    before = file_resident_mib()
    advised = page_out([mapped, mapped[10:]])  # a view of the same storage is advised once
    after = file_resident_mib()
    if advised == 0:
        pytest.skip("this kernel does not know MADV_PAGEOUT (Linux < 5.4)")
    assert advised <= mapped.numel() * 4 and advised > 63 * 2**20
    assert before - after > 60  # the pages left the process
    assert torch.equal(mapped, expected)  # read back from the file, unchanged


@linux_only
def test_page_out_keeps_anonymous_memory_intact():
    """Pages with no file behind them go to swap or stay: the advice never loses data."""
    t = torch.randn(2**20)
    copy = t.clone()
    page_out([t])
    assert torch.equal(t, copy)


ENGINE_SCRIPT = r"""
import json, torch
from kvlab import LLM, SamplingParams, load_model
from kvlab.model import use_onednn
def file_mib():
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("RssFile:"))
loaded = load_model()
params = sum(p.numel() * p.element_size() for p in loaded.hf_model.parameters()) / 2**20
sum(float(p.sum()) for p in loaded.hf_model.parameters())  # every page of the weights resident
read = file_mib()
llm = LLM(max_model_len=64, kv_cache_memory_bytes=8 << 20)
built = file_mib()
out = llm.generate("The cache", SamplingParams(max_tokens=8, temperature=0))[0]
ids = torch.tensor([out.prompt_token_ids])
ref = loaded.hf_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               pad_token_id=loaded.tokenizer.eos_token_id)
print(json.dumps({"params": params, "read": read, "built": built, "after_hf": file_mib(),
                  "onednn": use_onednn(loaded), "same": ref[0, ids.shape[1]:].tolist() ==
                  list(out.outputs[0].token_ids)}))
"""


@linux_only
@pytest.mark.slow
def test_an_engine_leaves_transformers_weights_to_the_file_until_transformers_runs(tmp_path):
    """Where the fast path packs its own copies (fp32 on a CPU), building an engine hands
    transformers' pages back; transformers then reads them again and its tokens still equal
    kvlab's. In a process of its own: the resident sizes are the process's."""
    # A copy of the converted weights of its own: the kernel reclaims only pages that this
    # process alone maps, and this test session (its `loaded` fixture) maps the shared copy.
    from kvlab.model import packaged_model_folder

    folder = packaged_model_folder()
    shutil.copytree(folder, tmp_path / folder.name)
    env = {**os.environ, "KVLAB_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"]
    if not out["onednn"]:
        pytest.skip("no oneDNN packing here: the fast path shares transformers' weights")
    # Most of the weights' pages left when the engine was built, and came back with transformers.
    assert out["read"] - out["built"] > 0.8 * out["params"], out
    assert out["after_hf"] - out["built"] > 0.8 * out["params"], out

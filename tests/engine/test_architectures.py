"""The same loading and forward code runs Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms).

No hub: tiny randomly initialised checkpoints are written to a temporary folder, loaded through
`LLM(model=<folder>)` like any local checkpoint, and checked against transformers `generate`.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers import assert_no_blocks_held
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from kvlab import LLM, SamplingParams
from kvlab.model import packaged_model_folder

TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    # A wide initialisation makes logits peaked, so greedy choices are not near-ties that
    # float reduction order could flip.
    initializer_range=0.5,
)


def tiny_checkpoint(tmp_path, config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    # Any tokenizer with a large enough vocabulary will do: the packaged one is at hand.
    AutoTokenizer.from_pretrained(packaged_model_folder()).save_pretrained(tmp_path)
    return model.eval()


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**TINY, head_dim=16, tie_word_embeddings=False),  # untied head
        Qwen2Config(**TINY, tie_word_embeddings=True),  # q/k/v projections with bias
        Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False),  # q_norm / k_norm
    ],
    ids=["llama-untied", "qwen2-bias", "qwen3-qknorm"],
)
def test_local_folder_of_each_architecture(tmp_path, config):
    hf = tiny_checkpoint(tmp_path, config)
    llm = LLM(str(tmp_path), block_size=4, kv_cache_tokens=512, max_model_len=128)
    assert llm.llm_engine.loaded.config.model_type == config.model_type
    prompts = [[5, 17, 300, 2000, 9], list(range(100, 133))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    assert_no_blocks_held(llm)


def test_packaged_cache_folder_loads_as_a_local_checkpoint(hf_greedy, text_ids):
    """The de-quantised cache is an ordinary transformers folder: LLM(model=folder) works."""
    llm = LLM(str(packaged_model_folder()), max_model_len=256, kv_cache_tokens=1024)
    out = llm.generate({"prompt_token_ids": text_ids[:20]},
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(text_ids[:20], 8)


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path))

"""The largest values a model's activations reach: whether float16 can hold them.

float16 tops out at 65,504 (bfloat16 has float32's range). On a GPU without bfloat16 (the T4)
`dtype="auto"` runs float16 (kvlab/platforms.py), and a residual stream that grows past that
range turns into inf, then NaN. RMSNorm and the logits are computed in float32 (model.py), so
what must fit is the residual stream between layers and each matmul's output, the MLP's
SwiGLU product above all (where outlier features live in trained LLMs).
"""

from __future__ import annotations

import torch

from kvlab.bench.common import BENCH_TEXT


def largest_activations(loaded, texts: list[str] | None = None) -> dict:
    """Run the transformers model (the same weights and arithmetic as kvlab's forward) in its
    loaded dtype over `texts` and a chat prompt; report the largest |value| of the residual
    stream and of every matmul's input and output, and where it was."""
    tok = loaded.tokenizer
    prompts = [tok(t).input_ids for t in (texts or [BENCH_TEXT * 8])]
    prompts.append(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True, tokenize=True, return_dict=False))
    found = {"residual": (0.0, ""), "matmul_input": (0.0, ""), "matmul_output": (0.0, "")}

    def note(kind: str, value: torch.Tensor, where: str) -> None:
        m = value.detach().abs().max().item()
        if m > found[kind][0]:
            found[kind] = (m, where)

    hooks = []
    for i, layer in enumerate(loaded.hf_model.model.layers):
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                def hook(mod, args, out, where=f"layer {i} {name}"):
                    note("matmul_input", args[0], where)
                    note("matmul_output", out, where)
                hooks.append(module.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            for ids in prompts:
                out = loaded.hf_model(torch.tensor([ids], device=loaded.device),
                                      output_hidden_states=True)
                # hidden_states: the embedding, then each layer's output (the residual stream)
                for i, h in enumerate(out.hidden_states[:-1]):
                    note("residual", h, f"after layer {i - 1}" if i else "embedding")
    finally:
        for h in hooks:
            h.remove()
    report = {f"{kind}_max": round(v, 1) for kind, (v, _) in found.items()}
    report.update({f"{kind}_where": where for kind, (_, where) in found.items()})
    report["max_abs"] = max(v for v, _ in found.values())
    report["tokens"] = sum(len(p) for p in prompts)
    return report

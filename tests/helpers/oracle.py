"""The Hugging Face transformers side of the parity tests: load a checkpoint, greedy-generate with it."""

from __future__ import annotations

import torch


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy tokens (EOS ignored), as ``SamplingParams(temperature=0, ignore_eos=True)``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()

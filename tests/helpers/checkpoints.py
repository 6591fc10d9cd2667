"""Tiny random-weight Hugging Face checkpoints, written with ``save_pretrained`` (the oracle's format)."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "initializer_range": 0.15, "bos_token_id": 1, "eos_token_id": 2,
}

# name -> (transformers config class, model class, overrides): together they cover tied/untied
# embeddings, llama3 rope scaling, GQA, Qwen2 bias, Qwen3 q/k norm with explicit head_dim, a
# sliding window shorter than the prompts.
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "llama_tied_linear": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True, "num_key_value_heads": 4, "attention_bias": True,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"tie_word_embeddings": False, "sliding_window": 48, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True, "head_dim": 32}),
}


def save_random_model(directory: Path, cfg_cls: str, model_cls: str, kwargs: dict, seed: int = 0,
                      dtype=torch.float32) -> Path:
    """Build transformers' ``model_cls`` with random weights from ``cfg_cls(**kwargs)`` and save it.

    ``rope_scaling`` is moved into ``rope_parameters`` (transformers >= 5 keeps it there); MoE routers'
    ``e_score_correction_bias`` buffers (zeros by default) get random values so the bias matters."""
    import transformers

    kwargs = dict(kwargs)
    rope = kwargs.pop("rope_scaling", None)
    config = getattr(transformers, cfg_cls)(**kwargs)
    if rope is not None:
        config.rope_parameters = {**rope, "rope_theta": 10000.0}
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def make_checkpoint(directory: Path, variant: str = "qwen3", seed: int = 0, dtype=torch.float32,
                    **overrides) -> Path:
    cfg_cls, model_cls, extra = VARIANTS[variant]
    return save_random_model(directory, cfg_cls, model_cls, {**BASE, **extra, **overrides}, seed, dtype)


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def bf16_copy(src: Path, dest: Path) -> Path:
    """``src`` saved again in bfloat16 (its floating tensors rounded, ``config.json``'s dtype saying so), as
    ``save_pretrained`` writes a bf16 model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest, dirs_exist_ok=True)
    for f in dest.glob("*.safetensors"):
        tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}
        save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    return dest

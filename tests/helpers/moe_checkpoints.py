"""Tiny random-weight MoE checkpoints (Qwen3-MoE, Mixtral) written with ``save_pretrained``.

Together the variants cover top-k 1, 2 and 8 of 8–16 experts, ``norm_topk_prob`` true and false,
``decoder_sparse_step`` 2 (dense layers between sparse ones) and ``mlp_only_layers``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.checkpoints import BASE

MOE_BASE = {**BASE, "num_hidden_layers": 2, "head_dim": 16}

MOE_VARIANTS = {
    "qwen3_moe_k2_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "tie_word_embeddings": True,
    }),
    "qwen3_moe_k1_e16": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 16, "num_experts_per_tok": 1, "moe_intermediate_size": 32, "norm_topk_prob": False,
        "mlp_only_layers": [0],
    }),
    "qwen3_moe_k8_step2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 8, "moe_intermediate_size": 32,
        "norm_topk_prob": False, "decoder_sparse_step": 2,
    }),
    "mixtral_k2": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": None, "intermediate_size": 48,
    }),
    "mixtral_k1_e16": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 16, "num_experts_per_tok": 1, "head_dim": None, "intermediate_size": 32,
        "sliding_window": 40,
    }),
}


def make_moe_checkpoint(directory: Path, variant: str, seed: int = 0, **overrides) -> Path:
    import transformers

    cfg_cls, model_cls, extra = MOE_VARIANTS[variant]
    kwargs = {**MOE_BASE, **extra, **overrides}
    if kwargs.get("head_dim") is None:
        kwargs.pop("head_dim")
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


_TOKENIZER_FILES: dict[str, bytes] = {}


def copy_with_tokenizer(checkpoint: Path, directory: Path) -> Path:
    """Copy ``checkpoint`` into ``directory`` and add a 512-id test tokenizer (trained once per process)."""
    import shutil

    from tests.helpers.tokenizer_factory import make_test_tokenizer

    shutil.copytree(checkpoint, directory)
    if not _TOKENIZER_FILES:
        tok_dir = make_test_tokenizer(directory / "_tok", "bytelevel", vocab_size=512)
        _TOKENIZER_FILES.update({f.name: f.read_bytes() for f in tok_dir.iterdir() if f.is_file()})
        shutil.rmtree(tok_dir)
    for name, data in _TOKENIZER_FILES.items():
        (directory / name).write_bytes(data)
    return directory

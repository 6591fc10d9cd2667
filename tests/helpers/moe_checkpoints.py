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
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "tie_word_embeddings": True,
    }),
    "qwen3_moe_k1_e16": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 16, "num_experts_per_tok": 1, "moe_intermediate_size": 32, "norm_topk_prob": False, "mlp_only_layers": [0],
    }),
    "qwen3_moe_k8_step2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 8, "moe_intermediate_size": 32, "norm_topk_prob": False,
        "decoder_sparse_step": 2,
    }),
    "mixtral_k2": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": None, "intermediate_size": 48,
    }),
    "mixtral_k1_e16": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 16, "num_experts_per_tok": 1, "head_dim": None, "intermediate_size": 32, "sliding_window": 40,
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

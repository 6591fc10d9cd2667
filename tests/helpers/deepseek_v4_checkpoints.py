"""A tiny random-weight DeepSeek-V4 checkpoint, saved with ``save_pretrained`` so transformers is the oracle.

Hidden 64, vocab 512, four layers: sliding only, CSA (compress rate 4, indexer top-3 of its entries),
HCA (compress rate 8), CSA; window 12; the first layer hash-routed; two residual streams; YaRN on
the compressed layers' rotary. transformers initializes several parameters to constants (the
compressors' slot biases, the attention sinks, the hyper-connection biases and scales, the router
bias and the hash table): they get random values here so that each one matters to the output.
"""

from __future__ import annotations

from pathlib import Path

import torch

DSV4_CONFIG = {
    "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32,
    "partial_rotary_factor": 0.5, "num_experts_per_tok": 2, "n_routed_experts": 8, "n_shared_experts": 1,
    "sliding_window": 12, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 16, "index_head_dim": 16,
    "index_topk": 3, "hc_mult": 2, "hc_sinkhorn_iters": 5, "max_position_embeddings": 512,
    "initializer_range": 0.15, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
}  # fmt: skip


def make_deepseek_v4_checkpoint(directory: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    config = transformers.DeepseekV4Config(**{**DSV4_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("position_bias", "sinks", "base", "hc_base", "e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape) * 0.5)
            elif leaf in ("scale", "hc_scale"):
                tensor.copy_(0.5 + torch.rand(tensor.shape))
            elif leaf == "tid2eid":
                tensor.copy_(torch.randint(0, config.n_routed_experts, tensor.shape))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory

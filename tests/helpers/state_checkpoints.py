"""Tiny random-weight checkpoints of models that keep a state instead of (or next to) a KV cache
(Mamba2, the Nemotron-H Mamba/attention hybrid, Qwen3-Next's Gated DeltaNet), saved with ``save_pretrained``
so transformers is the oracle. Hidden 64, vocab 512; SSD chunk 16, shorter than the test prompts."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.checkpoints import save_random_model

_COMMON = {"vocab_size": 512, "hidden_size": 64, "n_groups": 2, "chunk_size": 16, "conv_kernel": 4,
           "expand": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

STATE_VARIANTS = {
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {
        "num_heads": 8, "head_dim": 16, "state_size": 16, "num_hidden_layers": 2, "initializer_range": 0.15}),
    # M E * - M: Mamba, MoE (DeepSeek-V3 routing, relu² experts), attention (paged KV, no
    # rope), MLP (relu²), Mamba
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "max_position_embeddings": 512,
        "initializer_range": 0.15, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]}),
    # DeltaNet, DeltaNet (dense MLP), gated attention, DeltaNet; MoE with a gated shared expert
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [1], "max_position_embeddings": 512, "initializer_range": 0.15,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]}),
}


def make_state_checkpoint(directory: Path, variant: str, seed: int = 0, **overrides) -> Path:
    cfg_cls, model_cls, extra = STATE_VARIANTS[variant]
    return save_random_model(directory, cfg_cls, model_cls, {**_COMMON, **extra, **overrides}, seed)

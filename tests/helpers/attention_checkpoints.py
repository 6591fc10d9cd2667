"""Tiny random-weight checkpoints for the attention-variant tests (sliding window, Gemma, MLA), saved
with ``save_pretrained`` so transformers is the oracle. Sizes follow ``checkpoints.BASE``."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.checkpoints import BASE, save_random_model

# name -> (config class, model class, overrides)
ATTENTION_VARIANTS = {
    "mistral_w16": ("MistralConfig", "MistralForCausalLM",
                    {"sliding_window": 16, "head_dim": 16, "num_hidden_layers": 2}),
    "qwen2_window_layers": ("Qwen2Config", "Qwen2ForCausalLM", {
        "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1,
        "tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0, "num_hidden_layers": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 16, "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
}

_MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
ATTENTION_VARIANTS.update({
    # V2 without q LoRA, softmax group-limited routing, two shared experts, plain rope
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_MLA, "q_lora_rank": None, "n_shared_experts": 2, "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5}),
    # V3 with q LoRA, yarn rope (mscale), sigmoid noaux_tc routing with a random correction bias
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_MLA, "q_lora_rank": 24, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}}),
})


def make_attention_checkpoint(directory: Path, variant: str, seed: int = 0, **overrides) -> Path:
    cfg_cls, model_cls, extra = ATTENTION_VARIANTS[variant]
    return save_random_model(directory, cfg_cls, model_cls, {**BASE, **extra, **overrides}, seed)

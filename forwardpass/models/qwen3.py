"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE (and explicit head_dim)."""

from forwardpass.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass  # ModelSpec sets qk_norm for Qwen3 (and its q/k/v/o bias from attention_bias)

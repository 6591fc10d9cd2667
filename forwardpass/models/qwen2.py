"""Qwen2: the Llama decoder with bias on q/k/v (not on o_proj)."""

from forwardpass.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass  # ModelSpec sets qkv_bias (and never o_bias) for Qwen2

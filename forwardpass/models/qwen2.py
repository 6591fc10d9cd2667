"""Qwen2: the Llama decoder with bias on q/k/v (not on o_proj)."""

from forwardpass.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass  # ModelSpec sets biases.qkv (and never biases.o) for Qwen2

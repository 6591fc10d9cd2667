"""Mistral: the Llama decoder with sliding-window attention on every layer (``sliding_window``)."""

from forwardpass.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass  # the sliding window is read from config.json by layer_sliding_windows()

"""Mistral: the Llama decoder with sliding-window attention on every layer (``spec.layer_windows``)."""

from forwardpass.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass  # ModelSpec gives every layer the config's sliding_window

"""Qwen2: the Llama decoder with bias on q/k/v (not on o_proj)."""

from forwardpass.loader.config import ModelConfig
from forwardpass.models.llama import DecoderFlavor, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flavor_for(cls, cfg: ModelConfig) -> DecoderFlavor:
        return DecoderFlavor(qkv_bias=True, o_bias=False)

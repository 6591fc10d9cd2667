"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE (and explicit head_dim)."""

from forwardpass.loader.config import ModelConfig
from forwardpass.models.llama import DecoderFlavor, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flavor_for(cls, cfg: ModelConfig) -> DecoderFlavor:
        bias = bool(cfg.get("attention_bias", False))
        return DecoderFlavor(qkv_bias=bias, o_bias=bias, qk_norm=True)

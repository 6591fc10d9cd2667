"""config.json ``architectures`` name → model class. Other modules (MoE, ...) register themselves here."""

from __future__ import annotations

import importlib
import importlib.util

from forwardpass.errors import UnsupportedArchitectureError

# name → "module:Class", imported on first use
_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "forwardpass.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "forwardpass.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "forwardpass.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "forwardpass.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "forwardpass.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "forwardpass.models.mixtral:MixtralForCausalLM",
    "Gemma2ForCausalLM": "forwardpass.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "forwardpass.models.gemma:Gemma3ForCausalLM",
    "DeepseekV2ForCausalLM": "forwardpass.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "forwardpass.models.deepseek:DeepseekV3ForCausalLM",
    "Mamba2ForCausalLM": "forwardpass.models.mamba:Mamba2ForCausalLM",
    "NemotronHForCausalLM": "forwardpass.models.mamba:NemotronHForCausalLM",
    "Qwen3NextForCausalLM": "forwardpass.models.qwen3_next:Qwen3NextForCausalLM",
    "DeepseekV4ForCausalLM": "forwardpass.models.deepseek_v4:DeepseekV4ForCausalLM",
    "BertModel": "forwardpass.models.bert:BertModel",
    "WhisperForConditionalGeneration": "forwardpass.models.whisper:WhisperForConditionalGeneration",
}

#: encoder-only architectures: they embed (``LLM(model, task="embed")``), they do not generate
EMBEDDING_ARCHITECTURES = frozenset({"BertModel"})


def is_embedding_architecture(architecture: str) -> bool:
    return architecture in EMBEDDING_ARCHITECTURES


def register_model(architecture: str, target: str) -> None:
    _REGISTRY[architecture] = target


def supported_architectures() -> list[str]:
    out = []
    for name, target in sorted(_REGISTRY.items()):
        if importlib.util.find_spec(target.split(":")[0]) is not None:
            out.append(name)
    return out


def resolve_model_class(architecture: str):
    target = _REGISTRY.get(architecture)
    if target is None or importlib.util.find_spec(target.split(":")[0]) is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} (config.json 'architectures') is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)

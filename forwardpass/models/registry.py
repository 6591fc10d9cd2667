"""config.json ``architectures`` name → model class, and → the derivation of its ``ModelSpec``.

Both are looked up by name and imported on first use, so listing an architecture costs nothing. A family whose
config keys differ from the common core's (``models/model_spec.py::decoder_spec``) names its derivation, in a
module next to its model (``models/*_spec.py``); ``ModelSpec.from_config`` asks :func:`spec_derivation` by
architecture, then by ``model_type`` (configs name the family there too), and falls back to the common core.

An architecture defined outside ``forwardpass/`` registers itself with :func:`register_model` (its class, and
its derivation where it has one) and is then loaded like any other (``docs/adding-a-model.md``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from forwardpass.errors import UnsupportedArchitectureError

if TYPE_CHECKING:  # type-only: models/model_spec.py asks this registry (no import cycle)
    from forwardpass.models.model_spec import SpecDerivation

#: a model class, or ``"module:Class"`` imported on first use
Target = type | str
#: ``derive(config mapping, display name) -> ModelSpec``, or ``"module:function"``
Derivation = "SpecDerivation | str"

# name → "module:Class", imported on first use
_REGISTRY: dict[str, Target] = {
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

_LLAMA, _GEMMA, _DEEPSEEK = "forwardpass.models.llama_spec", "forwardpass.models.gemma_spec:gemma_spec", \
    "forwardpass.models.deepseek_spec:deepseek_spec"
_MAMBA = "forwardpass.models.mamba_spec:mamba_spec"
_DSV4 = "forwardpass.models.deepseek_v4_spec:deepseek_v4_spec"
_QWEN3_NEXT = "forwardpass.models.qwen3_next_spec:qwen3_next_spec"
_WHISPER, _BERT = "forwardpass.models.whisper_spec:whisper_spec", "forwardpass.models.bert_spec:bert_spec"

# architecture → its spec derivation (architectures not listed: the common core)
_SPECS: dict[str, Derivation] = {
    "MistralForCausalLM": f"{_LLAMA}:mistral_spec",
    "MixtralForCausalLM": f"{_LLAMA}:mistral_spec",
    "Qwen2ForCausalLM": f"{_LLAMA}:qwen2_spec",
    "Qwen3ForCausalLM": f"{_LLAMA}:qwen3_spec",
    "Qwen3MoeForCausalLM": f"{_LLAMA}:qwen3_spec",
    "GemmaForCausalLM": _GEMMA,
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "Gemma3ForConditionalGeneration": _GEMMA,
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    "DeepseekV4ForCausalLM": _DSV4,
    "Mamba2ForCausalLM": _MAMBA,
    "NemotronHForCausalLM": _MAMBA,
    "Qwen3NextForCausalLM": _QWEN3_NEXT,
    "WhisperForConditionalGeneration": _WHISPER,
    "BertModel": _BERT,
}
# config.json model_type → its spec derivation, for configs whose architecture is not listed above
_SPEC_MODEL_TYPES: dict[str, Derivation] = {
    "mistral": f"{_LLAMA}:mistral_spec",
    "mixtral": f"{_LLAMA}:mistral_spec",
    "qwen2": f"{_LLAMA}:qwen2_spec",
    "qwen3": f"{_LLAMA}:qwen3_spec",
    "qwen3_moe": f"{_LLAMA}:qwen3_spec",
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "gemma3": _GEMMA,
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v4": _DSV4,
    "mamba2": _MAMBA,
    "nemotron_h": _MAMBA,
    "qwen3_next": _QWEN3_NEXT,
    "whisper": _WHISPER,
    "bert": _BERT,
}

#: encoder-only architectures: they embed (``LLM(model, task="embed")``), they do not generate
EMBEDDING_ARCHITECTURES = frozenset({"BertModel"})


def is_embedding_architecture(architecture: str) -> bool:
    return architecture in EMBEDDING_ARCHITECTURES


def register_model(
    architecture: str, target: Target, *, spec: Derivation | None = None, model_types: tuple[str, ...] = ()
) -> None:
    """Make ``architecture`` loadable: ``target`` is its model class (or ``"module:Class"``), ``spec`` the
    function deriving its ``ModelSpec`` from config.json (None: the common core's ``decoder_spec``), also used
    for configs of the ``model_types`` given whose architecture is not registered."""
    _REGISTRY[architecture] = target
    if spec is not None:
        _SPECS[architecture] = spec
        for model_type in model_types:
            _SPEC_MODEL_TYPES[model_type] = spec


def unregister_model(architecture: str) -> None:
    """Forget an architecture registered with :func:`register_model` (and the model types it named)."""
    _REGISTRY.pop(architecture, None)
    spec = _SPECS.pop(architecture, None)
    for model_type in [t for t, d in _SPEC_MODEL_TYPES.items() if spec is not None and d is spec]:
        del _SPEC_MODEL_TYPES[model_type]


def spec_derivation(architecture: str, model_type: str = "") -> SpecDerivation | None:
    """The derivation of a config's spec: its architecture's, else its model type's; None: the common core."""
    found = _SPECS.get(architecture) or _SPEC_MODEL_TYPES.get(model_type)
    return _resolve(found) if found is not None else None


def _resolve(target: Any) -> Any:
    if not isinstance(target, str):
        return target
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _available(target: Target) -> bool:
    return not isinstance(target, str) or importlib.util.find_spec(target.split(":")[0]) is not None


def supported_architectures() -> list[str]:
    return [name for name, target in sorted(_REGISTRY.items()) if _available(target)]


def resolve_model_class(architecture: str) -> Any:
    target = _REGISTRY.get(architecture)
    if target is None or not _available(target):
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} (config.json 'architectures') is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return _resolve(target)

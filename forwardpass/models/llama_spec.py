"""The specs of the Llama family (``models/llama.py``: Llama, Mistral, Qwen2, Qwen3 and their MoE variants):
the common core (``models/model_spec.py::decoder_spec``) plus each architecture's few differences."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from forwardpass.models.model_spec import Biases, ModelSpec, decoder_spec


def mistral_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Mistral / Mixtral: without ``layer_types``, every layer slides by ``sliding_window``
    (as HF's Mistral does)."""
    spec = decoder_spec(cfg, name)
    if spec.moe and _mixtral(cfg):
        spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, renormalize_topk=True))
    window = cfg.get("sliding_window")
    if window and not cfg.get("layer_types"):
        spec = dataclasses.replace(spec, layer_windows=(int(window),) * spec.layers)
    return spec


def _mixtral(cfg: Mapping[str, Any]) -> bool:
    """Mixtral, which always renormalizes the chosen experts' weights."""
    return (cfg.get("model_type") == "mixtral"
            or (cfg.get("architectures") or [""])[0] == "MixtralForCausalLM")


def qwen2_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Qwen2 always has q/k/v biases and never an o_proj bias (HF Qwen2Attention ignores
    ``attention_bias``)."""
    return decoder_spec(cfg, name, biases=Biases(qkv=True))


def qwen3_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Qwen3 / Qwen3-MoE: a per-head RMSNorm on q and k before RoPE."""
    return decoder_spec(cfg, name, qk_norm=True)

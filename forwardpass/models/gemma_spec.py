"""The spec of Gemma 2 / 3 (``models/gemma.py``): what Gemma's keys add to the common core (``GemmaSpec``).

The query scale (``query_pre_attn_scalar ** -0.5``), the tanh-caps of attention scores and output logits
(``attn_logit_softcapping`` / ``final_logit_softcapping``), Gemma 3's per-layer-type rotary
(``rope_parameters`` keyed by layer type, or the older ``rope_theta`` / ``rope_local_base_freq``) and its q/k
norms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelSpec,
    RopeSpec,
    architecture,
    decoder_spec,
    opt_float,
    rope_parameters,
)


@dataclass(frozen=True)
class GemmaSpec(ModelFamily):
    """What Gemma's layers add (``ModelSpec.family``); counted as the ordinary decoder (``models/family.py``).
    A spec without it (built by hand) gets these defaults."""

    attn_scale: float | None = None  # query scale (query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # tanh-cap of attention scores (Gemma 2)
    final_logit_softcap: float | None = None  # tanh-cap of the output logits (Gemma 2)
    local_rope_theta: float | None = None  # rope base of sliding layers when it differs (Gemma 3)

    @staticmethod
    def of(spec: ModelSpec) -> GemmaSpec:
        return spec.family if isinstance(spec.family, GemmaSpec) else GemmaSpec()


def gemma_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Gemma 2 / 3: the common core, with Gemma 3's rotary bases, then the scale and soft-caps (the scale
    needs the resolved ``head_dim``)."""
    given: dict[str, Any] = {"qk_norm": architecture(cfg) == "Gemma3ForCausalLM"}
    local_theta = None
    if str(cfg.get("model_type") or "").startswith("gemma3"):
        theta, scaling, local_theta = gemma3_rope(cfg)
        given["rope"] = RopeSpec(theta, scaling)
    spec = decoder_spec(cfg, name, **given)
    return dataclasses.replace(spec, family=GemmaSpec(
        attn_scale=float(cfg.get("query_pre_attn_scalar") or spec.head_dim) ** -0.5,
        attn_logit_softcap=opt_float(cfg.get("attn_logit_softcapping")),
        final_logit_softcap=opt_float(cfg.get("final_logit_softcapping")),
        local_rope_theta=local_theta,
    ))


def gemma3_rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3: ``rope_parameters`` keyed by layer type (transformers >= 5), or the older
    ``rope_theta`` / ``rope_scaling`` (global layers) and ``rope_local_base_freq`` (sliding layers)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(FULL_ATTENTION), Mapping):
        full = dict(params[FULL_ATTENTION])
        local = params.get(SLIDING_ATTENTION) or {}
        theta = float(full.pop("rope_theta", 1_000_000.0))
        scaling = full if full.get("rope_type", "default") != "default" else None
        return theta, scaling, float(local.get("rope_theta", 10_000.0))
    _, scaling = rope_parameters(cfg)
    return (float(cfg.get("rope_theta") or 1_000_000.0), scaling,
            float(cfg.get("rope_local_base_freq") or 10_000.0))

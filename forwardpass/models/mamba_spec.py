"""The spec of Mamba2 and Nemotron-H (``models/mamba.py``): ``SSMSpec`` and the derivation that reads their
keys.

Mamba2: every layer a Mamba2 mixer (``num_heads`` / ``head_dim`` / ``state_size``). Nemotron-H: a hybrid whose
``layers_block_type`` (or the older ``hybrid_override_pattern`` string ``M`` / ``*`` / ``-`` / ``E``) says
what each layer mixes with: a Mamba2 mixer (``mamba_num_heads`` / ``mamba_head_dim`` / ``ssm_state_size``),
attention, an MLP (relu², not gated) or a MoE with DeepSeek-V3 routing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from forwardpass.errors import ConfigError
from forwardpass.models.deepseek_spec import deepseek_moe
from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import (
    MIXER_ATTENTION,
    MIXER_MAMBA,
    MIXER_MLP,
    MIXER_MOE,
    ModelSpec,
    architecture,
    decoder_spec,
    json_float,
    require,
)
from forwardpass.models.state_ops import state_layer_ops

if TYPE_CHECKING:
    from forwardpass.op_cost import OpCost


@dataclass(frozen=True)
class SSMSpec(ModelFamily):
    """A Mamba2 mixer's sizes (Mamba2 ``num_heads`` / ``head_dim`` / ``state_size``; Nemotron-H
    ``mamba_num_heads`` / ``mamba_head_dim`` / ``ssm_state_size``), the family of Mamba2 and Nemotron-H:
    each layer one mixer (Mamba2, attention, MLP or MoE) after one norm."""

    spec_attribute: ClassVar[str] = "ssm"  # read as ``spec.ssm`` by the family's model

    heads: int
    head_dim: int
    state: int  # N: the SSM state per head is [head_dim, N]
    groups: int  # B and C are shared by heads / groups heads
    conv_kernel: int
    chunk: int  # the SSD scan's chunk length (config chunk_size)
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj bias
    norm_eps: float = 1e-5
    dt_min: float = 0.0  # the prefill scan clamps dt to [dt_min, dt_max] (HF time_step_limit)
    dt_max: float = float("inf")
    mlp_gated: bool = True  # False: Nemotron-H's relu² MLP and experts (up -> act -> down)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C."""
        return self.inner + 2 * self.groups * self.state

    @property
    def conv_state_size(self) -> int:
        """Values of the conv window kept per request: the last ``conv_kernel - 1`` inputs."""
        return self.conv_dim * (self.conv_kernel - 1)

    @property
    def ssm_state_size(self) -> int:
        return self.heads * self.head_dim * self.state

    @property
    def state_size(self) -> int:
        """Values one request keeps per Mamba layer, whatever its length."""
        return self.conv_state_size + self.ssm_state_size

    @property
    def params(self) -> int:
        """in_proj (z, xBC, dt), conv weights and bias, A, D, dt_bias, gated norm, out_proj."""
        in_proj = self.inner + self.conv_dim + self.heads
        return (self.hidden_in * in_proj + self.conv_dim * (self.conv_kernel + 1) + 3 * self.heads
                + self.inner + self.inner * self.hidden_in)

    hidden_in: int = 0  # the model's hidden size (for ``params``)

    # ---- the family's terms (models/family.py) ------------------------------------------------------
    def dense_layers(self, s: ModelSpec) -> int:
        return sum(1 for m in s.layer_mixers if m == MIXER_MLP)

    def norm_params(self, s: ModelSpec) -> int:
        """One norm per block (the mixer's own gated norm is in ``params``)."""
        return s.hidden

    def total_norm_params(self, s: ModelSpec) -> int:
        return s.layers * self.norm_params(s)

    def router_params(self, s: ModelSpec) -> int:
        return s.hidden * s.moe.num_experts if s.moe else 0  # Nemotron-H's shared expert has no gate

    def mixer_params(self, s: ModelSpec) -> int:
        return s.attention_layers * self.attention_params(s) + s.mamba_layers * self.params

    def state_bytes_per_sequence(self, s: ModelSpec, state_bytes: float) -> float:
        return s.mamba_layers * self.state_size * state_bytes

    def state_flops_per_token(self, s: ModelSpec) -> float:
        """Mamba2 decays the state, adds ``dt·x⊗B`` and reads it with ``C``: ~6 per state value."""
        return float(6 * s.mamba_layers * self.ssm_state_size)

    def mixer_ops(self, s: ModelSpec, stage: str, *, tokens: int, batch: int, wb: float,
                  ab: float) -> list[OpCost]:
        return state_layer_ops("mamba", s.mamba_layers, stage, tokens=tokens, batch=batch, hidden=s.hidden,
                               proj_out=self.inner + self.conv_dim + self.heads, conv_dim=self.conv_dim,
                               inner=self.inner, conv_kernel=self.conv_kernel, values=self.ssm_state_size,
                               state_values=self.state_size, wb=wb, ab=ab)


def mamba_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Mamba2 / Nemotron-H: layers, their mixers and the SSM sizes from the family's keys; attention sizes
    (where a layer attends) and the rest from the common core."""
    if cfg.get("model_type") not in ("mamba2", "nemotron_h"):  # registered by architecture: its model type
        cfg = {**cfg, "model_type": "nemotron_h" if architecture(cfg) == "NemotronHForCausalLM" else "mamba2"}
    hidden = int(require(cfg, "hidden_size", name))
    fields = ssm_fields(cfg, hidden)
    mixers, ssm = fields["layer_mixers"], fields["family"]
    heads = int(cfg.get("num_attention_heads") or ssm.heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads) if MIXER_ATTENTION in mixers else ssm.head_dim
    fields.setdefault("moe", None)  # Mamba2: no experts, whatever generic MoE keys the config has
    if MIXER_MLP not in mixers:
        fields["intermediate"] = 0  # no dense MLP layer (Mamba2: no MLP at all)
    return decoder_spec(cfg, name, hidden=hidden, layers=len(mixers), heads=heads, head_dim=head_dim,
                        layer_windows=(None,) * len(mixers), **fields)


_NEMOTRON_H_TYPES = {"linear_attention": MIXER_MAMBA, "full_attention": MIXER_ATTENTION, "mlp": MIXER_MLP,
                     "moe": MIXER_MOE}
_NEMOTRON_H_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def ssm_fields(cfg: Mapping[str, Any], hidden: int) -> dict[str, Any]:
    """Mamba2 (every layer a Mamba2 mixer) and Nemotron-H (``layers_block_type``, or the older
    ``hybrid_override_pattern`` string ``M`` / ``*`` / ``-``: Mamba2, attention, MLP, one per layer)."""
    model_type = cfg.get("model_type")
    if model_type == "mamba2":
        mixers = (MIXER_MAMBA,) * int(cfg.get("num_hidden_layers") or 0)
        heads, head_dim, state = cfg.get("num_heads"), cfg.get("head_dim"), cfg.get("state_size")
        mlp_gated = True
    elif model_type == "nemotron_h":
        types = cfg.get("layers_block_type")
        if types is None and isinstance(cfg.get("hybrid_override_pattern"), str):
            types = [_NEMOTRON_H_PATTERN.get(c, c) for c in cfg["hybrid_override_pattern"]]
        if not isinstance(types, list) or not types:
            raise ConfigError("a Nemotron-H config needs layers_block_type (or hybrid_override_pattern)",
                              param="layers_block_type")
        unknown = sorted({str(t) for t in types if t not in _NEMOTRON_H_TYPES})
        if unknown:
            raise ConfigError(f"layers_block_type has entries {unknown} that are not supported (supported: "
                              f"{sorted(_NEMOTRON_H_TYPES)})", param="layers_block_type")
        if MIXER_MOE in types and cfg.get("moe_latent_size"):
            raise ConfigError("Nemotron-H MoE layers with a latent projection (moe_latent_size) are not "
                              "supported", param="moe_latent_size")
        mixers = tuple(_NEMOTRON_H_TYPES[t] for t in types)
        heads, head_dim = cfg.get("mamba_num_heads"), cfg.get("mamba_head_dim")
        state = cfg.get("ssm_state_size")
        mlp_gated = False
    else:
        raise ConfigError(f"model_type {model_type!r} is neither mamba2 nor nemotron_h", param="model_type")
    if not mixers:
        raise ConfigError(f"a {model_type} config needs num_hidden_layers >= 1", param="num_hidden_layers")
    sizes = {"heads": heads, "head_dim": head_dim, "state": state, "groups": cfg.get("n_groups", 1),
             "conv_kernel": cfg.get("conv_kernel", 4), "chunk": cfg.get("chunk_size", 256)}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
            raise ConfigError(f"{model_type}: the Mamba2 {key} must be an integer in [1, 65536], got "
                              f"{value!r:.40}", param=key)
    if heads % sizes["groups"]:
        raise ConfigError(f"{model_type}: the Mamba2 heads ({heads}) must split into "
                          f"n_groups={sizes['groups']}", param="n_groups")
    if model_type == "mamba2" and int(cfg.get("expand") or 2) * hidden != heads * head_dim:
        raise ConfigError("mamba2: hidden_size * expand must equal num_heads * head_dim "
                          f"({heads * head_dim})",
                          param="num_heads")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    lo, hi = (json_float(v) for v in limit)
    if model_type == "nemotron_h":  # HF NemotronHMamba2Mixer: (time_step_min, inf), whatever the config says
        lo, hi = float(cfg.get("time_step_min") or 0.0), float("inf")
    ssm = SSMSpec(**sizes, conv_bias=bool(cfg.get("use_conv_bias", True)), mlp_gated=mlp_gated,
                  bias=bool(cfg.get("use_bias", False)),
                  norm_eps=float(cfg.get("layer_norm_epsilon") or 1e-5), dt_min=lo, dt_max=hi,
                  hidden_in=hidden)
    out: dict[str, Any] = {"layer_mixers": mixers, "family": ssm}
    if MIXER_MOE in mixers:  # DeepSeek-V3 routing (sigmoid, bias-corrected groups), non-gated relu² experts
        moe = deepseek_moe({**cfg, "model_type": "deepseek_v3",
                            "n_shared_experts": 0, "first_k_dense_replace": 0}, len(mixers), "")
        shared = cfg.get("moe_shared_expert_intermediate_size") or 0
        sparse = tuple(i for i, m in enumerate(mixers) if m == MIXER_MOE)
        out["moe"] = dataclasses.replace(moe, layer_ids=sparse, shared_expert_intermediate=int(shared))
    return out

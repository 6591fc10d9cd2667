"""The spec of Qwen3-Next (``models/qwen3_next.py``): ``GDNSpec`` and the derivation that reads its keys.

``layer_types`` of ``linear_attention`` (Gated DeltaNet, sized by the ``linear_*`` keys) and
``full_attention`` (gated attention with a partial rotary embedding and per-head q/k norms) layers, each
followed by its MLP or MoE.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from forwardpass.errors import ConfigError
from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import MIXER_ATTENTION, MIXER_GDN, ModelSpec, decoder_spec, require
from forwardpass.models.state_ops import state_layer_ops

if TYPE_CHECKING:
    from forwardpass.op_cost import OpCost


@dataclass(frozen=True)
class GDNSpec(ModelFamily):
    """A Gated DeltaNet layer's sizes (Qwen3-Next ``linear_*``): q/k heads of ``k_dim``, v heads of
    ``v_dim`` (a multiple of the k heads), a short causal conv over q, k, v; the family of Qwen3-Next
    (DeltaNet layers, and gated attention layers)."""

    spec_attribute: ClassVar[str] = "gdn"  # read as ``spec.gdn`` by the family's model

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    chunk: int = 64  # the chunked delta rule's block length (HF's torch_chunk_gated_delta_rule default)
    hidden_in: int = 0
    partial_rotary: float = 1.0  # fraction of the attention layers' head_dim that is rotated (0.25)

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def conv_state_size(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    @property
    def state_size(self) -> int:
        """Conv window plus one ``[k_dim, v_dim]`` matrix per value head."""
        return self.conv_state_size + self.v_heads * self.k_dim * self.v_dim

    @property
    def params(self) -> int:
        qkvz = 2 * self.k_heads * self.k_dim + 2 * self.v_heads * self.v_dim
        return (self.hidden_in * (qkvz + 2 * self.v_heads) + self.conv_dim * self.conv_kernel
                + 2 * self.v_heads + self.v_dim + self.v_heads * self.v_dim * self.hidden_in)

    # ---- the family's terms (models/family.py) ------------------------------------------------------
    def attention_params(self, s: ModelSpec) -> int:
        """Gated attention: q_proj gives a per-head output gate too."""
        return 2 * s.hidden * s.q_dim + 2 * s.hidden * s.kv_dim + s.hidden * s.q_dim

    def mixer_params(self, s: ModelSpec) -> int:
        return s.attention_layers * self.attention_params(s) + s.gdn_layers * self.params

    def state_bytes_per_sequence(self, s: ModelSpec, state_bytes: float) -> float:
        return s.gdn_layers * self.state_size * state_bytes

    def state_flops_per_token(self, s: ModelSpec) -> float:
        """The delta rule decays, predicts ``Sᵀk``, writes and reads with ``q``: ~8 per state value."""
        return float(8 * s.gdn_layers * self.v_heads * self.k_dim * self.v_dim)

    def mixer_ops(self, s: ModelSpec, stage: str, *, tokens: int, batch: int, wb: float,
                  ab: float) -> list[OpCost]:
        proj_out = 2 * self.k_heads * self.k_dim + 2 * self.v_heads * self.v_dim + 2 * self.v_heads
        return state_layer_ops("gdn", s.gdn_layers, stage, tokens=tokens, batch=batch, hidden=s.hidden,
                               proj_out=proj_out, conv_dim=self.conv_dim, inner=self.v_heads * self.v_dim,
                               conv_kernel=self.conv_kernel, values=self.v_heads * self.k_dim * self.v_dim,
                               state_values=self.state_size, wb=wb, ab=ab)


def qwen3_next_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Qwen3-Next: the layer kinds and DeltaNet sizes here, attention sizes and the MoE
    from the common core."""
    hidden = int(require(cfg, "hidden_size", name))
    fields = gdn_fields(cfg, hidden)
    n = len(fields["layer_mixers"])
    return decoder_spec(cfg, name, hidden=hidden, layers=n, layer_windows=(None,) * n, qk_norm=True, **fields)


def gdn_fields(cfg: Mapping[str, Any], hidden: int) -> dict[str, Any]:
    """Qwen3-Next: ``layer_types`` of ``linear_attention`` (Gated DeltaNet) and ``full_attention`` (gated
    attention with a partial rotary embedding) layers, each followed by its MLP or MoE."""
    types = cfg.get("layer_types")
    kinds = {"linear_attention": MIXER_GDN, "full_attention": MIXER_ATTENTION}
    if not isinstance(types, list) or not types or any(t not in kinds for t in types):
        raise ConfigError(f"a Qwen3-Next config needs layer_types of {sorted(kinds)}, got {types!r:.80}",
                          param="layer_types")
    n = cfg.get("num_hidden_layers")
    if n is not None and n != len(types):
        raise ConfigError(f"config.json lists {len(types)} layer_types but num_hidden_layers is {n}; they "
                          "must agree", param="layer_types")
    sizes = {"k_heads": cfg.get("linear_num_key_heads"), "v_heads": cfg.get("linear_num_value_heads"),
             "k_dim": cfg.get("linear_key_head_dim"), "v_dim": cfg.get("linear_value_head_dim"),
             "conv_kernel": cfg.get("linear_conv_kernel_dim", 4)}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
            raise ConfigError(f"qwen3_next: the Gated DeltaNet {key} must be an integer in [1, 65536], got "
                              f"{value!r:.40}", param=key)
    if sizes["v_heads"] % sizes["k_heads"]:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads",
                          param="linear_num_value_heads")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    partial = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    if not 0 < partial <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {partial}",
                          param="partial_rotary_factor")
    return {"layer_mixers": tuple(kinds[t] for t in types),
            "family": GDNSpec(**sizes, hidden_in=hidden, partial_rotary=partial)}

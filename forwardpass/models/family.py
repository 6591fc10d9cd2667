"""The one interface between a model family and the code that is not the family's own: ``ModelFamily``.

A ``ModelSpec`` holds its family's sub-spec in ``spec.family`` (Mamba2's ``SSMSpec``, Qwen3-Next's
``GDNSpec``, DeepSeek-V4's ``DeepseekV4Spec``, Whisper's ``WhisperSpec``, ...). The parameter and byte
accounting (``models/accounting.py``, which the engine's cost model and the roofline analyzer read), the
roofline's per-op table (``analysis/forward.py``), the front end's encoder input
(``engine/frontend/multimodal.py``) and the worker's check of it (``engine/worker/encoder_step.py``) ask
``family_of(spec)`` for these terms and never branch on a family's name or read its fields.

The base class is the ordinary decoder (every layer attention and an MLP or MoE block, a paged K/V cache, no
encoder); a family subclasses it and overrides only what differs. A sub-spec that is not a ``ModelFamily``
(a family registered from outside that keeps a plain dataclass) counts as the ordinary decoder. The caches a
family declares are its layers' (``kv_cache_spec``: ``attention/kv_cache_interface.py``), not terms here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from forwardpass.models.model_spec import ModelSpec
    from forwardpass.op_cost import OpCost


class ModelFamily:
    """The terms of the ordinary decoder; each method reads the core fields of ``s`` (the spec that holds
    this family) and the family's own."""

    #: the dense and expert MLPs are gated (gate, up, down); False: up -> act -> down (Nemotron-H, relu²)
    mlp_gated: bool = True

    # ---- parameters --------------------------------------------------------------------------------
    def dense_layers(self, s: ModelSpec) -> int:
        """Layers with a dense MLP."""
        return s.layers - s.moe_layers

    def attention_params(self, s: ModelSpec) -> int:
        """q, k, v, o projections of one attention layer."""
        return 2 * s.hidden * s.q_dim + 2 * s.hidden * s.kv_dim

    def norm_params(self, s: ModelSpec) -> int:
        """The RMSNorms of one layer: two (and Qwen3's per-head q/k norms)."""
        return 2 * s.hidden + (2 * s.head_dim if s.norm.qk else 0)

    def total_norm_params(self, s: ModelSpec) -> int:
        """The RMSNorms of every layer (q/k norms only where there is attention), not the final one."""
        qk = 2 * s.head_dim if s.norm.qk else 0
        return s.layers * (self.norm_params(s) - qk) + s.attention_layers * qk

    def router_params(self, s: ModelSpec) -> int:
        """One MoE layer's router (and the shared expert's gate)."""
        if s.moe is None:
            return 0
        return s.hidden * s.moe.num_experts + (s.hidden if s.moe.shared_expert_intermediate else 0)

    def mixer_params(self, s: ModelSpec) -> int:
        """Token-mixing parameters of all layers (a family with state layers adds theirs)."""
        return s.attention_layers * self.attention_params(s)

    def model_params(self, s: ModelSpec) -> int:
        """Total parameters (every expert)."""
        experts = s.moe.num_experts if s.moe else 0
        moe = experts * s.expert_params + self.router_params(s) + s.shared_expert_params
        return (
            self.mixer_params(s)
            + self.total_norm_params(s)
            + self.dense_layers(s) * (3 if self.mlp_gated else 2) * s.hidden * s.intermediate
            + s.moe_layers * moe
            + s.embedding_params
            + s.lm_head_params
            + s.hidden
        )

    # ---- cache bytes and state work ------------------------------------------------------------------
    def kv_bytes_per_token(self, s: ModelSpec, kv_bytes: float) -> float:
        """K and V of one token in every attention layer (state layers keep a state instead)."""
        return 2 * s.attention_layers * s.kv_dim * kv_bytes

    def state_bytes_per_sequence(self, s: ModelSpec, state_bytes: float) -> float:
        """The fixed-size state one request keeps, whatever its length (none here)."""
        return 0 * state_bytes  # zero, of the caller's type as a family's count is

    def kv_positions(self, s: ModelSpec, context: int) -> float:
        """Positions one layer attends to at ``context``, averaged over the layers (sliding layers see
        at most their window)."""
        if not s.layer_windows:
            return float(context)
        return sum(min(context, w) if w else context for w in s.layer_windows) / len(s.layer_windows)

    def cache_bytes_per_sequence(self, s: ModelSpec, context: int, kv_bytes: float,
                                 state_bytes: float) -> float:
        """K/V over the positions its layers see (a window at most) plus its fixed-size states."""
        return (self.kv_bytes_per_token(s, kv_bytes) * self.kv_positions(s, context)
                + self.state_bytes_per_sequence(s, state_bytes))

    def state_flops_per_token(self, s: ModelSpec) -> float:
        """FLOPs of the state updates and reads per token (none here)."""
        return 0.0

    # ---- roofline: the per-op table of one forward pass (analysis/forward.py) -----------------------
    def attention_ops(self, s: ModelSpec, stage: str, *, tokens: int, batch: int, kv_len: int, pairs: float,
                      wb: float, ab: float, kvb: float) -> list[OpCost] | None:
        """One attention layer's ops after its input norm, when they differ from softmax attention over
        K/V (None: the standard q/k/v/o projections and attention)."""
        return None

    def mixer_ops(self, s: ModelSpec, stage: str, *, tokens: int, batch: int, wb: float,
                  ab: float) -> list[OpCost]:
        """Every op of the layers that mix tokens without attention (state layers), each summed over the
        layers it occurs in."""
        return []

    def layer_ops(self, s: ModelSpec, stage: str, *, batch: int, new_tokens: int, context: int, wb: float,
                  ab: float, kvb: float) -> list[OpCost] | None:
        """Every non-MLP op of all layers when the family's layers are not attention + state mixers (None:
        built from ``attention_ops`` and ``mixer_ops``)."""
        return None

    def decode_attention_cost(self, s: ModelSpec, context: int,
                              kv_bytes: float) -> tuple[float, float] | None:
        """(FLOPs, bytes) of one decode token's attention at ``context``, averaged over the layers, for a
        family whose attention is not softmax over the context (None: it is)."""
        return None

    # ---- encoder input (encoder–decoder models) ------------------------------------------------------
    @property
    def encoder_input_shape(self) -> tuple[int, ...] | None:
        """The shape of the features a request's encoder reads (None: a decoder-only model)."""
        return None

    def encoder_input(self, audio: Any, rate: int) -> torch.Tensor:
        """The encoder's features for ``audio`` sampled at ``rate`` (raises ``AudioError`` on bad audio)."""
        raise NotImplementedError("a decoder-only model has no encoder input")


DECODER = ModelFamily()


def family_of(spec: ModelSpec) -> ModelFamily:
    """The family terms of ``spec``: its sub-spec, or the ordinary decoder's when it has none (or one that
    does not implement ``ModelFamily``)."""
    family = spec.family
    return family if isinstance(family, ModelFamily) else DECODER

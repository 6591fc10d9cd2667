"""Parameter and byte accounting of a ``ModelSpec``: the one place the engine's per-step cost model
(``engine/scheduling/cost.py``) and the roofline analyzer (``forwardpass/analysis``) take their counts from.

Every function reads the spec only. ``ModelSpec`` exposes them as its own properties and methods
(``spec.params``, ``spec.kv_bytes_per_token(2)``, ...), so a reader holding a spec need not import this
module. The terms in which families differ are their family's (``models/family.py``: the ordinary
decoder's formulas, overridden by each family's sub-spec next to its model: ``SSMSpec``, ``GDNSpec``,
``DeepseekV4Spec``, ...); what is the same for all of them is here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from forwardpass.models.family import family_of

if TYPE_CHECKING:
    from forwardpass.models.model_spec import ModelSpec


# ---- parameters ----------------------------------------------------------------------------------
def dense_layers(s: ModelSpec) -> int:
    """Layers with a dense MLP (Mamba2: none; Nemotron-H: its MLP layers)."""
    return family_of(s).dense_layers(s)


def attention_params(s: ModelSpec) -> int:
    """q, k, v, o projections of one attention layer (MLA: its own projections)."""
    return family_of(s).attention_params(s)


def norm_params(s: ModelSpec) -> int:
    """The norms of one layer."""
    return family_of(s).norm_params(s)


def total_norm_params(s: ModelSpec) -> int:
    """The norms of every layer, not the final one."""
    return family_of(s).total_norm_params(s)


def expert_params(s: ModelSpec) -> int:
    """One expert's MLP (0 for a dense model)."""
    width = s.moe.expert_intermediate if s.moe else 0
    return (3 if family_of(s).mlp_gated else 2) * s.hidden * width  # Nemotron-H: up, down


def router_params(s: ModelSpec) -> int:
    return family_of(s).router_params(s)


def shared_expert_params(s: ModelSpec) -> int:
    width = s.moe.shared_expert_intermediate if s.moe else 0
    return (3 if family_of(s).mlp_gated else 2) * s.hidden * width


def embedding_params(s: ModelSpec) -> int:
    return s.vocab * s.hidden


def lm_head_params(s: ModelSpec) -> int:
    """Extra LM-head parameters (0 when tied to the embedding, which it then reads)."""
    return 0 if s.tied else s.vocab * s.hidden


def mixer_params(s: ModelSpec) -> int:
    """Token-mixing parameters of all layers: attention and state mixers."""
    return family_of(s).mixer_params(s)


def params(s: ModelSpec) -> int:
    """Total parameters (every expert)."""
    return family_of(s).model_params(s)


def active_params(s: ModelSpec) -> int:
    """Parameters used per token: only ``experts_per_tok`` experts of each MoE layer."""
    if s.moe is None:
        return params(s)
    inactive = (s.moe.num_experts - s.moe.experts_per_tok) * expert_params(s) * len(s.moe.layer_ids)
    return params(s) - inactive


def body_params(s: ModelSpec) -> int:
    """Every parameter but the embedding and the LM head: what a forward pass reads besides them."""
    return params(s) - embedding_params(s) - lm_head_params(s)


def matmul_params(s: ModelSpec) -> int:
    """Active parameters a token multiplies through: not the embedding lookup, the LM head or the norms."""
    return active_params(s) - embedding_params(s) - lm_head_params(s) - total_norm_params(s) - s.hidden


def unique_experts(s: ModelSpec, tokens: float) -> float:
    """Expected distinct experts touched by ``tokens`` tokens under uniform routing."""
    if s.moe is None:
        return 0.0
    e, k = s.moe.num_experts, s.moe.experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens)


# ---- cache bytes and attention work --------------------------------------------------------------
def kv_bytes_per_token(s: ModelSpec, kv_bytes: float) -> float:
    """What the cache grows by per token, every layer (K and V; MLA: the latent vector only; DeepSeek-V4:
    its compressed entries, since the sliding window is bounded)."""
    return family_of(s).kv_bytes_per_token(s, kv_bytes)


def state_bytes_per_sequence(s: ModelSpec, state_bytes: float) -> float:
    """The fixed-size state one request keeps (Mamba / Gated DeltaNet layers, DeepSeek-V4's compressors),
    constant in its length."""
    return family_of(s).state_bytes_per_sequence(s, state_bytes)


def cache_bytes_per_sequence(s: ModelSpec, context: int, kv_bytes: float, state_bytes: float = 4) -> float:
    """What one sequence at ``context`` tokens holds in the cache: K/V over the positions its layers see (a
    window at most) plus its fixed-size states (float32 by default)."""
    return family_of(s).cache_bytes_per_sequence(s, context, kv_bytes, state_bytes)


def kv_positions(s: ModelSpec, context: int) -> float:
    """Positions one layer attends to at ``context``, averaged over the layers (sliding layers see
    at most their window)."""
    return family_of(s).kv_positions(s, context)


def causal_pairs(p: int, window: int | None = None) -> int:
    """(query, key) pairs of causal attention over ``p`` positions, with an optional sliding window."""
    if not window or p <= window:
        return p * (p + 1) // 2
    return window * (window + 1) // 2 + (p - window) * window


def prefill_pairs(s: ModelSpec, p: int) -> float:
    """(query, key) pairs one layer scores in a causal prefill of ``p`` positions, averaged over the
    layers (each with its own sliding window or none), like ``kv_positions``."""
    windows = s.layer_windows or (None,)
    return sum(causal_pairs(p, w) for w in windows) / len(windows)


def state_flops_per_token(s: ModelSpec) -> float:
    """FLOPs of the state updates and reads per token (recurrent form; the causal convs left out)."""
    return family_of(s).state_flops_per_token(s)

"""Parameter and byte accounting of a ``ModelSpec``: the one place the engine's per-step cost model
(``engine/scheduling/cost.py``) and the roofline analyzer (``forwardpass/analysis``) take their counts from.

Every function reads the spec only. ``ModelSpec`` exposes them as its own properties and methods
(``spec.params``, ``spec.kv_bytes_per_token(2)``, ...), so a reader holding a spec need not import this
module; the formulas live here. A family's own sizes count through its sub-spec (``SSMSpec.params``,
``GDNSpec.state_size``, ``DeepseekV4Spec.attention_params``, ...), next to its model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardpass.models.spec import ModelSpec

_MLP = "mlp"  # spec.MIXER_MLP (not imported: spec.py imports this module)


# ---- parameters ----------------------------------------------------------------------------------
def dense_layers(s: ModelSpec) -> int:
    """Layers with a dense MLP (Mamba2: none; Nemotron-H: its MLP layers)."""
    if s.ssm is not None:
        return sum(1 for m in s.layer_mixers if m == _MLP)
    return s.layers - len(s.moe_layer_ids)


def attention_params(s: ModelSpec) -> int:
    """q, k, v, o projections of one layer (MLA: q (LoRA or not), the KV down- and up-projections)."""
    if s.kv_lora_rank:
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        q = (s.hidden * s.q_lora_rank + s.q_lora_rank * s.heads * qk if s.q_lora_rank
             else s.hidden * s.heads * qk)
        kv = s.hidden * s.kv_latent_dim + s.kv_lora_rank * s.heads * (s.qk_nope_head_dim + s.v_head_dim)
        return q + kv + s.heads * s.v_head_dim * s.hidden
    gate = s.hidden * s.q_dim if s.attn_output_gate else 0  # Qwen3-Next: q_proj gives a gate too
    return 2 * s.hidden * s.q_dim + 2 * s.hidden * s.kv_dim + gate


def norm_params(s: ModelSpec) -> int:
    """The RMSNorms of one layer: two (and Qwen3's per-head q/k norms); one in a Mamba2 /
    Nemotron-H block (the mixer's own gated norm is in ``SSMSpec.params``)."""
    if s.ssm is not None:
        return s.hidden
    return 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)


def total_norm_params(s: ModelSpec) -> int:
    """The RMSNorms of every layer (q/k norms only where there is attention), not the final one."""
    qk = 2 * s.head_dim if s.qk_norm and s.ssm is None else 0
    return s.layers * (norm_params(s) - qk) + s.attention_layers * qk


def expert_params(s: ModelSpec) -> int:
    return (3 if s.mlp_gated else 2) * s.hidden * s.expert_intermediate  # Nemotron-H: up, down


def router_params(s: ModelSpec) -> int:
    shared_gate = s.shared_expert_intermediate and s.ssm is None  # Nemotron-H's shared expert has none
    return s.hidden * s.num_experts + (s.hidden if shared_gate else 0)


def shared_expert_params(s: ModelSpec) -> int:
    return (3 if s.mlp_gated else 2) * s.hidden * s.shared_expert_intermediate


def embedding_params(s: ModelSpec) -> int:
    return s.vocab * s.hidden


def lm_head_params(s: ModelSpec) -> int:
    """Extra LM-head parameters (0 when tied to the embedding, which it then reads)."""
    return 0 if s.tied else s.vocab * s.hidden


def mixer_params(s: ModelSpec) -> int:
    """Token-mixing parameters of all layers: attention, Mamba2 and Gated DeltaNet mixers."""
    mamba = s.mamba_layers * s.ssm.params if s.ssm is not None else 0
    gdn = s.gdn_layers * s.gdn.params if s.gdn is not None else 0
    return s.attention_layers * attention_params(s) + mamba + gdn


def params(s: ModelSpec) -> int:
    """Total parameters (every expert)."""
    if s.dsv4 is not None:  # per-layer attention kinds, hyper-connections, routers without a shared gate
        v4, h = s.dsv4, s.hidden
        moe = s.num_experts * (expert_params(s) + h) + shared_expert_params(s)
        attention = sum(v4.attention_params(i, h, s.heads, s.q_lora_rank) for i in range(s.layers))
        head = v4.hc_mult * (v4.hc_mult * h + 1) + 1
        return (attention + s.layers * (2 * h + v4.hyper_params(h) + moe) + embedding_params(s)
                + lm_head_params(s) + h + head)
    moe = s.num_experts * expert_params(s) + router_params(s) + shared_expert_params(s)
    return (
        mixer_params(s)
        + total_norm_params(s)
        + dense_layers(s) * (3 if s.mlp_gated else 2) * s.hidden * s.intermediate
        + len(s.moe_layer_ids) * moe
        + embedding_params(s)
        + lm_head_params(s)
        + s.hidden
    )


def active_params(s: ModelSpec) -> int:
    """Parameters used per token: only ``experts_per_tok`` experts of each MoE layer."""
    inactive = (s.num_experts - s.experts_per_tok) * expert_params(s) * len(s.moe_layer_ids)
    return params(s) - inactive


def body_params(s: ModelSpec) -> int:
    """Every parameter but the embedding and the LM head: what a forward pass reads besides them."""
    return params(s) - embedding_params(s) - lm_head_params(s)


def matmul_params(s: ModelSpec) -> int:
    """Active parameters a token multiplies through: not the embedding lookup, the LM head or the norms."""
    return active_params(s) - embedding_params(s) - lm_head_params(s) - total_norm_params(s) - s.hidden


def unique_experts(s: ModelSpec, tokens: float) -> float:
    """Expected distinct experts touched by ``tokens`` tokens under uniform routing."""
    if not s.num_experts:
        return 0.0
    e, k = s.num_experts, s.experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens)


# ---- cache bytes and attention work --------------------------------------------------------------
def kv_bytes_per_token(s: ModelSpec, kv_bytes: float) -> float:
    """K and V of one token in every layer (MLA: the latent vector only; DeepSeek-V4: what the cache
    grows by per token, its compressed entries, since the sliding window is bounded)."""
    if s.dsv4 is not None:
        v4 = s.dsv4
        return sum(v4.entry_dim(i) / m for i, m in enumerate(v4.compress_rates) if m) * kv_bytes
    if s.kv_lora_rank:
        return s.layers * s.kv_latent_dim * kv_bytes
    return 2 * s.attention_layers * s.kv_dim * kv_bytes  # Mamba / DeltaNet layers keep a state instead


def state_bytes_per_sequence(s: ModelSpec, state_bytes: float) -> float:
    """The fixed-size state one request keeps in every Mamba / Gated DeltaNet layer (constant in
    its length), and DeepSeek-V4's compressor states."""
    mamba = s.mamba_layers * s.ssm.state_size if s.ssm is not None else 0
    gdn = s.gdn_layers * s.gdn.state_size if s.gdn is not None else 0
    v4 = sum(s.dsv4.state_size(i) for i in range(s.layers)) if s.dsv4 is not None else 0
    return (mamba + gdn + v4) * state_bytes


def cache_bytes_per_sequence(s: ModelSpec, context: int, kv_bytes: float, state_bytes: float = 4) -> float:
    """What one sequence at ``context`` tokens holds in the cache: K/V over the positions its layers see (a
    window at most) plus its fixed-size states (float32 by default)."""
    if s.dsv4 is not None:  # its window is bounded, its entries grow as L / m
        return s.dsv4.cache_bytes(context, kv_bytes) + state_bytes_per_sequence(s, state_bytes)
    return (kv_bytes_per_token(s, kv_bytes) * kv_positions(s, context)
            + state_bytes_per_sequence(s, state_bytes))


def kv_positions(s: ModelSpec, context: int) -> float:
    """Positions one layer attends to at ``context``, averaged over the layers (sliding layers see
    at most their window)."""
    if not s.layer_windows or s.dsv4 is not None:  # DeepSeek-V4: its entries cover the whole context
        return float(context)
    return sum(min(context, w) if w else context for w in s.layer_windows) / len(s.layer_windows)


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
    """FLOPs of the state updates and reads per token (recurrent form): Mamba2 decays the state,
    adds ``dt·x⊗B`` and reads it with ``C`` (~6 per state value); the delta rule decays, predicts
    ``Sᵀk``, writes and reads with ``q`` (~8 per state value). The causal convs are left out."""
    mamba = 6 * s.mamba_layers * s.ssm.ssm_state_size if s.ssm is not None else 0
    gdn = 8 * s.gdn_layers * s.gdn.v_heads * s.gdn.k_dim * s.gdn.v_dim if s.gdn is not None else 0
    return float(mamba + gdn)

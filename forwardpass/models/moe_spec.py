"""``MoESpec``: a model's sparse mixture-of-experts blocks, one frozen sub-spec held as ``ModelSpec.moe``.

Which decoder layers route their MLP through experts, how many experts and how wide, how many each token
picks and how (softmax or sigmoid scores, DeepSeek's expert groups and ``noaux_tc`` bias correction, a
scaling of the chosen weights). Experts are orthogonal to the family: Mixtral, Qwen3-MoE, Qwen3-Next,
DeepSeek-V2/V3/V4 and Nemotron-H all have them, so they are a grouped field of their own beside
``ModelSpec.family``; a dense model has ``moe = None``. ``moe_spec`` reads the generic keys most MoE
configs share; DeepSeek's routing keys are read by ``models/deepseek_spec.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from forwardpass.errors import ConfigError


@dataclass(frozen=True)
class MoESpec:
    """The experts' sizes and the router's rules."""

    layer_ids: tuple[int, ...]  # decoder layers whose MLP is a sparse MoE block
    num_experts: int
    experts_per_tok: int
    expert_intermediate: int  # one expert's MLP width
    shared_expert_intermediate: int = 0  # the always-on shared expert(s)' width; 0 = none
    renormalize_topk: bool = False  # renormalize the chosen experts' weights (Mixtral, Qwen norm_topk_prob)
    # DeepSeek routing: score function, expert groups, e_score_correction_bias (noaux_tc), scaling
    router_scoring: str = "softmax"  # "softmax", "sigmoid" (or DeepSeek-V4's "sqrtsoftplus")
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def moe_spec(cfg: Mapping[str, Any], layers: int, need: Callable[[str], Any]) -> MoESpec | None:
    """Qwen-MoE / Mixtral experts: ``num_experts`` (or ``num_local_experts``), ``num_experts_per_tok``, sparse
    layers every ``decoder_sparse_step`` except ``mlp_only_layers`` (None: no experts, a dense model)."""
    # transformers 5 writes `num_local_experts` for Qwen3-MoE too; Qwen's own configs say `num_experts`
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if num_experts <= 0:
        return None
    k = int(cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or 0)
    if not 1 <= k <= num_experts:
        raise ConfigError(f"MoE config needs 1 <= num_experts_per_tok <= {num_experts}, got {k}",
                          param="num_experts_per_tok")
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    return MoESpec(
        layer_ids=tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0),
        num_experts=num_experts,
        experts_per_tok=k,
        # Mixtral's experts are intermediate_size wide; Qwen-MoE's moe_intermediate_size
        expert_intermediate=int(cfg.get("moe_intermediate_size") or need("intermediate_size")),
        shared_expert_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0),
        renormalize_topk=bool(cfg.get("norm_topk_prob", False)),
    )

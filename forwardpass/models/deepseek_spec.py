"""The spec of DeepSeek-V2 / V3 (``models/deepseek.py``): multi-latent attention sizes and DeepSeek MoE
routing.

Multi-latent attention (``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, optional
``q_lora_rank``) is checked to add up, with one clear error naming the field; every head then has its own K/V
expanded from one latent, so ``kv_heads = heads`` and ``head_dim`` is the q·k width. The MoE:
``n_routed_experts`` in the layers from ``first_k_dense_replace`` on, ``n_shared_experts`` always-on experts,
V2's softmax greedy / group-limited routing or V3's sigmoid ``noaux_tc`` (also Nemotron-H's MoE layers:
``models/mamba_spec.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from forwardpass.errors import ConfigError
from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import ModelSpec, architecture, decoder_spec, require
from forwardpass.models.moe_spec import MoESpec

if TYPE_CHECKING:
    from forwardpass.op_cost import OpCost


@dataclass(frozen=True)
class MLAFamily(ModelFamily):
    """Multi-latent attention (DeepSeek-V2/V3 with a ``kv_lora_rank``): q (LoRA or not), the KV down- and
    up-projections, one latent vector cached per token and layer; its sizes (read as ``spec.mla`` by the
    family's model and roofline)."""

    spec_attribute: ClassVar[str] = "mla"

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q is one projection (no LoRA)
    rope_interleave: bool = True  # rotary pairs are adjacent (x0, x1), (x2, x3) ...

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token and layer: the compressed KV and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_params(self, s: ModelSpec) -> int:
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (s.hidden * self.q_lora_rank + self.q_lora_rank * s.heads * qk if self.q_lora_rank
             else s.hidden * s.heads * qk)
        kv = s.hidden * self.kv_latent_dim + self.kv_lora_rank * s.heads * (self.qk_nope_head_dim
                                                                             + self.v_head_dim)
        return q + kv + s.heads * self.v_head_dim * s.hidden

    def kv_bytes_per_token(self, s: ModelSpec, kv_bytes: float) -> float:
        return s.layers * self.kv_latent_dim * kv_bytes

    def attention_ops(self, s: ModelSpec, stage: str, *, tokens: int, batch: int, kv_len: int, pairs: float,
                      wb: float, ab: float, kvb: float) -> list[OpCost] | None:
        from forwardpass.models.deepseek_roofline import mla_attention_ops

        return mla_attention_ops(s, stage, tokens=tokens, batch=batch, kv_len=kv_len, pairs=pairs, wb=wb,
                                 ab=ab, kvb=kvb)


def deepseek_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """DeepSeek-V2 / V3: the latent attention and the routing here, the rest from the common core."""
    given: dict[str, Any] = {}
    mla = mla_family(cfg)
    if mla:  # every head has its own K/V expanded from one latent; head_dim is the q·k width
        given.update(kv_heads=int(require(cfg, "num_attention_heads", name)),
                     head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, family=mla)
    if cfg.get("n_routed_experts"):
        given["moe"] = deepseek_moe(cfg, int(require(cfg, "num_hidden_layers", name)), architecture(cfg))
    return decoder_spec(cfg, name, **given)


def mla_family(cfg: Mapping[str, Any]) -> MLAFamily | None:
    """DeepSeek-V2/V3 multi-latent attention sizes, checked to add up (None: no ``kv_lora_rank``, ordinary
    attention)."""
    rank = cfg.get("kv_lora_rank")
    if not rank:
        return None
    out: dict[str, Any] = {"rope_interleave": bool(cfg.get("rope_interleave", True))}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"multi-latent attention needs a positive integer {key}, got {value!r}",
                              param=key)
        out[key] = value
    q_rank = cfg.get("q_lora_rank") or 0
    if not isinstance(q_rank, int) or q_rank < 0:
        raise ConfigError(f"q_lora_rank must be a non-negative integer or null, got {q_rank!r}",
                          param="q_lora_rank")
    out["q_lora_rank"] = q_rank
    if out["qk_rope_head_dim"] % 2:
        raise ConfigError("qk_rope_head_dim must be even for rotary embedding, got "
                          f"{out['qk_rope_head_dim']}",
                          param="qk_rope_head_dim")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim not in (out["qk_rope_head_dim"],
                                                 out["qk_nope_head_dim"] + out["qk_rope_head_dim"]):
        raise ConfigError(
            f"head_dim={head_dim} must equal qk_rope_head_dim ({out['qk_rope_head_dim']}) or "
            f"qk_nope_head_dim + qk_rope_head_dim ({out['qk_nope_head_dim'] + out['qk_rope_head_dim']})",
            param="head_dim")
    return MLAFamily(**out)


def deepseek_moe(cfg: Mapping[str, Any], layers: int, arch: str) -> MoESpec:
    """DeepSeek-V2/V3: ``n_routed_experts`` experts in layers from ``first_k_dense_replace`` on, plus
    ``n_shared_experts`` always-on experts; V3 scores with a sigmoid and picks groups by the
    bias-corrected scores (``noaux_tc``), V2 with a softmax (``greedy`` or ``group_limited_greedy``)."""
    e = int(cfg.get("n_routed_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0)
    if not 1 <= k <= e:
        raise ConfigError(f"MoE config needs 1 <= num_experts_per_tok <= n_routed_experts={e}, got {k}",
                          param="num_experts_per_tok")
    v3 = arch == "DeepseekV3ForCausalLM" or cfg.get("model_type") == "deepseek_v3"
    method = "noaux_tc" if v3 else str(cfg.get("topk_method") or "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ConfigError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)",
                          param="topk_method")
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or n_group)
    if method != "greedy" and (e % n_group or not 1 <= topk_group <= n_group):
        raise ConfigError(f"n_routed_experts={e} must split into n_group={n_group} groups, and 1 <= "
                          f"topk_group <= n_group (got {topk_group})", param="n_group")
    if method == "noaux_tc" and topk_group * (e // n_group) < k:
        raise ConfigError(f"topk_group={topk_group} groups of {e // n_group} experts cannot supply "
                          f"num_experts_per_tok={k}", param="topk_group")
    first = int(cfg.get("first_k_dense_replace") or 0)
    inter = int(cfg.get("moe_intermediate_size") or 0)
    return MoESpec(
        layer_ids=tuple(range(min(first, layers), layers)),
        num_experts=e,
        experts_per_tok=k,
        expert_intermediate=inter,
        shared_expert_intermediate=inter * int(cfg.get("n_shared_experts") or 0),
        renormalize_topk=bool(cfg.get("norm_topk_prob", False)) and v3,  # HF V2 never renormalizes
        router_scoring="sigmoid" if v3 else "softmax",
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )

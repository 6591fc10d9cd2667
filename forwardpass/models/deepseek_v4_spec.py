"""The spec of DeepSeek-V4 (``models/deepseek_v4*.py``): ``DeepseekV4Spec`` and the derivation that reads its
keys.

Compressed attention (layer types and compress rates), hash / top-k MoE layers, the two rotary bases (``main``
for sliding layers, ``compress`` for CSA / HCA layers and their compressors), hyper-connection and indexer
sizes, as transformers' ``DeepseekV4Config`` resolves them. Its cache kinds:
``models/deepseek_v4_cache_spec.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from forwardpass.errors import ConfigError
from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import ModelSpec, RopeSpec, decoder_spec, require
from forwardpass.models.moe_spec import MoESpec

if TYPE_CHECKING:
    from forwardpass.op_cost import OpCost

DSV4_SLIDING = "sliding_attention"
# compressed every m tokens, an indexer picks top-k entries per query
DSV4_CSA = "compressed_sparse_attention"
DSV4_HCA = "heavily_compressed_attention"  # compressed every m' tokens, every entry visible


@dataclass(frozen=True)
class DeepseekV4Spec(ModelFamily):
    """DeepSeek-V4's compressed attention, hyper-connections and routing (``_deepseek_v4_fields``).

    Every layer attends to its last ``window`` tokens (one shared K=V head); a CSA / HCA layer also
    reads the compressed entries emitted so far: one per ``compress_rates[layer]`` tokens, pooled with
    learned softmax gates (CSA: over two overlapping windows, and only the indexer's top
    ``index_topk`` entries per query). The entries grow with the sequence (paged, one entry dim per
    compressed position); the tokens of the open window(s) are a fixed-size per-request state. The family's
    terms (``models/family.py``) are below its sizes; its roofline ops: ``deepseek_v4_roofline.py``."""

    spec_attribute: ClassVar[str] = "dsv4"  # read as ``spec.dsv4`` by the family's model

    layers: int
    head_dim: int
    layer_types: tuple[str, ...]  # DSV4_SLIDING / DSV4_CSA / DSV4_HCA per layer
    compress_rates: tuple[int, ...]  # per layer: tokens per compressed entry (0: sliding only)
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by a token-id table (``hash_moe``)
    window: int
    rope_dim: int  # trailing channels of each head that are rotated (interleaved pairs)
    compress_rope_theta: float
    compress_rope_scaling: dict[str, Any] | None
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    scoring: str  # router score function: "sqrtsoftplus" or "sigmoid"
    q_lora_rank: int  # q's LoRA rank (q and the indexer's q are read from its normed latent)

    def sparse(self, layer: int) -> bool:
        return self.layer_types[layer] == DSV4_CSA

    def entry_dim(self, layer: int) -> int:
        """Values cached per compressed entry: the K=V entry, plus the indexer's key in a CSA layer."""
        return self.head_dim + (self.index_head_dim if self.sparse(layer) else 0)

    def tail_tokens(self, layer: int) -> int:
        """Tokens whose projections the compressor keeps between steps: the open window, and in a CSA
        layer the closed window before it (its first half-series joins the next entry)."""
        m = self.compress_rates[layer]
        return 2 * m - 1 if self.sparse(layer) else m - 1

    def proj_width(self, layer: int) -> int:
        """kv and gate projection values per token (CSA: two series, for the entry and the indexer)."""
        return 4 * (self.head_dim + self.index_head_dim) if self.sparse(layer) else 2 * self.head_dim

    def state_size(self, layer: int) -> int:
        return max(1, self.tail_tokens(layer) * self.proj_width(layer)) if self.compress_rates[layer] else 0

    def layers_by_kind(self) -> list[tuple[str, list[int]]]:
        """(short name, layers) of each attention kind present: sliding ("swa"), CSA, HCA, in that order."""
        kinds = ((DSV4_SLIDING, "swa"), (DSV4_CSA, "csa"), (DSV4_HCA, "hca"))
        found = [(tag, [i for i, t in enumerate(self.layer_types) if t == kind]) for kind, tag in kinds]
        return [(tag, layers) for tag, layers in found if layers]

    def layer_attention_params(self, layer: int, hidden: int, heads: int, q_lora_rank: int) -> int:
        """q (LoRA + norm), the K=V projection and norm, the grouped output projection, the sinks, and
        the compressor (and the indexer with its own compressor) of one layer."""
        d, m = self.head_dim, self.compress_rates[layer]
        out = (hidden * q_lora_rank + q_lora_rank + q_lora_rank * heads * d + hidden * d + d
               + heads * d * self.o_lora_rank + self.o_groups * self.o_lora_rank * hidden + heads)
        if m:
            width = 2 * d if self.sparse(layer) else d
            out += 2 * hidden * width + m * width + d
        if self.sparse(layer):
            di = self.index_head_dim
            out += (q_lora_rank * self.index_heads * di + hidden * self.index_heads + 4 * hidden * di
                    + 2 * m * di + di)
        return out

    def hyper_params(self, hidden: int) -> int:
        """The two hyper-connections of one layer (map, biases, three scales each)."""
        n = self.hc_mult
        mix = (2 + n) * n
        return 2 * (mix * n * hidden + mix + 3)

    def cache_bytes(self, context: int, hidden_bytes: float) -> float:
        """Sliding K=V vectors (the window at most) plus compressed entries of one sequence at
        ``context`` tokens, every layer (the compressor states are ``state_size``, float32)."""
        window = self.layers * min(context, self.window) * self.head_dim
        entries = sum(context // m * self.entry_dim(i) for i, m in enumerate(self.compress_rates) if m)
        return (window + entries) * hidden_bytes

    # ---- the family's terms (models/family.py) ------------------------------------------------------
    def model_params(self, s: ModelSpec) -> int:
        """Per-layer attention kinds, hyper-connections, routers without a shared gate."""
        h = s.hidden
        experts = s.moe.num_experts if s.moe else 0
        moe = experts * (s.expert_params + h) + s.shared_expert_params
        attention = sum(self.layer_attention_params(i, h, s.heads, self.q_lora_rank) for i in range(s.layers))
        head = self.hc_mult * (self.hc_mult * h + 1) + 1
        return (attention + s.layers * (2 * h + self.hyper_params(h) + moe) + s.embedding_params
                + s.lm_head_params + h + head)

    def kv_bytes_per_token(self, s: ModelSpec, kv_bytes: float) -> float:
        """What the cache grows by per token: its compressed entries (the sliding window is bounded)."""
        return sum(self.entry_dim(i) / m for i, m in enumerate(self.compress_rates) if m) * kv_bytes

    def state_bytes_per_sequence(self, s: ModelSpec, state_bytes: float) -> float:
        return sum(self.state_size(i) for i in range(s.layers)) * state_bytes

    def kv_positions(self, s: ModelSpec, context: int) -> float:
        return float(context)  # its entries cover the whole context

    def cache_bytes_per_sequence(self, s: ModelSpec, context: int, kv_bytes: float,
                                 state_bytes: float) -> float:
        """Its window is bounded, its entries grow as L / m."""
        return self.cache_bytes(context, kv_bytes) + self.state_bytes_per_sequence(s, state_bytes)

    def layer_ops(self, s: ModelSpec, stage: str, *, batch: int, new_tokens: int, context: int, wb: float,
                  ab: float, kvb: float) -> list[OpCost] | None:
        from forwardpass.models.deepseek_v4_roofline import dsv4_layer_ops

        return dsv4_layer_ops(self, s, stage, batch=batch, new_tokens=new_tokens, context=context, wb=wb,
                              ab=ab, kvb=kvb)

    def decode_attention_cost(self, s: ModelSpec, context: int,
                              kv_bytes: float) -> tuple[float, float] | None:
        from forwardpass.models.deepseek_v4_roofline import dsv4_decode_cost

        return dsv4_decode_cost(self, s, context, kv_bytes)

    def entries_cache_id(self, layer: int) -> int:
        """Cache index of a compressed layer's entries (sliding K=V pages use the layer's own index)."""
        return self.layers + layer

    def state_cache_id(self, layer: int) -> int:
        return 2 * self.layers + layer


def deepseek_v4_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """DeepSeek-V4: one K=V head shared by every query head, its own routing, windows and rotary; the common
    core for the rest."""
    hidden, layers = int(require(cfg, "hidden_size", name)), int(require(cfg, "num_hidden_layers", name))
    heads = int(require(cfg, "num_attention_heads", name))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    fields = deepseek_v4_fields(cfg, layers, heads, head_dim)
    return decoder_spec(cfg, name, hidden=hidden, layers=layers, heads=heads, kv_heads=1, head_dim=head_dim,
                        **fields)


_DSV4_RATE_TYPES = {0: DSV4_SLIDING, 4: DSV4_CSA, 128: DSV4_HCA}  # legacy per-layer compress_ratios


def deepseek_v4_fields(cfg: Mapping[str, Any], layers: int, heads: int, head_dim: int) -> dict[str, Any]:
    """DeepSeek-V4 (as transformers' ``DeepseekV4Config`` resolves it): attention layer types and
    compress rates, hash / top-k MoE layers, the two rotary bases (``main`` for sliding layers,
    ``compress`` for CSA / HCA layers and their compressors), hyper-connection and indexer sizes."""
    if cfg.get("quantization_config"):
        raise ConfigError("DeepSeek-V4 checkpoints with a quantization_config (FP8 / FP4 experts) are not "
                          "supported; use a bf16 / fp32 checkpoint", param="quantization_config")
    rates = dict(cfg.get("compress_rates") or {DSV4_CSA: 4, DSV4_HCA: 128})
    for key, legacy in ((DSV4_CSA, "compress_rate_csa"), (DSV4_HCA, "compress_rate_hca")):
        rates[key] = cfg.get(legacy) or rates.get(key)
    types = cfg.get("layer_types")
    if types is None and isinstance(cfg.get("compress_ratios"), list):
        types = [_DSV4_RATE_TYPES.get(r, str(r)) for r in cfg["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA interleaved
        types = ([DSV4_HCA] * min(layers, 2)
                 + [DSV4_CSA if i % 2 else DSV4_HCA for i in range(max(layers - 2, 0))])
    types = list(types)[:layers]
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        n_hash = cfg.get("num_hash_layers")
        mlp = ["hash_moe"] * min(layers, 3 if n_hash is None else int(n_hash)) + ["moe"] * layers
    mlp = list(mlp)[:layers]
    if len(types) != layers or len(mlp) != layers:
        raise ConfigError(f"DeepSeek-V4 needs {layers} layer_types and mlp_layer_types", param="layer_types")
    bad = sorted({str(t) for t in types if t not in (DSV4_SLIDING, DSV4_CSA, DSV4_HCA)} |
                 {str(t) for t in mlp if t not in ("hash_moe", "moe")})
    if bad:
        raise ConfigError(f"DeepSeek-V4 layer_types / mlp_layer_types has unknown entries {bad}",
                          param="layer_types")
    sizes = {"sliding_window": cfg.get("sliding_window") or 128, "o_groups": cfg.get("o_groups") or 8,
             "o_lora_rank": cfg.get("o_lora_rank") or 1024, "index_n_heads": cfg.get("index_n_heads") or 64,
             "index_head_dim": cfg.get("index_head_dim") or 128, "index_topk": cfg.get("index_topk") or 512,
             "hc_mult": cfg.get("hc_mult") or 4, "hc_sinkhorn_iters": cfg.get("hc_sinkhorn_iters") or 20,
             "q_lora_rank": cfg.get("q_lora_rank") or 0,
             **{f"compress_rates.{k}": rates.get(k) for k in (DSV4_CSA, DSV4_HCA) if k in types}}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
            raise ConfigError(f"deepseek_v4: {key} must be an integer in [1, 2**20], got {value!r:.40}",
                              param=key.split(".")[0])
    if heads % sizes["o_groups"]:
        raise ConfigError(f"num_attention_heads={heads} must split into o_groups={sizes['o_groups']}",
                          param="o_groups")
    partial = cfg.get("partial_rotary_factor")
    rope_dim = int(head_dim * partial) if partial else int(cfg.get("qk_rope_head_dim") or head_dim // 8)
    if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, sizes["index_head_dim"]):
        raise ConfigError(f"the rotary part ({rope_dim}) must be even and fit head_dim and index_head_dim",
                          param="partial_rotary_factor")
    scoring = str(cfg.get("scoring_func") or "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ConfigError(f"scoring_func {scoring!r} is not supported (sqrtsoftplus, sigmoid)",
                          param="scoring_func")
    if str(cfg.get("hidden_act") or "silu") != "silu":
        raise ConfigError("DeepSeek-V4 experts are SwiGLU: hidden_act must be silu", param="hidden_act")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    if isinstance(rope.get("main"), Mapping) and isinstance(rope.get("compress"), Mapping):
        main_theta = float(rope["main"].get("rope_theta") or 10000.0)
        if rope["main"].get("rope_type", "default") != "default":
            raise ConfigError("DeepSeek-V4's main rotary must be the default kind", param="rope_parameters")
        compress = dict(rope["compress"])
    else:  # flat: the scaling (YaRN) applies to the compressed layers only, at attention_factor 1
        main_theta = float(cfg.get("rope_theta") or 10000.0)
        compress = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if compress.get("rope_type") == "yarn":
            compress.setdefault("attention_factor", 1.0)
    compress_theta = float(compress.pop("rope_theta", None) or cfg.get("compress_rope_theta") or 160000.0)
    compress.pop("partial_rotary_factor", None)
    scaling = compress if compress.get("rope_type", "default") != "default" else None
    experts = int(cfg.get("n_routed_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0)
    inter = int(cfg.get("moe_intermediate_size") or 0)
    if not 1 <= k <= experts or inter < 1:
        raise ConfigError(f"DeepSeek-V4 needs 1 <= num_experts_per_tok <= n_routed_experts and a "
                          f"moe_intermediate_size, got {k}, {experts}, {inter}", param="num_experts_per_tok")
    window = sizes["sliding_window"]
    dsv4 = DeepseekV4Spec(
        layers=layers, head_dim=head_dim, layer_types=tuple(types),
        compress_rates=tuple(int(rates[t]) if t != DSV4_SLIDING else 0 for t in types),
        hash_layers=tuple(t == "hash_moe" for t in mlp), window=window, rope_dim=rope_dim,
        compress_rope_theta=compress_theta, compress_rope_scaling=scaling, o_groups=sizes["o_groups"],
        o_lora_rank=sizes["o_lora_rank"], index_heads=sizes["index_n_heads"],
        index_head_dim=sizes["index_head_dim"], index_topk=sizes["index_topk"], hc_mult=sizes["hc_mult"],
        hc_sinkhorn_iters=sizes["hc_sinkhorn_iters"], hc_eps=float(cfg.get("hc_eps") or 1e-6),
        swiglu_limit=float(cfg.get("swiglu_limit") or 10.0), scoring=scoring,
        q_lora_rank=sizes["q_lora_rank"])
    # one shared expert of moe_intermediate_size whatever n_shared_experts says (as transformers builds it);
    # the chosen experts' weights are always renormalized
    moe = MoESpec(layer_ids=tuple(range(layers)), num_experts=experts, experts_per_tok=k,
                  expert_intermediate=inter, shared_expert_intermediate=inter, renormalize_topk=True,
                  router_scoring=scoring, topk_method="greedy", n_group=1, topk_group=1,
                  routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))
    return {"family": dsv4, "moe": moe, "layer_windows": (window,) * layers, "rope": RopeSpec(main_theta)}

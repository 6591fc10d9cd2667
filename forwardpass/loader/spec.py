"""``ModelSpec``: config.json read once into a typed, frozen description of the model.

Hugging Face configs leave much implicit (``head_dim``, ``num_key_value_heads``, which layers use a
sliding window, which layers are sparse MoE, where rope settings live) and spell the same thing
differently across families (``num_experts`` / ``num_local_experts``, ``layer_types`` /
``use_sliding_window`` + ``max_window_layers``). All of that is resolved here, once. Models, the model
runner, the KV cache manager, the per-step cost model and the roofline analyzer read a ``ModelSpec``;
nothing else reads raw config keys.

It also resolves Gemma 2/3's scale, logit soft-caps and per-layer-type rope (``_gemma3_rope``),
DeepSeek's multi-latent attention sizes (``_mla_fields``: checked to add up, one clear error naming
the field) and its MoE routing (``_deepseek_moe_fields``), and refuses a window larger than
``max_position_embeddings`` or an unknown ``layer_types`` entry.

Field names are short (``hidden``, ``layers``, ``heads``) because the accounting formulas below and in
``forwardpass/analysis`` read like the equations they implement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forwardpass.errors import ConfigError
from forwardpass.loader.validate import validate_config

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# architectures whose attention has a per-head RMSNorm on q and k before RoPE
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
_GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 when every layer is MoE and none is given)
    vocab: int
    tied: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # never mutated; a dict so the spec pickles
    max_position_embeddings: int | None = None
    # one entry per layer: the sliding window of that layer, or None for full attention
    layer_windows: tuple[int | None, ...] = ()
    # mixture of experts
    moe_layer_ids: tuple[int, ...] = ()  # decoder layers whose MLP is a sparse MoE block
    num_experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    renormalize_topk: bool = False  # renormalize the chosen experts' weights (Mixtral, Qwen norm_topk_prob)
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's dtype as config.json states it
    # Gemma 2 / 3
    attn_scale: float | None = None  # query scale (Gemma: query_pre_attn_scalar ** -0.5); None = head_dim ** -0.5
    attn_logit_softcap: float | None = None  # tanh-cap of attention scores (Gemma 2)
    final_logit_softcap: float | None = None  # tanh-cap of the output logits (Gemma 2)
    local_rope_theta: float | None = None  # rope base of sliding layers when it differs (Gemma 3)
    # multi-latent attention (DeepSeek-V2/V3); kv_lora_rank == 0 means ordinary attention
    q_lora_rank: int = 0  # 0: q is one projection (no LoRA)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs are adjacent (x0, x1), (x2, x3) ... (DeepSeek)
    # DeepSeek MoE routing: score function, expert groups, e_score_correction_bias (noaux_tc), scaling
    router_scoring: str = "softmax"  # "softmax" or "sigmoid"
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.layer_windows:  # built by hand without windows: every layer attends to everything
            object.__setattr__(self, "layer_windows", (None,) * self.layers)
        elif len(self.layer_windows) != self.layers:
            raise ConfigError(f"layer_windows has {len(self.layer_windows)} entries for {self.layers} layers",
                              param="layer_types")

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], name: str = "") -> ModelSpec:
        """Build the spec from a config.json mapping (already un-nested from ``text_config``)."""
        validate_config(cfg, name)  # typed bounds of every size (and checkpoint shapes) before any allocation

        def need(key: str) -> Any:
            value = cfg.get(key)
            if value is None:
                raise ConfigError(
                    f"config {name or ''} has no {key!r}; a decoder needs hidden_size, num_hidden_layers, "
                    "num_attention_heads, intermediate_size (or moe_intermediate_size) and vocab_size",
                    param=key,
                )
            return value

        hidden = int(need("hidden_size"))
        layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        mla = _mla_fields(cfg, heads)
        if mla:  # every head has its own K/V expanded from one latent; head_dim is the q·k width
            kv_heads, head_dim = heads, mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        vocab = int(need("vocab_size"))
        archs = cfg.get("architectures") or [""]
        arch = str(archs[0])
        model_type = str(cfg.get("model_type") or "")
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                              param="num_key_value_heads")

        moe = _moe_fields(cfg, layers, arch, need)
        intermediate = int(cfg.get("intermediate_size") or 0)
        if len(moe["moe_layer_ids"]) < layers and intermediate <= 0:
            raise ConfigError(f"config {name} has dense layers but no 'intermediate_size'", param="intermediate_size")
        rope_theta, rope_scaling = _rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        # Qwen2 always has q/k/v bias and never an o_proj bias (HF Qwen2Attention ignores attention_bias)
        qwen2 = model_type == "qwen2" or arch == "Qwen2ForCausalLM"
        eps = cfg.get("rms_norm_eps")
        max_pos = cfg.get("max_position_embeddings")
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        layer_windows = _layer_windows(cfg, layers, model_type)
        windows = [w for w in layer_windows if w]
        if windows and max_pos and max(windows) > int(max_pos):
            raise ConfigError(f"sliding_window={max(windows)} is larger than max_position_embeddings={max_pos}",
                              param="sliding_window")
        gemma = model_type in _GEMMA_TYPES or arch.startswith("Gemma")
        if gemma and model_type.startswith("gemma3"):
            rope_theta, rope_scaling, local_theta = _gemma3_rope(cfg)
        else:
            local_theta = None
        return cls(
            name=name or str(cfg.get("_name_or_path") or arch or "model"),
            architecture=arch,
            model_type=model_type,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            vocab=vocab,
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=arch in _QK_NORM_ARCHITECTURES or model_type.startswith("qwen3"),
            qkv_bias=attention_bias or qwen2,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
            rms_norm_eps=float(eps) if eps is not None else 1e-6,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(max_pos) if max_pos else None,
            layer_windows=layer_windows,
            eos_token_ids=eos_token_ids(cfg),
            torch_dtype=str(dtype) if dtype else None,
            attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5 if gemma else None,
            attn_logit_softcap=_opt_float(cfg.get("attn_logit_softcapping")) if gemma else None,
            final_logit_softcap=_opt_float(cfg.get("final_logit_softcapping")) if gemma else None,
            local_rope_theta=local_theta,
            **mla,
            **moe,
        )

    # ---- attention layout ------------------------------------------------------------------------
    def layer_kind(self, layer: int) -> str:
        return SLIDING_ATTENTION if self.layer_windows[layer] else FULL_ATTENTION

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides by the same one (Mistral); None otherwise."""
        windows = set(self.layer_windows)
        return next(iter(windows)) if len(windows) == 1 else None

    def kv_positions(self, context: int) -> float:
        """Positions one layer attends to at ``context``, averaged over the layers (sliding layers see
        at most their window)."""
        if not self.layer_windows:
            return float(context)
        return sum(min(context, w) if w else context for w in self.layer_windows) / len(self.layer_windows)

    # ---- parameter counts (shared by the cost model and the analyzer) ----------------------------
    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layer_ids)

    @property
    def moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """q, k, v, o projections of one layer (MLA: q (LoRA or not), the KV down- and up-projections)."""
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (self.hidden * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank
                 else self.hidden * self.heads * qk)
            kv = self.hidden * self.kv_latent_dim + self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + self.heads * self.v_head_dim * self.hidden
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    @property
    def norm_params(self) -> int:
        """The two RMSNorms of one layer (and Qwen3's per-head q/k norms)."""
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_experts + (self.hidden if self.shared_expert_intermediate else 0)

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden * self.shared_expert_intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Extra LM-head parameters (0 when tied to the embedding, which it then reads)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Total parameters (every expert)."""
        per_layer = self.attention_params + self.norm_params
        moe = self.num_experts * self.expert_params + self.router_params + self.shared_expert_params
        return (
            self.layers * per_layer
            + self.dense_layers * 3 * self.hidden * self.intermediate
            + self.moe_layers * moe
            + self.embedding_params
            + self.lm_head_params
            + self.hidden
        )

    @property
    def active_params(self) -> int:
        """Parameters used per token: only ``experts_per_tok`` experts of each MoE layer."""
        inactive = (self.num_experts - self.experts_per_tok) * self.expert_params * self.moe_layers
        return self.params - inactive

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token and layer by multi-latent attention: the compressed KV and the
        shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        """K and V of one token in every layer (MLA: the latent vector only)."""
        if self.is_mla:
            return self.layers * self.kv_latent_dim * kv_bytes
        return 2 * self.layers * self.kv_dim * kv_bytes

    def unique_experts(self, tokens: float) -> float:
        """Expected distinct experts touched by ``tokens`` tokens under uniform routing."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens)


# ---- derivations ---------------------------------------------------------------------------------
def _layer_windows(cfg: Mapping[str, Any], n: int, model_type: str) -> tuple[int | None, ...]:
    """Sliding window (or None) for each layer, from ``layer_types`` or the older flags, as HF does."""
    window = cfg.get("sliding_window")
    window = int(window) if window else None
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ConfigError(
                f"config.json lists {len(types)} layer_types but num_hidden_layers is {n}; they must agree",
                param="layer_types",
            )
        unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ConfigError(f"layer_types has unknown entries {unknown}; supported: {list(LAYER_TYPES)}",
                              param="layer_types")
        if SLIDING_ATTENTION in types and not window:
            raise ConfigError("layer_types lists sliding_attention layers but sliding_window is not set",
                              param="sliding_window")
        return tuple(window if t == SLIDING_ATTENTION else None for t in types)
    if model_type in ("mistral", "mixtral") and window:  # every layer slides (HF Mistral / Mixtral)
        return (window,) * n
    if cfg.get("use_sliding_window") and window:  # Qwen2/3: layers from max_window_layers on
        start = cfg.get("max_window_layers", n)
        return tuple(window if i >= start else None for i in range(n))
    return (None,) * n


def _opt_float(value: Any) -> float | None:
    return float(value) if value is not None else None


def _gemma3_rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3: ``rope_parameters`` keyed by layer type (transformers >= 5), or the older
    ``rope_theta`` / ``rope_scaling`` (global layers) and ``rope_local_base_freq`` (sliding layers)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(FULL_ATTENTION), Mapping):
        full = dict(params[FULL_ATTENTION])
        local = params.get(SLIDING_ATTENTION) or {}
        theta = float(full.pop("rope_theta", 1_000_000.0))
        scaling = full if full.get("rope_type", "default") != "default" else None
        return theta, scaling, float(local.get("rope_theta", 10_000.0))
    _, scaling = _rope(cfg)
    return float(cfg.get("rope_theta") or 1_000_000.0), scaling, float(cfg.get("rope_local_base_freq") or 10_000.0)


def _mla_fields(cfg: Mapping[str, Any], heads: int) -> dict[str, Any]:
    """DeepSeek-V2/V3 multi-latent attention sizes, checked to add up."""
    rank = cfg.get("kv_lora_rank")
    if not rank:
        return {}
    out: dict[str, Any] = {"rope_interleave": bool(cfg.get("rope_interleave", True))}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"multi-latent attention needs a positive integer {key}, got {value!r}", param=key)
        out[key] = value
    q_rank = cfg.get("q_lora_rank") or 0
    if not isinstance(q_rank, int) or q_rank < 0:
        raise ConfigError(f"q_lora_rank must be a non-negative integer or null, got {q_rank!r}", param="q_lora_rank")
    out["q_lora_rank"] = q_rank
    if out["qk_rope_head_dim"] % 2:
        raise ConfigError(f"qk_rope_head_dim must be even for rotary embedding, got {out['qk_rope_head_dim']}",
                          param="qk_rope_head_dim")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim not in (out["qk_rope_head_dim"], out["qk_nope_head_dim"] + out["qk_rope_head_dim"]):
        raise ConfigError(
            f"head_dim={head_dim} must equal qk_rope_head_dim ({out['qk_rope_head_dim']}) or qk_nope_head_dim + "
            f"qk_rope_head_dim ({out['qk_nope_head_dim'] + out['qk_rope_head_dim']})", param="head_dim")
    return out


def _deepseek_moe_fields(cfg: Mapping[str, Any], layers: int, arch: str) -> dict[str, Any]:
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
        raise ConfigError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)", param="topk_method")
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or n_group)
    if method != "greedy" and (e % n_group or not 1 <= topk_group <= n_group):
        raise ConfigError(f"n_routed_experts={e} must split into n_group={n_group} groups, and 1 <= topk_group "
                          f"<= n_group (got {topk_group})", param="n_group")
    if method == "noaux_tc" and topk_group * (e // n_group) < k:
        raise ConfigError(f"topk_group={topk_group} groups of {e // n_group} experts cannot supply "
                          f"num_experts_per_tok={k}", param="topk_group")
    first = int(cfg.get("first_k_dense_replace") or 0)
    inter = int(cfg.get("moe_intermediate_size") or 0)
    return {
        "moe_layer_ids": tuple(range(min(first, layers), layers)),
        "num_experts": e,
        "experts_per_tok": k,
        "expert_intermediate": inter,
        "shared_expert_intermediate": inter * int(cfg.get("n_shared_experts") or 0),
        "renormalize_topk": bool(cfg.get("norm_topk_prob", False)) and v3,  # HF V2 never renormalizes
        "router_scoring": "sigmoid" if v3 else "softmax",
        "topk_method": method,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
    }


def _moe_fields(cfg: Mapping[str, Any], layers: int, arch: str, need) -> dict[str, Any]:
    if cfg.get("n_routed_experts"):
        return _deepseek_moe_fields(cfg, layers, arch)
    # transformers 5 writes `num_local_experts` for Qwen3-MoE too; Qwen's own configs say `num_experts`
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if num_experts <= 0:
        return {"moe_layer_ids": ()}
    k = int(cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or 0)
    if not 1 <= k <= num_experts:
        raise ConfigError(f"MoE config needs 1 <= num_experts_per_tok <= {num_experts}, got {k}",
                          param="num_experts_per_tok")
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    mixtral = arch == "MixtralForCausalLM" or cfg.get("model_type") == "mixtral"
    return {
        "moe_layer_ids": tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0),
        "num_experts": num_experts,
        "experts_per_tok": k,
        # Mixtral's experts are intermediate_size wide; Qwen-MoE's moe_intermediate_size
        "expert_intermediate": int(cfg.get("moe_intermediate_size") or need("intermediate_size")),
        "shared_expert_intermediate": int(cfg.get("shared_expert_intermediate_size") or 0),
        "renormalize_topk": True if mixtral else bool(cfg.get("norm_topk_prob", False)),
    }


def _rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers >= 5 writes one ``rope_parameters`` dict; older versions ``rope_theta`` plus an
    optional ``rope_scaling``. Both give (theta, scaling or None)."""
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = theta if theta is not None else params.get("rope_theta")
        if params.get("rope_type", "default") != "default" and not scaling:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(f"rope_scaling must be an object, got {type(scaling).__name__}", param="rope_scaling")
    return float(theta if theta is not None else 10000.0), (dict(scaling) if scaling else None)


def eos_token_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """config.json's ``eos_token_id`` (an int, a list of ints, or absent) as a tuple.

    Public because ``generation_config`` also reads it from config.json files that are not complete
    decoder configs (and so have no spec)."""
    value = cfg.get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"eos_token_id in config.json must be an int or a list of ints, got {value!r}",
                          param="eos_token_id")
    return tuple(values)


# ---- loading -------------------------------------------------------------------------------------
def load_model_spec(path: str | Path) -> ModelSpec:
    """The spec of the model in directory ``path`` (or of the config.json file ``path``), named after
    the directory."""
    from forwardpass.loader.config import load_model_config

    return ModelSpec.from_config(load_model_config(path), name=model_name(path))


def model_name(path: str | Path) -> str:
    """A model's display name: its directory's name (also for a path to its config.json)."""
    path = Path(path)
    name = path.parent.name if path.is_file() else path.name
    return name or str(path)

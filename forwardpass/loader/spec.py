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

Models that keep a state instead of (or next to) a KV cache get ``layer_mixers`` (what each layer
mixes with: attention, a Mamba2 mixer, a Gated DeltaNet, or nothing but an MLP) and their sizes:
``SSMSpec`` (``_ssm_fields``: Mamba2, Nemotron-H's ``layers_block_type`` / ``hybrid_override_pattern``)
and ``GDNSpec`` (``_gdn_fields``: Qwen3-Next's ``layer_types`` and ``linear_*`` keys, its partial
rotary and attention output gate). ``state_bytes_per_sequence`` is what one request keeps in those
layers whatever its length; ``kv_bytes_per_token`` counts the attention layers only.

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

# what a decoder layer mixes with (``ModelSpec.layer_mixers``); () means attention + MLP in every layer
MIXER_ATTENTION = "attention"  # attention (paged KV) and, unless the model says otherwise, an MLP
MIXER_MAMBA = "mamba"  # a Mamba2 mixer: a fixed-size state per request (conv window + SSM state)
MIXER_MLP = "mlp"  # an MLP alone (Nemotron-H "-" layers): nothing cached
MIXER_MOE = "moe"  # a MoE alone (Nemotron-H "E" layers): nothing cached
MIXER_GDN = "gated_deltanet"  # Gated DeltaNet linear attention (Qwen3-Next): a fixed-size state per request

LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# architectures whose attention has a per-head RMSNorm on q and k before RoPE
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
_GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class SSMSpec:
    """A Mamba2 mixer's sizes (Mamba2 ``num_heads`` / ``head_dim`` / ``state_size``; Nemotron-H
    ``mamba_num_heads`` / ``mamba_head_dim`` / ``ssm_state_size``)."""

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
        return (self.hidden_in * in_proj + self.conv_dim * (self.conv_kernel + 1) + 3 * self.heads + self.inner
                + self.inner * self.hidden_in)

    hidden_in: int = 0  # the model's hidden size (for ``params``)


@dataclass(frozen=True)
class GDNSpec:
    """A Gated DeltaNet layer's sizes (Qwen3-Next ``linear_*``): q/k heads of ``k_dim``, v heads of
    ``v_dim`` (a multiple of the k heads), a short causal conv over q, k, v."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    chunk: int = 64  # the chunked delta rule's block length (HF's torch_chunk_gated_delta_rule default)
    hidden_in: int = 0

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
        return (self.hidden_in * (qkvz + 2 * self.v_heads) + self.conv_dim * self.conv_kernel + 2 * self.v_heads
                + self.v_dim + self.v_heads * self.v_dim * self.hidden_in)


DSV4_SLIDING = "sliding_attention"
DSV4_CSA = "compressed_sparse_attention"  # compressed every m tokens, an indexer picks top-k entries per query
DSV4_HCA = "heavily_compressed_attention"  # compressed every m' tokens, every entry visible


@dataclass(frozen=True)
class DeepseekV4Spec:
    """DeepSeek-V4's compressed attention, hyper-connections and routing (``_deepseek_v4_fields``).

    Every layer attends to its last ``window`` tokens (one shared K=V head); a CSA / HCA layer also
    reads the compressed entries emitted so far: one per ``compress_rates[layer]`` tokens, pooled with
    learned softmax gates (CSA: over two overlapping windows, and only the indexer's top
    ``index_topk`` entries per query). The entries grow with the sequence (paged, one entry dim per
    compressed position); the tokens of the open window(s) are a fixed-size per-request state."""

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

    def attention_params(self, layer: int, hidden: int, heads: int, q_lora_rank: int) -> int:
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
            out += q_lora_rank * self.index_heads * di + hidden * self.index_heads + 4 * hidden * di + 2 * m * di + di
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

    def entries_cache_id(self, layer: int) -> int:
        """Cache index of a compressed layer's entries (sliding K=V pages use the layer's own index)."""
        return self.layers + layer

    def state_cache_id(self, layer: int) -> int:
        return 2 * self.layers + layer


@dataclass(frozen=True)
class WhisperSpec:
    """Whisper's audio encoder (``_whisper_spec``); the ModelSpec's own sizes describe its decoder.

    The encoder reads ``2 * max_source_positions`` log-mel frames (two convolutions, the second with
    stride 2), so its output, and every request's cross-attention K/V, has ``max_source_positions``
    positions: 1500 (30 s of audio) for the released checkpoints, fewer for a smaller config."""

    num_mel_bins: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    max_source_positions: int
    decoder_start_token_id: int

    @property
    def encoder_input_frames(self) -> int:
        """10 ms log-mel frames the encoder reads (the audio is padded or trimmed to this)."""
        return 2 * self.max_source_positions

    @property
    def encoder_seconds(self) -> float:
        return self.encoder_input_frames / 100.0


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
    # state-space / hybrid models: what each layer mixes with (MIXER_*); () = attention + MLP everywhere
    layer_mixers: tuple[str, ...] = ()
    ssm: SSMSpec | None = None  # the Mamba2 mixer's sizes when some layer is MIXER_MAMBA
    mlp_gated: bool = True  # False: up -> act -> down (Nemotron-H, relu2)
    gdn: GDNSpec | None = None  # Gated DeltaNet sizes when some layer is MIXER_GDN (Qwen3-Next)
    attn_output_gate: bool = False  # attention output times sigmoid(a per-head gate from q_proj) (Qwen3-Next)
    partial_rotary: float = 1.0  # fraction of head_dim that is rotated (Qwen3-Next 0.25)
    # BERT-style encoders: learned absolute positions, segment (token type) embeddings, post-LayerNorm
    type_vocab_size: int = 0  # segment embeddings (BERT 2); 0 = none
    dsv4: DeepseekV4Spec | None = None  # DeepSeek-V4 compressed attention, hyper-connections, routing
    whisper: WhisperSpec | None = None  # encoder–decoder speech model: the audio encoder's sizes

    def __post_init__(self) -> None:
        if not self.layer_windows:  # built by hand without windows: every layer attends to everything
            object.__setattr__(self, "layer_windows", (None,) * self.layers)
        elif len(self.layer_windows) != self.layers:
            raise ConfigError(f"layer_windows has {len(self.layer_windows)} entries for {self.layers} layers",
                              param="layer_types")
        if self.layer_mixers and len(self.layer_mixers) != self.layers:
            raise ConfigError(f"layer_mixers has {len(self.layer_mixers)} entries for {self.layers} layers",
                              param="layers_block_type")
        if MIXER_MAMBA in self.layer_mixers and self.ssm is None:
            raise ConfigError("Mamba layers need the SSM sizes (ssm)", param="state_size")
        if MIXER_GDN in self.layer_mixers and self.gdn is None:
            raise ConfigError("Gated DeltaNet layers need their sizes (gdn)", param="linear_num_key_heads")

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], name: str = "") -> ModelSpec:
        """Build the spec from a config.json mapping (already un-nested from ``text_config``)."""
        validate_config(cfg, name)  # typed bounds of every size (and checkpoint shapes) before any allocation
        if cfg.get("model_type") == "whisper":  # encoder–decoder: its own key names (d_model, decoder_layers, ...)
            return _whisper_spec(cls, cfg, name)

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
        ssm_fields = _ssm_fields(cfg, hidden) or _gdn_fields(cfg, hidden)
        if ssm_fields and "gdn" in ssm_fields:  # Qwen3-Next: attention sizes as usual
            layers = len(ssm_fields["layer_mixers"])
            heads = int(need("num_attention_heads"))
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
        elif ssm_fields:
            mixers = ssm_fields["layer_mixers"]
            layers = len(mixers)
            ssm = ssm_fields["ssm"]
            heads = int(cfg.get("num_attention_heads") or ssm.heads)
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads) if MIXER_ATTENTION in mixers else ssm.head_dim
        else:
            layers = int(need("num_hidden_layers"))
            heads = int(need("num_attention_heads"))
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
        mla = _mla_fields(cfg, heads)
        if mla:  # every head has its own K/V expanded from one latent; head_dim is the q·k width
            kv_heads, head_dim = heads, mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        v4 = _deepseek_v4_fields(cfg, layers, heads, head_dim)
        if v4:  # one K=V head shared by every query head
            kv_heads = 1
        vocab = int(need("vocab_size"))
        archs = cfg.get("architectures") or [""]
        arch = str(archs[0])
        model_type = str(cfg.get("model_type") or "")
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                              param="num_key_value_heads")

        if ssm_fields and "gdn" not in ssm_fields:  # Mamba2 / Nemotron-H: its MoE fields (if any) came with it
            moe = {k: ssm_fields.pop(k) for k in list(ssm_fields) if k not in ("layer_mixers", "ssm", "mlp_gated")}
            moe.setdefault("moe_layer_ids", ())
        else:
            moe = v4.pop("moe") if v4 else _moe_fields(cfg, layers, arch, need)
        intermediate = int(cfg.get("intermediate_size") or 0)
        if ssm_fields.get("ssm") is not None and MIXER_MLP not in ssm_fields["layer_mixers"]:
            intermediate = 0  # Mamba2: no MLP at all
        elif len(moe["moe_layer_ids"]) < layers and intermediate <= 0:
            raise ConfigError(f"config {name} has dense layers but no 'intermediate_size'", param="intermediate_size")
        rope_theta, rope_scaling = (v4.pop("rope_theta"), None) if v4 else _rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        # Qwen2 always has q/k/v bias and never an o_proj bias (HF Qwen2Attention ignores attention_bias)
        qwen2 = model_type == "qwen2" or arch == "Qwen2ForCausalLM"
        eps = cfg.get("rms_norm_eps")
        if eps is None:  # BERT names its LayerNorm epsilon layer_norm_eps; rms_norm_eps is "the norm's eps"
            eps = cfg.get("layer_norm_eps")
        max_pos = cfg.get("max_position_embeddings")
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        layer_windows = (v4.pop("layer_windows") if v4 else _layer_windows(cfg, layers, model_type)
                         if not ssm_fields else (None,) * layers)
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
            hidden_act=str(cfg.get("mlp_hidden_act") or cfg.get("hidden_act") or cfg.get("hidden_activation")
                           or "silu"),
            rms_norm_eps=float(eps if eps is not None else cfg.get("layer_norm_epsilon") or 1e-6),
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
            **ssm_fields,
            **_encoder_fields(cfg, model_type),
            **v4,
        )

    # ---- attention layout ------------------------------------------------------------------------
    def mixer(self, layer: int) -> str:
        """What ``layer`` mixes tokens with: MIXER_ATTENTION, MIXER_MAMBA or MIXER_MLP (none)."""
        return self.layer_mixers[layer] if self.layer_mixers else MIXER_ATTENTION

    @property
    def attention_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.mixer(i) == MIXER_ATTENTION)

    @property
    def mamba_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.mixer(i) == MIXER_MAMBA)

    @property
    def gdn_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.mixer(i) == MIXER_GDN)

    def state_bytes_per_sequence(self, state_bytes: float) -> float:
        """The fixed-size state one request keeps in every Mamba / Gated DeltaNet layer (constant in
        its length)."""
        mamba = self.mamba_layers * self.ssm.state_size if self.ssm is not None else 0
        gdn = self.gdn_layers * self.gdn.state_size if self.gdn is not None else 0
        v4 = sum(self.dsv4.state_size(i) for i in range(self.layers)) if self.dsv4 is not None else 0
        return (mamba + gdn + v4) * state_bytes

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
        if not self.layer_windows or self.dsv4 is not None:  # DeepSeek-V4: its entries cover the whole context
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
        """Layers with a dense MLP (Mamba2: none; Nemotron-H: its MLP layers)."""
        if self.ssm is not None:
            return sum(1 for m in self.layer_mixers if m == MIXER_MLP)
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
        gate = self.hidden * self.q_dim if self.attn_output_gate else 0  # Qwen3-Next: q_proj gives a gate too
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + gate

    @property
    def norm_params(self) -> int:
        """The RMSNorms of one layer: two (and Qwen3's per-head q/k norms); one in a Mamba2 /
        Nemotron-H block (the mixer's own gated norm is in ``SSMSpec.params``)."""
        if self.ssm is not None:
            return self.hidden
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def total_norm_params(self) -> int:
        """The RMSNorms of every layer (q/k norms only where there is attention), not the final one."""
        qk = 2 * self.head_dim if self.qk_norm and self.ssm is None else 0
        return self.layers * (self.norm_params - qk) + self.attention_layers * qk

    @property
    def expert_params(self) -> int:
        return (3 if self.mlp_gated else 2) * self.hidden * self.expert_intermediate  # Nemotron-H: up, down

    @property
    def router_params(self) -> int:
        shared_gate = self.shared_expert_intermediate and self.ssm is None  # Nemotron-H's shared expert has none
        return self.hidden * self.num_experts + (self.hidden if shared_gate else 0)

    @property
    def shared_expert_params(self) -> int:
        return (3 if self.mlp_gated else 2) * self.hidden * self.shared_expert_intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Extra LM-head parameters (0 when tied to the embedding, which it then reads)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def mixer_params(self) -> int:
        """Token-mixing parameters of all layers: attention, Mamba2 and Gated DeltaNet mixers."""
        mamba = self.mamba_layers * self.ssm.params if self.ssm is not None else 0
        gdn = self.gdn_layers * self.gdn.params if self.gdn is not None else 0
        return self.attention_layers * self.attention_params + mamba + gdn

    @property
    def params(self) -> int:
        """Total parameters (every expert)."""
        if self.dsv4 is not None:  # per-layer attention kinds, hyper-connections, routers without a shared gate
            v4, h = self.dsv4, self.hidden
            moe = self.num_experts * (self.expert_params + h) + self.shared_expert_params
            attention = sum(v4.attention_params(i, h, self.heads, self.q_lora_rank) for i in range(self.layers))
            head = v4.hc_mult * (v4.hc_mult * h + 1) + 1
            return (attention + self.layers * (2 * h + v4.hyper_params(h) + moe) + self.embedding_params
                    + self.lm_head_params + h + head)
        moe = self.num_experts * self.expert_params + self.router_params + self.shared_expert_params
        return (
            self.mixer_params
            + self.total_norm_params
            + self.dense_layers * (3 if self.mlp_gated else 2) * self.hidden * self.intermediate
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
        """K and V of one token in every layer (MLA: the latent vector only; DeepSeek-V4: what the cache
        grows by per token, its compressed entries, since the sliding window is bounded)."""
        if self.dsv4 is not None:
            v4 = self.dsv4
            return sum(v4.entry_dim(i) / m for i, m in enumerate(v4.compress_rates) if m) * kv_bytes
        if self.is_mla:
            return self.layers * self.kv_latent_dim * kv_bytes
        return 2 * self.attention_layers * self.kv_dim * kv_bytes  # Mamba / DeltaNet layers keep a state instead

    @property
    def state_flops_per_token(self) -> float:
        """FLOPs of the state updates and reads per token (recurrent form): Mamba2 decays the state,
        adds ``dt·x⊗B`` and reads it with ``C`` (~6 per state value); the delta rule decays, predicts
        ``Sᵀk``, writes and reads with ``q`` (~8 per state value). The causal convs are left out."""
        mamba = 6 * self.mamba_layers * self.ssm.ssm_state_size if self.ssm is not None else 0
        gdn = 8 * self.gdn_layers * self.gdn.v_heads * self.gdn.k_dim * self.gdn.v_dim if self.gdn is not None else 0
        return float(mamba + gdn)

    def unique_experts(self, tokens: float) -> float:
        """Expected distinct experts touched by ``tokens`` tokens under uniform routing."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens)


# ---- derivations ---------------------------------------------------------------------------------
_NEMOTRON_H_TYPES = {"linear_attention": MIXER_MAMBA, "full_attention": MIXER_ATTENTION, "mlp": MIXER_MLP,
                     "moe": MIXER_MOE}
_NEMOTRON_H_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _ssm_fields(cfg: Mapping[str, Any], hidden: int) -> dict[str, Any]:
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
            raise ConfigError("Nemotron-H MoE layers with a latent projection (moe_latent_size) are not supported",
                              param="moe_latent_size")
        mixers = tuple(_NEMOTRON_H_TYPES[t] for t in types)
        heads, head_dim, state = cfg.get("mamba_num_heads"), cfg.get("mamba_head_dim"), cfg.get("ssm_state_size")
        mlp_gated = False
    else:
        return {}
    if not mixers:
        raise ConfigError(f"a {model_type} config needs num_hidden_layers >= 1", param="num_hidden_layers")
    sizes = {"heads": heads, "head_dim": head_dim, "state": state, "groups": cfg.get("n_groups", 1),
             "conv_kernel": cfg.get("conv_kernel", 4), "chunk": cfg.get("chunk_size", 256)}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
            raise ConfigError(f"{model_type}: the Mamba2 {key} must be an integer in [1, 65536], got {value!r:.40}",
                              param=key)
    if heads % sizes["groups"]:
        raise ConfigError(f"{model_type}: the Mamba2 heads ({heads}) must split into n_groups={sizes['groups']}",
                          param="n_groups")
    if model_type == "mamba2" and int(cfg.get("expand") or 2) * hidden != heads * head_dim:
        raise ConfigError(f"mamba2: hidden_size * expand must equal num_heads * head_dim ({heads * head_dim})",
                          param="num_heads")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    lo, hi = (_json_float(v) for v in limit)
    if model_type == "nemotron_h":  # HF NemotronHMamba2Mixer: (time_step_min, inf), whatever the config says
        lo, hi = float(cfg.get("time_step_min") or 0.0), float("inf")
    ssm = SSMSpec(**sizes, conv_bias=bool(cfg.get("use_conv_bias", True)), bias=bool(cfg.get("use_bias", False)),
                  norm_eps=float(cfg.get("layer_norm_epsilon") or 1e-5), dt_min=lo, dt_max=hi, hidden_in=hidden)
    out: dict[str, Any] = {"layer_mixers": mixers, "ssm": ssm, "mlp_gated": mlp_gated}
    if MIXER_MOE in mixers:  # DeepSeek-V3 routing (sigmoid, bias-corrected groups), non-gated relu² experts
        moe = _deepseek_moe_fields({**cfg, "model_type": "deepseek_v3",
                                    "n_shared_experts": 0, "first_k_dense_replace": 0}, len(mixers), "")
        shared = cfg.get("moe_shared_expert_intermediate_size") or 0
        out.update(moe, moe_layer_ids=tuple(i for i, m in enumerate(mixers) if m == MIXER_MOE),
                   shared_expert_intermediate=int(shared))
    return out


def _gdn_fields(cfg: Mapping[str, Any], hidden: int) -> dict[str, Any]:
    """Qwen3-Next: ``layer_types`` of ``linear_attention`` (Gated DeltaNet) and ``full_attention`` (gated
    attention with a partial rotary embedding) layers, each followed by its MLP or MoE."""
    if cfg.get("model_type") != "qwen3_next":
        return {}
    types = cfg.get("layer_types")
    kinds = {"linear_attention": MIXER_GDN, "full_attention": MIXER_ATTENTION}
    if not isinstance(types, list) or not types or any(t not in kinds for t in types):
        raise ConfigError(f"a Qwen3-Next config needs layer_types of {sorted(kinds)}, got {types!r:.80}",
                          param="layer_types")
    n = cfg.get("num_hidden_layers")
    if n is not None and n != len(types):
        raise ConfigError(f"config.json lists {len(types)} layer_types but num_hidden_layers is {n}; they must agree",
                          param="layer_types")
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
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {partial}", param="partial_rotary_factor")
    return {"layer_mixers": tuple(kinds[t] for t in types), "gdn": GDNSpec(**sizes, hidden_in=hidden),
            "attn_output_gate": True, "partial_rotary": partial}


def _encoder_fields(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """BERT-style encoders: the segment-embedding count, and only learned absolute positions (the
    ``relative_key*`` variants add a distance embedding to the attention scores, which is not built)."""
    if model_type != "bert":
        return {}
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ConfigError(f"position_embedding_type {kind!r} is not supported; only 'absolute' BERT models are",
                          param="position_embedding_type")
    if not cfg.get("max_position_embeddings"):
        raise ConfigError("a BERT config needs max_position_embeddings (its learned position table)",
                          param="max_position_embeddings")
    return {"type_vocab_size": int(cfg.get("type_vocab_size") or 0)}


def _json_float(value: Any) -> float:
    """A float, also transformers' ``{"__float__": "Infinity"}`` encoding of a non-finite one."""
    if isinstance(value, Mapping):
        value = value.get("__float__")
    return float(value)

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


_DSV4_RATE_TYPES = {0: DSV4_SLIDING, 4: DSV4_CSA, 128: DSV4_HCA}  # legacy per-layer compress_ratios


def _deepseek_v4_fields(cfg: Mapping[str, Any], layers: int, heads: int, head_dim: int) -> dict[str, Any]:
    """DeepSeek-V4 (as transformers' ``DeepseekV4Config`` resolves it): attention layer types and
    compress rates, hash / top-k MoE layers, the two rotary bases (``main`` for sliding layers,
    ``compress`` for CSA / HCA layers and their compressors), hyper-connection and indexer sizes."""
    if cfg.get("model_type") != "deepseek_v4":
        return {}
    if cfg.get("quantization_config"):
        raise ConfigError("DeepSeek-V4 checkpoints with a quantization_config (FP8 / FP4 experts) are not supported; "
                          "use a bf16 / fp32 checkpoint", param="quantization_config")
    rates = dict(cfg.get("compress_rates") or {DSV4_CSA: 4, DSV4_HCA: 128})
    for key, legacy in ((DSV4_CSA, "compress_rate_csa"), (DSV4_HCA, "compress_rate_hca")):
        rates[key] = cfg.get(legacy) or rates.get(key)
    types = cfg.get("layer_types")
    if types is None and isinstance(cfg.get("compress_ratios"), list):
        types = [_DSV4_RATE_TYPES.get(r, str(r)) for r in cfg["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA interleaved
        types = [DSV4_HCA] * min(layers, 2) + [DSV4_CSA if i % 2 else DSV4_HCA for i in range(max(layers - 2, 0))]
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
        raise ConfigError(f"DeepSeek-V4 layer_types / mlp_layer_types has unknown entries {bad}", param="layer_types")
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
        raise ConfigError(f"num_attention_heads={heads} must split into o_groups={sizes['o_groups']}", param="o_groups")
    partial = cfg.get("partial_rotary_factor")
    rope_dim = int(head_dim * partial) if partial else int(cfg.get("qk_rope_head_dim") or head_dim // 8)
    if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, sizes["index_head_dim"]):
        raise ConfigError(f"the rotary part ({rope_dim}) must be even and fit head_dim and index_head_dim",
                          param="partial_rotary_factor")
    scoring = str(cfg.get("scoring_func") or "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ConfigError(f"scoring_func {scoring!r} is not supported (sqrtsoftplus, sigmoid)", param="scoring_func")
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
        swiglu_limit=float(cfg.get("swiglu_limit") or 10.0), scoring=scoring)
    # one shared expert of moe_intermediate_size whatever n_shared_experts says (as transformers builds it);
    # the chosen experts' weights are always renormalized
    moe = {"moe_layer_ids": tuple(range(layers)), "num_experts": experts, "experts_per_tok": k,
           "expert_intermediate": inter, "shared_expert_intermediate": inter, "renormalize_topk": True,
           "router_scoring": scoring, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0)}
    return {"dsv4": dsv4, "moe": moe, "layer_windows": (window,) * layers, "q_lora_rank": sizes["q_lora_rank"],
            "qk_rope_head_dim": rope_dim, "rope_theta": main_theta, "rope_interleave": True}


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


def _whisper_spec(cls: type[ModelSpec], cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Whisper: the decoder as the spec's layers (pre-LayerNorm, GELU MLP, learned positions, q/v/o
    biases, the LM head tied to the token embeddings), the encoder as ``WhisperSpec``."""

    def need(key: str) -> int:
        value = cfg.get(key)
        if value is None:
            raise ConfigError(f"a Whisper config needs {key!r}", param=key)
        return int(value)

    hidden = need("d_model")
    heads, enc_heads = need("decoder_attention_heads"), need("encoder_attention_heads")
    for key, h in (("decoder_attention_heads", heads), ("encoder_attention_heads", enc_heads)):
        if hidden % h:
            raise ConfigError(f"d_model={hidden} is not a multiple of {key}={h}", param=key)
    # scale_embedding is ignored, as transformers' WhisperDecoder ignores it (its embed_scale is never applied)
    if need("num_mel_bins") not in (80, 128):
        raise ConfigError(f"num_mel_bins must be 80 or 128 (Whisper's log-mel filter banks), got {cfg['num_mel_bins']}",
                          param="num_mel_bins")
    act = str(cfg.get("activation_function") or "gelu")
    if act != "gelu":
        raise ConfigError(f"Whisper activation_function {act!r} is not supported (only 'gelu')",
                          param="activation_function")
    archs = cfg.get("architectures") or ["WhisperForConditionalGeneration"]
    return cls(
        name=name or str(cfg.get("_name_or_path") or archs[0]),
        architecture=str(archs[0]),
        model_type="whisper",
        hidden=hidden,
        layers=need("decoder_layers"),
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        intermediate=need("decoder_ffn_dim"),
        vocab=need("vocab_size"),
        tied=True,
        qkv_bias=True,  # q and v have biases, k has none (the model knows)
        o_bias=True,
        mlp_bias=True,
        hidden_act="gelu",
        rms_norm_eps=1e-5,  # torch LayerNorm's default, which Whisper uses
        max_position_embeddings=need("max_target_positions"),
        eos_token_ids=eos_token_ids(cfg),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        whisper=WhisperSpec(
            num_mel_bins=need("num_mel_bins"),
            encoder_layers=need("encoder_layers"),
            encoder_heads=enc_heads,
            encoder_ffn_dim=need("encoder_ffn_dim"),
            max_source_positions=need("max_source_positions"),
            decoder_start_token_id=need("decoder_start_token_id"),
        ),
    )

"""The Llama family decoder: embedding → N × (RMSNorm, attention, RMSNorm, gated MLP) → RMSNorm → LM head.

Llama, Mistral, Qwen2 and Qwen3 differ only in switches this file reads from config.json:
q/k/v bias (Qwen2, Llama's ``attention_bias``), per-head q/k RMSNorm (Qwen3), sliding-window layers
(Mistral, Qwen2/3 ``layer_types``), explicit ``head_dim``, tied embeddings, ``rope_scaling``. The
architecture files next to this one pick the switches; nothing is copied between them.

Forward takes the engine's flattened batch: ``input_ids`` and ``positions`` are ``[T]`` and the
attention context maps rows to sequences (see ``forwardpass/attention/context.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from forwardpass.attention.context import AttentionContext
from forwardpass.attention.layer import CachedAttention
from forwardpass.errors import ModelLoadError
from forwardpass.layers.linear import Linear, MergedLinear, linear
from forwardpass.layers.mlp import GatedMLP
from forwardpass.layers.norm import RMSNorm
from forwardpass.layers.rotary import RotaryEmbedding, apply_rotary
from forwardpass.loader.config import ModelConfig


@dataclass(frozen=True)
class DecoderFlavor:
    qkv_bias: bool = False  # bias on q/k/v (Qwen2)
    o_bias: bool = False  # bias on o_proj (Llama with attention_bias=True)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)


def layer_sliding_windows(cfg: ModelConfig) -> list[int | None]:
    """Sliding window (or None) for each layer, from ``layer_types`` or the older flags."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ModelLoadError(
                f"config.json lists {len(types)} layer_types but num_hidden_layers is {n}; they must agree"
            )
        return [window if t == "sliding_attention" else None for t in types]
    if cfg.get("model_type") == "mistral" and window:
        return [window] * n
    if cfg.get("use_sliding_window") and window:
        start = cfg.get("max_window_layers", n)
        return [window if i >= start else None for i in range(n)]
    return [None] * n


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, flavor: DecoderFlavor, layer_idx: int, sliding_window: int | None):
        super().__init__()
        hidden, d = cfg["hidden_size"], cfg["head_dim"]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        self.qkv_proj = MergedLinear(
            hidden,
            {"q_proj": self.num_heads * d, "k_proj": self.num_kv_heads * d, "v_proj": self.num_kv_heads * d},
            bias=flavor.qkv_bias,
        )
        self.o_proj = Linear(self.num_heads * d, hidden, bias=flavor.o_bias)
        self.q_norm = RMSNorm(d, cfg["rms_norm_eps"]) if flavor.qk_norm else None
        self.k_norm = RMSNorm(d, cfg["rms_norm_eps"]) if flavor.qk_norm else None
        self.attn = CachedAttention(layer_idx, scale=d**-0.5, sliding_window=sliding_window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext | None):
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q, k, v, ctx)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, flavor: DecoderFlavor, layer_idx: int, sliding_window: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = DecoderAttention(cfg, flavor, layer_idx, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = self.build_mlp(cfg, layer_idx)

    def build_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"),
                        bias=bool(cfg.get("mlp_bias", False)))

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, flavor: DecoderFlavor, layer_cls: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], _freeze=True)
        windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(layer_cls(cfg, flavor, i, windows[i]) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.rotary = RotaryEmbedding(cfg["head_dim"], cfg["rope_theta"], cfg.get("rope_scaling"))

    def forward(self, input_ids, positions, ctx):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # computed once, shared by every layer
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Also the base class of the other Llama-family architectures."""

    flavor = DecoderFlavor()
    layer_cls: type[DecoderLayer] = DecoderLayer
    #: merged module → the checkpoint modules stored side by side in it (see MergedLinear)
    packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.flavor_for(cfg), self.layer_cls)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None  # logits use the embedding matrix itself: one copy in memory
        else:
            self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"])

    @classmethod
    def flavor_for(cls, cfg: ModelConfig) -> DecoderFlavor:
        bias = bool(cfg.get("attention_bias", False))
        return DecoderFlavor(qkv_bias=bias, o_bias=bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None = None):
        """Hidden states ``[T, hidden]`` of every input row (logits are computed only where needed)."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

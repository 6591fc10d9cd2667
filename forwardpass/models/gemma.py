"""Gemma 2 and Gemma 3 (text): the Llama decoder with interleaved local (sliding-window) and global layers.

What differs from ``llama.py``, all resolved into the :class:`~forwardpass.models.model_spec.ModelSpec`:

* RMSNorm scales by ``1 + weight`` (weights are stored as offsets from 1), in fp32;
* four norms per layer: before and after attention, before and after the MLP (sandwich norms);
* the token embedding is multiplied by ``sqrt(hidden)``; the LM head is tied to it;
* queries are scaled by ``query_pre_attn_scalar ** -0.5`` (``GemmaSpec.attn_scale``), not
  ``head_dim ** -0.5``;
* ``layer_types`` alternates sliding-window and full layers (``spec.layer_windows``); the KV cache puts
  them in two groups, and the sliding group frees its blocks behind the window;
* Gemma 2 caps attention scores and output logits with ``tanh(x / c) · c``
  (``attn_logit_softcapping``, ``final_logit_softcapping``);
* Gemma 3 adds per-head q/k RMSNorm (``1 + weight``) and rotates sliding layers with their own rope base
  (``rope_local_base_freq`` / ``rope_parameters["sliding_attention"]``, ``GemmaSpec.local_rope_theta``); its
  global layers may use ``rope_scaling``.
"""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.attention.context import AttentionContext
from forwardpass.attention.layer import CachedAttention
from forwardpass.layers.rotary import RotaryEmbedding
from forwardpass.models.decoder import DecoderModel
from forwardpass.models.gemma_spec import GemmaSpec
from forwardpass.models.llama import DecoderAttention, DecoderLayer, LlamaForCausalLM
from forwardpass.models.model_spec import ModelSpec


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) · (1 + weight)``, computed in fp32 and cast back (as HF Gemma does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(DecoderAttention):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__(spec, layer_idx)
        if spec.norm.qk:
            self.q_norm = GemmaRMSNorm(spec.head_dim, spec.norm.eps)
            self.k_norm = GemmaRMSNorm(spec.head_dim, spec.norm.eps)
        gemma = GemmaSpec.of(spec)
        scale = gemma.attn_scale if gemma.attn_scale is not None else spec.head_dim**-0.5
        self.attn = CachedAttention(layer_idx, scale=scale, sliding_window=spec.layer_windows[layer_idx],
                                    softcap=gemma.attn_logit_softcap)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        nn.Module.__init__(self)  # not DecoderLayer's: its norms and attention are replaced
        eps = spec.norm.eps
        self.mlp = self.build_mlp(spec, layer_idx)
        self.self_attn = GemmaAttention(spec, layer_idx)
        self.input_layernorm = GemmaRMSNorm(spec.hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden, eps)
        self.local = spec.layer_windows[layer_idx] is not None

    def forward(self, x, cos, sin, ctx):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(DecoderModel):
    """The shell with Gemma's norms, the embedding times ``sqrt(hidden)``, a local rotary
    base for sliding layers."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, GemmaDecoderLayer, norm=GemmaRMSNorm,
                         rotary=RotaryEmbedding(spec.head_dim, spec.rope.theta, spec.rope.scaling))
        local_theta = GemmaSpec.of(spec).local_rope_theta
        self.local_rotary = RotaryEmbedding(spec.head_dim, local_theta) if local_theta is not None else None
        self.embed_scale = spec.hidden**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF rounds the scale to the weights' dtype

    def run_layers(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                   ctx: AttentionContext | None) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        local = self.local_rotary.cos_sin(positions, x.dtype) if self.local_rotary is not None else (cos, sin)
        for layer in self.layers:
            c, s = local if layer.local else (cos, sin)
            x = layer(x, c, s, ctx)
        return x


class Gemma2ForCausalLM(LlamaForCausalLM):
    batch_invariant_supported = False  # attention logit softcap: the paged kernel has none

    def build_decoder(self, spec: ModelSpec) -> GemmaModel:
        return GemmaModel(spec)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = GemmaSpec.of(self.spec).final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    pass  # the spec switches on q/k norm and the local rope base

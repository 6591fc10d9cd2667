"""Qwen3-Next: Gated DeltaNet linear attention interleaved with gated full attention, and a MoE with a
gated shared expert.

``layer_types`` (``ModelSpec.layer_mixers``) makes each layer either

* **Gated DeltaNet** (``MIXER_GDN``, ``linear_attn``): ``in_proj_qkvz`` / ``in_proj_ba`` give q, k, v,
  the output gate z and the per-head ``b`` (write strength β = sigmoid(b)) and ``a`` (decay
  ``g = -exp(A_log)·softplus(a + dt_bias)``), grouped per key head in the checkpoint; a short causal
  conv (SiLU, no bias) over q, k, v; the gated delta rule (``layers/gdn.py``: chunked for prefill,
  recurrent for one-token rows); RMSNorm per value head then ``· silu(z)``; ``out_proj``. Its state (conv
  window + one ``[k_dim, v_dim]`` matrix per value head) lives in the layer's state slot
  (``StateSpec``, ``ctx.for_state``);
* **gated attention** (``MIXER_ATTENTION``, ``self_attn``): ``q_proj`` gives each head's query and an
  output gate side by side; q/k RMSNorm (``1 + weight``); rotary on the first ``GDNSpec.partial_rotary`` of
  each head; paged KV; output times ``sigmoid(gate)``.

Every layer then has its MLP: a sparse MoE (softmax top-k, renormalized with ``norm_topk_prob``) plus
a shared expert scaled by ``sigmoid(shared_expert_gate(x))``, or a dense gated MLP (``mlp_only_layers``).
All RMSNorms but the DeltaNet's output norm scale by ``1 + weight``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.attention.context import AttentionContext
from forwardpass.attention.kv_cache_interface import KVCacheSpec, StateSpec
from forwardpass.attention.layer import CachedAttention
from forwardpass.layers.gdn import gated_delta_chunked, gated_delta_step
from forwardpass.layers.linear import Linear, MergedLinear
from forwardpass.layers.mlp import GatedMLP
from forwardpass.layers.moe import FusedMoE
from forwardpass.layers.rotary import RotaryEmbedding, apply_rotary
from forwardpass.layers.ssd import causal_conv, causal_conv_step
from forwardpass.models.decoder import CausalLM, DecoderModel
from forwardpass.models.gemma import GemmaRMSNorm
from forwardpass.models.mamba import Conv1d
from forwardpass.models.model_spec import MIXER_GDN, ModelSpec
from forwardpass.models.moe_loading import QWEN_EXPERT_LAYOUT, MoECausalLMMixin
from forwardpass.models.qwen3_next_spec import GDNSpec


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        assert spec.gdn is not None
        g: GDNSpec = spec.gdn
        self.g, self.layer_idx, self.eps = g, layer_idx, spec.norm.eps
        self.in_proj_qkvz = Linear(spec.hidden, 2 * g.k_heads * g.k_dim + 2 * g.v_heads * g.v_dim)
        self.in_proj_ba = Linear(spec.hidden, 2 * g.v_heads)
        self.conv1d = Conv1d(g.conv_dim, g.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(g.v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(g.v_heads), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(g.v_dim), requires_grad=False)
        self.out_proj = Linear(g.v_heads * g.v_dim, spec.hidden)

    def kv_cache_spec(self, spec: ModelSpec, block_size: int,
                      dtype: torch.dtype) -> dict[int, KVCacheSpec | None]:
        """One float32 slot per request: the conv window, then one [k_dim, v_dim] matrix per value head."""
        return {self.layer_idx: StateSpec(block_size=block_size, state_size=self.g.state_size)}

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
        g, t = self.g, x.shape[0]
        r = g.v_heads // g.k_heads  # value heads per key head
        qkvz = self.in_proj_qkvz(x).view(t, g.k_heads, -1)
        q, k, v, z = qkvz.split([g.k_dim, g.k_dim, r * g.v_dim, r * g.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, g.k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        beta = b.reshape(t, g.v_heads).sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.reshape(t, g.v_heads).float() + self.dt_bias)
        o = torch.empty(t, g.v_heads, g.v_dim, dtype=torch.float32, device=x.device)
        w = self.conv1d.weight[:, 0]
        if ctx is None:
            o[:] = self._prefill(qkv, decay, beta, None, w)[0]
        else:
            cache, meta = ctx.kv_caches[self.layer_idx], ctx.for_state(self.layer_idx)
            nd = meta.decode_slots.shape[0]
            if nd:
                state = cache[meta.decode_slots] * meta.decode_has_initial[:, None]
                o[:nd], cache[meta.decode_slots] = self._decode(qkv[:nd], decay[:nd], beta[:nd], state, w)
            for span in meta.prefills:
                rows = slice(span.q_start, span.q_start + span.q_len)
                o[rows], cache[span.slot] = self._prefill(qkv[rows], decay[rows], beta[rows], cache[span.slot]
                                                          if span.has_initial_state else None, w)
        # RMSNorm per value head (weight, not 1 + weight), then the output gate
        h = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (self.norm.weight * h.to(x.dtype)) * F.silu(z.reshape(t, g.v_heads, g.v_dim).float())
        return self.out_proj(h.to(x.dtype).reshape(t, -1))

    def _split(self, qkv: torch.Tensor):
        g = self.g
        q, k, v = qkv.split([g.k_heads * g.k_dim, g.k_heads * g.k_dim, g.v_heads * g.v_dim], dim=-1)
        lead = qkv.shape[:-1]
        return (q.reshape(*lead, g.k_heads, g.k_dim), k.reshape(*lead, g.k_heads, g.k_dim),
                v.reshape(*lead, g.v_heads, g.v_dim))

    def _prefill(self, qkv, decay, beta, state: torch.Tensor | None, w):
        g = self.g
        k1 = g.conv_kernel - 1
        window = (state[: g.conv_state_size].view(g.conv_dim, k1) if state is not None
                  else qkv.new_zeros(g.conv_dim, k1))
        s0 = state[g.conv_state_size:].view(g.v_heads, g.k_dim, g.v_dim) if state is not None else None
        conv, window = causal_conv(qkv, window, w, None)
        o, final = gated_delta_chunked(*self._split(conv), decay, beta, g.chunk, s0)
        return o, torch.cat([window.reshape(-1).float(), final.reshape(-1)])

    def _decode(self, qkv, decay, beta, state: torch.Tensor, w):
        g, n = self.g, qkv.shape[0]
        window = state[:, : g.conv_state_size].view(n, g.conv_dim, g.conv_kernel - 1)
        s0 = state[:, g.conv_state_size:].view(n, g.v_heads, g.k_dim, g.v_dim)
        conv, window = causal_conv_step(qkv, window, w, None)
        q, k, v = self._split(conv)
        o, new = gated_delta_step(s0, q, k, v, decay, beta)
        return o, torch.cat([window.reshape(n, -1).float(), new.reshape(n, -1)], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        assert spec.gdn is not None
        self.rot = int(spec.head_dim * spec.gdn.partial_rotary)
        self.qkv_proj = MergedLinear(spec.hidden, {"q_proj": 2 * spec.q_dim, "k_proj": spec.kv_dim,
                                                   "v_proj": spec.kv_dim}, bias=spec.biases.qkv)
        self.o_proj = Linear(spec.q_dim, spec.hidden, bias=spec.biases.qkv)
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.norm.eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.norm.eps)
        self.attn = CachedAttention(layer_idx, scale=spec.head_dim**-0.5)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat([apply_rotary(x[..., : self.rot], cos, sin), x[..., self.rot :]], dim=-1)

    def forward(self, x, cos, sin, ctx):
        t = x.shape[0]
        qg, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = qg.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rotate(self.q_norm(q), cos, sin)
        k = self._rotate(self.k_norm(k.view(t, self.kv_heads, self.head_dim)), cos, sin)
        out = self.attn(q.contiguous(), k.contiguous(), v.view(t, self.kv_heads, self.head_dim), ctx)
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpertMoE(FusedMoE):
    """Routed experts plus one always-on gated MLP scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, spec: ModelSpec):
        moe = spec.moe
        assert moe is not None
        super().__init__(spec.hidden, moe.num_experts, moe.expert_intermediate, moe.experts_per_tok,
                         renormalize=moe.renormalize_topk, hidden_act=spec.hidden_act)
        self.shared_expert = GatedMLP(spec.hidden, moe.shared_expert_intermediate, spec.hidden_act)
        self.shared_expert_gate = Linear(spec.hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(spec.hidden, spec.norm.eps)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden, spec.norm.eps)
        self.linear = spec.mixer(layer_idx) == MIXER_GDN
        if self.linear:
            self.linear_attn = GatedDeltaNet(spec, layer_idx)
        else:
            self.self_attn = GatedAttention(spec, layer_idx)
        self.mlp: nn.Module = (SharedExpertMoE(spec) if spec.moe and layer_idx in spec.moe.layer_ids
                               else GatedMLP(spec.hidden, spec.intermediate, spec.hidden_act))

    def forward(self, x, cos, sin, ctx):
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, ctx) if self.linear else self.self_attn(h, cos, sin, ctx))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(DecoderModel):
    def __init__(self, spec: ModelSpec):
        assert spec.gdn is not None
        rotary = RotaryEmbedding(int(spec.head_dim * spec.gdn.partial_rotary), spec.rope.theta,
                                 spec.rope.scaling)
        super().__init__(spec, Qwen3NextDecoderLayer, norm=GemmaRMSNorm, rotary=rotary)


class Qwen3NextForCausalLM(MoECausalLMMixin, CausalLM):
    packed_modules: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                      "gate_up_proj": ["gate_proj", "up_proj"]}
    # mlp.experts.{e}.gate_proj / up_proj / down_proj, or the stacks as stored
    expert_layout = QWEN_EXPERT_LAYOUT

    def build_decoder(self, spec: ModelSpec) -> Qwen3NextModel:
        return Qwen3NextModel(spec)

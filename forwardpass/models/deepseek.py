"""DeepSeek-V2 and DeepSeek-V3: multi-latent attention (MLA) and a MoE with shared experts.

Attention (``attention/mla.py`` for the cache and the two attention forms):

* q: one projection ``q_proj`` (V2-Lite style, ``q_lora_rank`` null) or a LoRA ``q_a_proj`` →
  RMSNorm ``q_a_layernorm`` → ``q_b_proj``; split per head into ``qk_nope_head_dim`` (no position) and
  ``qk_rope_head_dim`` (rotated) parts;
* kv: ``kv_a_proj_with_mqa`` gives the latent (``kv_lora_rank``, RMS-normed by ``kv_a_layernorm``) and
  one shared rotary key; only these two are cached; ``kv_b_proj`` expands the latent per head;
* rope over adjacent pairs (``rope_interleave``, always for V2), usually YaRN-scaled; the softmax scale
  is ``qk_head_dim ** -0.5`` times ``yarn_mscale(factor, mscale_all_dim) ** 2``.

MoE (layers from ``first_k_dense_replace`` on; the first ones have a dense MLP): ``n_routed_experts``
experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` chosen per token, plus
``n_shared_experts`` always-on experts (one gated MLP ``n_shared_experts`` times as wide).
Routing (``MoESpec.topk_method``):

* V2 ``greedy``: softmax scores, top-k; ``group_limited_greedy``: keep the ``topk_group`` expert groups
  with the best single score, then top-k inside them. Weights times ``routed_scaling_factor``.
* V3 ``noaux_tc``: sigmoid scores; the choice uses scores plus a learned ``e_score_correction_bias``;
  groups ranked by the sum of their two best biased scores, ``topk_group`` kept, top-k inside; the
  weights are the *unbiased* scores of the chosen experts, renormalized (``norm_topk_prob``) and
  times ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.attention.context import AttentionContext
from forwardpass.attention.kv_cache_interface import KVCacheSpec, MLASpec
from forwardpass.attention.mla import latent_attention
from forwardpass.layers.linear import Linear
from forwardpass.layers.mlp import GatedMLP
from forwardpass.layers.moe import EXPERT_IMPLS, FusedMoE
from forwardpass.layers.norm import RMSNorm
from forwardpass.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_interleaved, yarn_mscale
from forwardpass.models.decoder import CausalLM, DecoderModel
from forwardpass.models.model_spec import ModelSpec
from forwardpass.models.moe_loading import QWEN_EXPERT_LAYOUT, MoECausalLMMixin


class MLAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        mla = spec.mla
        assert mla is not None
        self.heads, self.nope, self.rope = spec.heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.rank, self.v_dim = mla.kv_lora_rank, mla.v_head_dim
        qk = self.nope + self.rope
        if mla.q_lora_rank:
            self.q_a_proj = Linear(spec.hidden, mla.q_lora_rank, bias=spec.biases.qkv)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, spec.norm.eps)
            self.q_b_proj = Linear(mla.q_lora_rank, self.heads * qk)
        else:
            self.q_proj = Linear(spec.hidden, self.heads * qk)
        self.kv_a_proj_with_mqa = Linear(spec.hidden, self.rank + self.rope, bias=spec.biases.qkv)
        self.kv_a_layernorm = RMSNorm(self.rank, spec.norm.eps)
        # absorbed: a matrix
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope + self.v_dim), role="dense")
        self.o_proj = Linear(self.heads * self.v_dim, spec.hidden, bias=spec.biases.o)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        self.scale = qk**-0.5
        scaling = spec.rope.scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2

    def kv_cache_spec(self, spec: ModelSpec, block_size: int,
                      dtype: torch.dtype) -> dict[int, KVCacheSpec | None]:
        """This layer's cache: the latent and the shared rotary key of every token."""
        return {self.layer_idx: MLASpec(block_size=block_size, latent_dim=self.rank + self.rope, dtype=dtype)}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext | None):
        t = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.heads, self.nope + self.rope)
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, : self.rank])
        k_pe = self.rotate(ckv[:, None, self.rank :], cos, sin)[:, 0]
        q = torch.cat([q[..., : self.nope], self.rotate(q[..., self.nope :], cos, sin)], dim=-1)
        latent = torch.cat([c, k_pe], dim=-1)  # what the cache keeps: [T, kv_lora_rank + qk_rope_head_dim]
        out = latent_attention(q, latent, self.kv_b_proj.weight, ctx, self.layer_idx,
                               rank=self.rank, nope=self.nope, scale=self.scale)
        return self.o_proj(out.reshape(t, self.heads * self.v_dim))


class DeepseekMoE(FusedMoE):
    """Routed experts (stacked, ``FusedMoE``) with DeepSeek's routing, plus the shared experts."""

    def __init__(self, spec: ModelSpec):
        moe = spec.moe
        assert moe is not None
        super().__init__(spec.hidden, moe.num_experts, moe.expert_intermediate, moe.experts_per_tok,
                         renormalize=moe.renormalize_topk, hidden_act=spec.hidden_act)
        self.moe = moe
        if moe.topk_method == "noaux_tc":  # stored as mlp.gate.e_score_correction_bias
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts),
                                                             requires_grad=False)
        self.shared_experts = (GatedMLP(spec.hidden, moe.shared_expert_intermediate, spec.hidden_act)
                               if moe.shared_expert_intermediate else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.moe
        logits = F.linear(x.float(), self.gate.weight.float())
        e, groups = s.num_experts, s.n_group
        if s.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias.float()
            group_scores = choice.view(-1, groups, e // groups).topk(2, dim=-1)[0].sum(-1)
        else:
            scores = logits.softmax(dim=-1)
            choice = scores
            group_scores = scores.view(-1, groups, e // groups).amax(-1)
        if s.topk_method != "greedy":  # keep the topk_group best groups only
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(s.topk_group, dim=-1)[1], 1.0)
            keep = keep.bool().repeat_interleave(e // groups, dim=1)
            choice = choice.masked_fill(~keep, float("-inf") if s.topk_method == "noaux_tc" else 0.0)
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.tokens_per_expert = counts
        fn = EXPERT_IMPLS[self.impl]
        out = fn(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.act, counts)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.norm.eps)
        self.self_attn = MLAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.norm.eps)
        self.mlp: nn.Module = (DeepseekMoE(spec) if spec.moe and layer_idx in spec.moe.layer_ids
                               else GatedMLP(spec.hidden, spec.intermediate, spec.hidden_act))

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(DecoderModel):
    def __init__(self, spec: ModelSpec):
        mla = spec.mla
        assert mla is not None
        super().__init__(spec, DeepseekDecoderLayer,
                         rotary=RotaryEmbedding(mla.qk_rope_head_dim, spec.rope.theta, spec.rope.scaling))


class DeepseekV2ForCausalLM(MoECausalLMMixin, CausalLM):
    packed_modules: ClassVar[dict[str, list[str]]] = {"gate_up_proj": ["gate_proj", "up_proj"]}
    # mlp.experts.{e}.gate_proj / up_proj / down_proj, or the stacks as stored
    expert_layout = QWEN_EXPERT_LAYOUT

    def build_decoder(self, spec: ModelSpec) -> DeepseekModel:
        return DeepseekModel(spec)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass  # the spec selects sigmoid / noaux_tc routing, q LoRA and the rope layout from config.json

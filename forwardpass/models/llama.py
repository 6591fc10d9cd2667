"""The Llama family decoder: embedding → N × (RMSNorm, attention, RMSNorm, gated MLP) → RMSNorm → LM head.

Llama, Mistral, Qwen2 and Qwen3 differ only in switches of their
:class:`~forwardpass.models.model_spec.ModelSpec`: q/k/v and o biases (``biases``: Qwen2,
Llama's ``attention_bias``), per-head q/k RMSNorm (``qk_norm``: Qwen3), sliding-window layers
(``layer_windows``: Mistral, Qwen2/3 ``layer_types``), explicit ``head_dim``, tied embeddings,
``rope.scaling``. The spec resolves all of them from config.json, so the
model classes of those architectures are this one class; the MoE architectures only replace the MLP.

Forward takes the engine's flattened batch: ``input_ids`` and ``positions`` are ``[T]`` and the
attention context maps rows to sequences (see ``forwardpass/attention/context.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from forwardpass.attention.context import AttentionContext
from forwardpass.attention.layer import CachedAttention
from forwardpass.layers.linear import Linear, MergedLinear
from forwardpass.layers.mlp import GatedMLP
from forwardpass.layers.norm import RMSNorm
from forwardpass.layers.parallel_linear import (
    ParallelGatedMLP,
    RowParallelLinear,
    qkv_parallel,
)
from forwardpass.layers.rotary import RotaryEmbedding, apply_rotary
from forwardpass.models.decoder import CausalLM, DecoderModel
from forwardpass.models.model_spec import ModelSpec
from forwardpass.plan import current_plan


class DecoderAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        d = spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.heads, spec.kv_heads, d
        # tensor parallel: this rank's heads, q/k/v column-split, o_proj row-split
        if (tp := current_plan().tensor_parallel).enabled:
            self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
                spec.hidden, spec.heads, spec.kv_heads, d, tp, bias=spec.biases.qkv)
            self.o_proj = RowParallelLinear(spec.q_dim, spec.hidden, tp, bias=spec.biases.o,
                                            what="the query heads' width")
        else:
            self.qkv_proj = MergedLinear(
                spec.hidden,
                {"q_proj": spec.q_dim, "k_proj": spec.kv_dim, "v_proj": spec.kv_dim},
                bias=spec.biases.qkv,
            )
            self.o_proj = Linear(spec.q_dim, spec.hidden, bias=spec.biases.o)
        self.q_norm = RMSNorm(d, spec.norm.eps) if spec.norm.qk else None
        self.k_norm = RMSNorm(d, spec.norm.eps) if spec.norm.qk else None
        self.attn = CachedAttention(layer_idx, scale=d**-0.5, sliding_window=spec.layer_windows[layer_idx])
        # the plan's compiled q/k norm + rotary, for exactly this class (Gemma's attention changes the math)
        self.fused: Any = current_plan().fused_ops if type(self) is DecoderAttention else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext | None):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if (self.fused is not None and qkv.dtype == torch.float32 and qkv.is_contiguous()
                and qkv.device.type == "cpu" and cos.shape[-1] == self.head_dim):  # fmt: skip
            # q/k norm + rotary in one compiled call, in place on the fresh projection (layers/fused.py)
            norms = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm
                     else (None, None, 0.0))
            self.fused.qk_norm_rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, *norms)
            q, k, v = (p.view(t, -1, self.head_dim) for p in self.qkv_proj.split(qkv))
            return self.o_proj(self.attn(q, k, v, ctx).reshape(t, self.num_heads * self.head_dim))
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q, k, v, ctx)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.norm.eps)
        self.self_attn = DecoderAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.norm.eps)
        self.mlp = self.build_mlp(spec, layer_idx)

    def build_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        if (tp := current_plan().tensor_parallel).enabled:
            return ParallelGatedMLP(spec.hidden, spec.intermediate, spec.hidden_act, tp, bias=spec.biases.mlp)
        return GatedMLP(spec.hidden, spec.intermediate, spec.hidden_act, bias=spec.biases.mlp)

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    """Also the model class of the other Llama-family architectures (Mistral, Qwen2, Qwen3) and the base
    class of the MoE ones."""

    layer_cls: type[DecoderLayer] = DecoderLayer
    #: every op is one the batch-invariant plan covers (models/prepare.py::check_batch_invariant)
    batch_invariant_supported: ClassVar[bool] = True
    #: the decode stack's ops, from the plan at construction (None: no stack)
    decode_stack_ops: Any = None
    kv_cache_dtype: torch.dtype = torch.float32
    packed_modules: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                      "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        plan = current_plan()
        if plan.decode_stack and type(self.model) is DecoderModel:  # the stack computes exactly these layers
            self.decode_stack_ops, self.kv_cache_dtype = plan.fused_ops, plan.kv_cache_dtype

    def build_decoder(self, spec: ModelSpec) -> DecoderModel:
        rotary = RotaryEmbedding(spec.head_dim, spec.rope.theta, spec.rope.scaling)
        return DecoderModel(spec, self.layer_cls, rotary=rotary)

    def process_weights_after_loading(self) -> None:
        """Once every layer holds its final weights (packed, quantized): the decode stack over them, where the
        plan has it and every layer is exactly what the stack computes (models/llama_decode_stack.py)."""
        if self.decode_stack_ops is not None:
            from forwardpass.layers.small_matmul import small_matmul_capsule
            from forwardpass.models.llama_decode_stack import build_decode_stack

            stack = build_decode_stack(self, self.decode_stack_ops, small_matmul_capsule(),
                                       self.kv_cache_dtype)
            self.model.decode_stack = stack

"""A decode step's decoder layers in one C++ call (``forwardpass/attention/csrc/decode_stack.h``).

At batch 1 a 0.6B model's decode step is ~110 matmul kernels and ~200 small ops, and the Python between them
(module calls, views, checks: ~15 per layer) took ~4 ms of it on a two-core machine, a sixth of an int8
token. The stack calls the same compiled kernels as the modules, in the same order, on the same tensors, so
its hidden states are bitwise the module path's (``tests/test_decode_stack.py``); only the Python goes.

It is built once, with the engine's other compiled CPU ops (``layers/fused.py``), for a model whose every
layer is a plain Llama-family layer on those ops: :func:`build_decode_stack` checks each part and returns None
otherwise (MoE, Gemma's norms, LoRA slots, tensor parallelism, a weight without its kernel). A step takes it
when every row is a decode token and the batch is small enough for the decode kernels (:meth:`applies`);
prefill chunks and mixed steps run the modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.attention.context import AttentionContext, GroupMetadata
from forwardpass.layers.packed import PanelWeight
from forwardpass.quant.kblock_weight import KBlockWeight
from forwardpass.quant.weight import QuantizedWeight


class DecodeStack:
    def __init__(self, stack: Any, max_rows: int, head_dim: int):
        self._stack = stack
        self.max_rows = max_rows  # the most rows every projection's decode kernel takes
        self.head_dim = head_dim

    def applies(self, x: torch.Tensor, cos: torch.Tensor, ctx: AttentionContext | None) -> bool:
        return (
            ctx is not None and ctx.decode_kernel is not None
            and 0 < ctx.num_decode == x.shape[0] <= self.max_rows
            and x.dtype == torch.float32 and x.device.type == "cpu" and cos.shape[-1] == self.head_dim
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ctx: AttentionContext) -> torch.Tensor:
        groups: list[GroupMetadata] = ctx.groups  # type: ignore[assignment]  # every layer attends (build_decode_stack)
        return self._stack.forward(
            x, cos, sin, ctx.kv_caches, ctx.layer_group, [g.slot_mapping for g in groups],
            [g.decode_block_tables for g in groups], [g.decode_seq_lens for g in groups],
        )  # fmt: skip


def build_decode_stack(
    model: nn.Module, ops: Any, dense_capsule: Any, kv_cache_dtype: torch.dtype = torch.float32
) -> DecodeStack | None:
    """The stack for ``model`` (a Llama-family ``...ForCausalLM``) on the compiled ``ops`` (the paged-decode
    extension) with ``dense_capsule`` (the small-batch fp32 matmul's entry point, for fp32 weights) over KV
    caches of ``kv_cache_dtype``, or None where some part is not exactly what the stack computes."""
    from forwardpass.attention.layer import KERNEL_CACHE_DTYPES, CachedAttention
    from forwardpass.layers.linear import Linear, MergedLinear
    from forwardpass.layers.mlp import GatedMLP
    from forwardpass.layers.norm import RMSNorm
    from forwardpass.layers.small_matmul import MAX_ROWS
    from forwardpass.models.llama import DecoderAttention, DecoderLayer, DecoderModel

    decoder = getattr(model, "model", None)
    if (ops is None or type(decoder) is not DecoderModel or not hasattr(ops, "DecodeStack")
            or kv_cache_dtype not in KERNEL_CACHE_DTYPES):  # fmt: skip
        return None
    max_rows = [MAX_ROWS]

    def projection(linear: nn.Module, cls: type) -> Any:
        if type(linear) is not cls or linear.delta is not None:  # a LoRA slot adds to the output
            return None
        w = linear.weight
        if isinstance(w, KBlockWeight):  # a GGUF K-block type: its kernel's entry point, (x, codes, meta)
            capsule = w.matvec_capsule()
            if capsule is None:
                return None
            max_rows.append(w.gemm_rows - 1)  # more rows dequantize for a float GEMM (KBlockWeight.matmul)
            return ops.Projection(capsule, w.codes, w.meta, linear.bias)
        if isinstance(w, QuantizedWeight):
            if w._kernel is None or w.qs.device.type != "cpu" or w.qs.dim() != 2:
                return None
            q4 = w.fmt == "q4_0"
            matvec = w._kernel.matmul_capsule(q4, w.tiles)  # for the layout the weight's buffers hold
            if w._vnni is not None:  # from gemm_rows rows on, the kernel's own GEMM (QuantizedWeight.matmul)
                return ops.Projection(matvec, w.qs, w.d, linear.bias, w._vnni.gemm_capsule(q4), w.gemm_rows)
            max_rows.append(w.gemm_rows - 1)  # more rows take a path outside this kernel (AMX, oneDNN)
            return ops.Projection(matvec, w.qs, w.d, linear.bias)
        if isinstance(w, PanelWeight):  # the same kernel reads its panels (fp32 or half: their matmul)
            w = w.panels
        elif not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        if dense_capsule is None or linear.small_matmul is None:
            return None
        return ops.Projection(dense_capsule, w, None, linear.bias)

    def norm(module: nn.Module | None) -> bool:
        return type(module) is RMSNorm and module.fused is not None and module.weight.dtype == torch.float32

    stack = None
    for layer in decoder.layers:
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if (type(attn) is not DecoderAttention or attn.fused is None or type(attn.attn) is not CachedAttention
                or attn.attn.softcap is not None or type(mlp) is not GatedMLP or mlp.fused is None
                or mlp.act is not F.silu or not norm(layer.input_layernorm)
                or not norm(layer.post_attention_layernorm)
                or (attn.q_norm is not None and not (norm(attn.q_norm) and norm(attn.k_norm)))):  # fmt: skip
            return None
        projs = [projection(attn.qkv_proj, MergedLinear), projection(attn.o_proj, Linear),
                 projection(mlp.gate_up_proj, MergedLinear), projection(mlp.down_proj, Linear)]  # fmt: skip
        if any(p is None for p in projs):
            return None
        if stack is None:
            head_dim = attn.head_dim
            stack = ops.DecodeStack(attn.num_heads, attn.num_kv_heads, head_dim)
        q_norm = k_norm = None
        qk_eps = 0.0
        if attn.q_norm is not None and attn.k_norm is not None:
            q_norm, k_norm, qk_eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps
        stack.add_layer(
            layer.input_layernorm.weight, layer.input_layernorm.eps, layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.eps, q_norm, k_norm, qk_eps, *projs, attn.attn.scale,
            attn.attn.sliding_window or 0,
        )  # fmt: skip
    if stack is None:
        return None
    return DecodeStack(stack, min(max_rows), head_dim)

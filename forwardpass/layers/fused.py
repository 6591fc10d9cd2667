"""Fused CPU ops for the small per-layer work of a decode step (RMSNorm; q/k norm + rotary; SwiGLU; the
K/V store), and the small-batch fp32 matmul for the linear layers.

At batch 1 these touch a few KB, but as chains of 5-8 torch ops each they cost 30-55 us of dispatch
apiece: ~8 ms of a 0.6B model's token, a fifth of an int8 decode step. The compiled versions live beside
the paged-decode kernel (``forwardpass/attention/csrc/paged_decode.cpp``) and are switched on together
with it, once, when an engine is built (:func:`use_fused_ops`); the modules keep their PyTorch code as
the reference and the fallback (other dtypes, devices, layouts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def use_fused_ops(model: nn.Module, ops: Any) -> int:
    """Give every RMSNorm and decoder attention of ``model`` the compiled ``ops`` (None: leave them on
    the PyTorch path). Returns how many modules took them."""
    if ops is None:
        return 0
    from forwardpass.attention.layer import CachedAttention
    from forwardpass.layers.mlp import GatedMLP
    from forwardpass.layers.norm import RMSNorm
    from forwardpass.models.llama import DecoderAttention

    n = 0
    for module in model.modules():
        # exactly these classes: a subclass may change the math (Gemma's 1 + weight norms, its own forward)
        if type(module) in (RMSNorm, DecoderAttention, GatedMLP, CachedAttention):
            module.fused = ops
            n += 1
    return n


def use_small_matmul(model: nn.Module, small_matmul: Any) -> int:
    """Give every linear layer of ``model`` (and the Llama-family LM head) the compiled small-batch fp32
    matmul (None: oneDNN for every batch). Returns how many modules took it."""
    if small_matmul is None:
        return 0
    from forwardpass.layers.linear import Linear
    from forwardpass.models.llama import LlamaForCausalLM

    n = 0
    for module in model.modules():
        if isinstance(module, (Linear, LlamaForCausalLM)):
            module.small_matmul = small_matmul
            n += 1
    return n


def use_decode_stack(model: nn.Module, ops: Any, kv_cache_dtype: torch.dtype = torch.float32) -> bool:
    """Give a Llama-family ``model`` whose layers run entirely on the compiled ``ops`` (and the compiled matmul
    kernels) the C++ loop over its layers for decode steps (``layers/decode_stack.py``). Call it after the
    model is quantized, its LoRA slots attached and :func:`use_fused_ops` / :func:`use_small_matmul` applied:
    it checks what they left. Returns whether the model took it."""
    from forwardpass.layers.decode_stack import build_decode_stack
    from forwardpass.layers.small_matmul import small_matmul_capsule

    stack = build_decode_stack(model, ops, small_matmul_capsule(), kv_cache_dtype)
    if stack is not None:
        model.model.decode_stack = stack  # type: ignore[union-attr]  # a DecoderModel (build_decode_stack)
    return stack is not None

"""What a loaded model's weights really are, and which kernel multiplies them, in words a person reads: the start-up
banner, ``/v1/models`` and ``explain`` show it. The execution plan names each role's *method*, but a GGUF file's
tensors keep their own types (Q4_1 projections beside a Q8_0 head), so this reads the weights themselves."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from forwardpass.layers.packed import PackedWeight
from forwardpass.quant.kblock_weight import KBlockStack, KBlockWeight, RowStack
from forwardpass.quant.weight import QuantizedWeight


def describe_weight(w: object, dtype: torch.dtype = torch.float32) -> str:
    """One weight matrix: its format and what multiplies it (``"GGUF Q4_1 via the K-block kernel (avx2)"``)."""
    if isinstance(w, KBlockStack):
        return f"{'/'.join(k.upper() for k in w.kinds)} via the K-block kernel {_kernel_words(w)}"
    if isinstance(w, KBlockWeight):
        return f"{w.fmt.upper()} via the K-block kernel {_kernel_words(w)}"
    if isinstance(w, QuantizedWeight):
        if w._kernel is None:
            return f"{w.fmt.upper()} via the PyTorch reference"
        large = "AMX" if w._amx is not None else "VNNI GEMM" if w._vnni is not None else (
            "the same kernel" if w._kernel_takes_all else ("bf16" if w.bf16_gemm else "fp32") + " oneDNN")
        return f"{w.fmt.upper()} via the quantized-matmul kernel ({w._kernel.isa}; large batches: {large})"
    if isinstance(w, RowStack):
        return "mixed: " + " + ".join(describe_weight(p, dtype) for p in w.parts)
    if isinstance(w, PackedWeight):
        return "fp32, packed once: small-batch kernel, oneDNN for large batches"
    if isinstance(w, torch.Tensor):
        return f"{str(w.dtype).removeprefix('torch.')} via oneDNN"
    return type(w).__name__


def _kernel_words(w: KBlockWeight) -> str:
    if w._kernel is None:
        return "(PyTorch reference)"
    if w._kernel_takes_all:
        return f"({w._kernel.isa}, int8 activations, every batch size)"
    return f"({w._kernel.isa}, int8 activations; large batches: {'bf16' if w.bf16_gemm else 'fp32'} oneDNN)"


def weight_formats(model: nn.Module) -> dict[str, str]:
    """``{"projections": ..., "lm_head": ...}``: the formats of the layers' linear weights (with how many
    matrices each, where they differ) and of the LM head (or the tied embedding that is the head)."""
    projections: Counter[str] = Counter()
    head = None
    for module in model.modules():
        role = getattr(module, "role", None)
        w = getattr(module, "weight", None)
        if w is None:
            continue
        if role == "projection":
            projections[describe_weight(w)] += 1
        elif role == "lm_head" or getattr(module, "head_method", None) is not None:
            head = describe_weight(w) + ("" if role == "lm_head" else " (the tied embedding)")
    out = {}
    if projections:
        out["projections"] = (next(iter(projections)) if len(projections) == 1 else
                              "; ".join(f"{n} x {d}" for d, n in projections.most_common()))
    if head is not None:
        out["lm_head"] = head
    return out


def described_plan(plan: object, model: nn.Module) -> dict:
    """``plan.describe()`` with ``loaded_weights``: what the weights really are (the start-up banner, ``/v1/models``
    and ``explain`` show it)."""
    return {**plan.describe(), "loaded_weights": weight_formats(model)}  # type: ignore[attr-defined]

"""The quantize pass: after a model is loaded in fp32, swap its large weights for block-quantized ones.

``quantize_model(model, "int8" | "int4")`` replaces, in place and one tensor at a time (so the peak memory
is the fp32 model plus one quantized matrix):

* every ``Linear`` weight (attention, MLP, a LoRA adapter's *base* projection: the adapter slot adds its
  low-rank update to the base output whatever computed it) → ``q8_0`` for int8, ``q4_0`` for int4;
* MoE expert stacks (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) → the same format;
* the LM head (or, when tied, the embedding matrix it shares) → ``q8_0`` in both modes. It is a large
  matrix (a quarter of Qwen3-0.6B), so quantizing it pays at decode; 4 bits there cost more quality than
  elsewhere (measured, see README), so int4 keeps it at 8 bits, as llama.cpp's Q4_0 files usually do.
  The tied embedding's lookup dequantizes just the rows it reads; an untied embedding stays fp32
  (a lookup reads a few rows per token, so it costs memory, not time).

Left in fp32, on purpose: MoE router gates (tiny, and a flipped expert choice changes the output far
more than rounding does), DeepSeek's ``kv_b_proj`` (MLA reads it as a matrix to absorb, not through a
matmul), norms, convolutions and biases. The pass is separate from tensor parallelism: it swaps weights
of whatever ``Linear`` subclasses a model holds after loading.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from forwardpass.errors import ConfigError
from forwardpass.layers.linear import Linear
from forwardpass.layers.moe import ExpertWeights
from forwardpass.quant import QUANTIZATIONS
from forwardpass.quant.kernel import load_quant_kernel
from forwardpass.quant.weight import QuantizedWeight

logger = logging.getLogger(__name__)

HEAD_FORMAT = "q8_0"
_KEEP_FP32 = {"gate", "kv_b_proj"}  # module names whose fp32 weight is read directly (see above)


def check_quantization(value: str | None) -> str | None:
    if value is None or value in QUANTIZATIONS:
        return value
    raise ConfigError(
        f"unknown quantization {value!r}; use {' or '.join(QUANTIZATIONS)} (or none)", param="quantization"
    )


class QuantizedEmbedding(nn.Module):
    """An embedding whose matrix is quantized (tied with the LM head): lookups dequantize their rows."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids)


def _replace_param(module: nn.Module, name: str, fmt: str, kernel: bool) -> None:
    w = getattr(module, name)
    qw = QuantizedWeight.from_float(w.data, fmt, kernel)
    delattr(module, name)  # drop the fp32 parameter before registering its replacement
    setattr(module, name, qw)


def _tied_embedding(model: nn.Module) -> tuple[nn.Module, str] | None:
    if getattr(model, "lm_head", "absent") is not None:
        return None
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Embedding):
                return parent, name
    return None


def quantize_model(model: nn.Module, quantization: str, *, kernel: bool = True) -> nn.Module:
    """Quantize ``model``'s weights in place (see the module docstring); ``kernel=False`` computes with
    the PyTorch reference instead of the C++ kernel (tests compare the two)."""
    fmt = QUANTIZATIONS[check_quantization(quantization) or ""]
    if kernel:
        load_quant_kernel()  # build (or fail over to the reference) now, before the engine serves
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with torch.no_grad():
        tied = _tied_embedding(model)
        if tied is not None:
            parent, name = tied
            emb = getattr(parent, name)
            setattr(
                parent,
                name,
                QuantizedEmbedding(QuantizedWeight.from_float(emb.weight.data, HEAD_FORMAT, kernel)),
            )
        for name, module in list(model.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if (
                isinstance(module, Linear)
                and leaf not in _KEEP_FP32
                and isinstance(module.weight, nn.Parameter)
            ):
                _replace_param(module, "weight", HEAD_FORMAT if leaf == "lm_head" else fmt, kernel)
            elif isinstance(module, ExpertWeights):
                for param in ("gate_up_proj", "down_proj"):
                    _replace_param(module, param, fmt, kernel)
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    logger.info("quantized weights to %s: %.1f MB → %.1f MB", quantization, before / 1e6, after / 1e6)
    return model

"""What a weight held in a format of its own offers, and how code that holds "a tensor or such a weight"
multiplies by it or reads its values.

A layer's weight is either a plain ``[N, K]`` tensor (fp32 as loaded) or an object that computes through its
own kernels: quantized blocks (``quant/weight.py::QuantizedWeight``, ``quant/kblock_weight.py``'s
``KBlockWeight``, ``KBlockStack``, ``RowStack``) or oneDNN's packed panels (``layers/packed.py``). Each such
class implements :class:`Weight`; a new format is one more class, never a branch here or in a layer. A plain
tensor cannot carry a method of ours, so it goes through the dense matmul (``layers/dense_matmul.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from forwardpass.layers.dense_matmul import SmallMatmul, dense_matmul


class Weight(Protocol):
    """``W [N, K]`` in a format of its own, multiplying activations through its own kernels."""

    @property
    def shape(self) -> torch.Size: ...

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x · Wᵀ (+ bias)`` through the fastest path for this batch."""
        ...

    def matmul_batch_invariant(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x · Wᵀ (+ bias)`` through one kernel for every batch size, so a row's result does not depend on
        the other rows of its call (the batch-invariant plan)."""
        ...

    def dense(self) -> torch.Tensor:
        """The plain ``[N, K]`` fp32 values (a copy)."""
        ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` (an embedding lookup on a tied LM head's matrix)."""
        ...

    def describe(self) -> tuple[str, str]:
        """``(format, what multiplies it)`` in words a person reads (``layers/weight_report.py``)."""
        ...


def matmul(x: torch.Tensor, weight: torch.Tensor | Weight, bias: torch.Tensor | None = None,
           small_matmul: SmallMatmul | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)``: a plain tensor through the dense matmul, any other weight through its own
    (an MoE expert's matrix, a stack's or a quantized one's)."""
    if isinstance(weight, torch.Tensor):
        return dense_matmul(x, weight, bias, small_matmul)
    return weight.matmul(x, bias)


def dense(weight: torch.Tensor | Weight) -> torch.Tensor:
    """The plain ``[N, K]`` values of a stored weight (the tensor itself when it is one; a copy otherwise)."""
    return weight if isinstance(weight, torch.Tensor) else weight.dense()

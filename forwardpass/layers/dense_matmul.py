"""``x · Wᵀ (+ bias)`` for a plain weight tensor, through the fastest path available for it.

On this kind of CPU (AMD, AVX2, no AVX-512) ``F.linear`` goes through MKL's generic path, which reads weights
at ~18–29 GB/s; oneDNN's ``_linear_pointwise`` reads the same fp32 weights 2–4× faster (see
``benchmarks/decode.py``). So fp32 CPU tensors take oneDNN (or, for decode-sized batches, the compiled
small-batch kernel a caller passes in), and everything else ``F.linear`` (CUDA, other dtypes, autograd).

A weight held in a format of its own (quantized blocks, oneDNN's packed panels: ``quant/weight.py``,
``quant/kblock_weight.py``, ``layers/packed.py``) multiplies itself (``weight.matmul``) and calls this module
for the float GEMM it falls back on, so this module is a leaf: it imports nothing from ``quant/``, the weight
methods or the plan.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from forwardpass.layers.small_matmul import MAX_ROWS


class SmallMatmul(Protocol):
    """The compiled small-batch fp32 matmul: ``x [M, K] @ weight [N, K].T (+ bias)``."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor: ...


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    small_matmul: SmallMatmul | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain ``[N, K]`` tensor.

    ``small_matmul`` is the engine's compiled kernel for decode-sized batches (``layers/small_matmul.py``):
    fp32 batches of at most ``MAX_ROWS`` rows take it, larger ones oneDNN.
    """
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
    ):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if small_matmul is not None and x2.shape[0] <= MAX_ROWS:
            out = small_matmul(x2, weight, bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
        return out.view(*shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)

"""A bfloat16 or float16 checkpoint's weights kept in their 2 bytes on a CPU that computes in float32.

Without bf16 arithmetic in the CPU (AVX2, AVX-512 without BF16) an engine computes in float32, and so far it
upcast a bf16 checkpoint on load: twice the memory, and twice the bytes every decode step streams, for the
same values. Here a projection whose weights are exactly bf16 (or fp16) values stays in that dtype, laid out
in the small-batch kernel's panels ``[N/64][K][64]`` (``layers/csrc/half_panels.h``), and the kernel upcasts
each weight in registers: exact, so every output is the same fp32 FMA chain the fp32 panels compute, bit for
bit, at every batch size (its rows never interact). Decode steps read half the bytes; batches from 2 rows on
convert a chunk of a panel to fp32 once and pass every row over it (prefill at the fp32 GEMM's rate).

A weight whose values are not all representable in the dtype (a checkpoint that stores some tensors in
float32), or whose output count is not a multiple of 64, is not converted: the caller keeps fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from forwardpass.layers.packed import PANEL, PanelWeight

HALF_DTYPES = (torch.bfloat16, torch.float16)


class HalfPanelWeight(PanelWeight):
    """``W [N, K]`` held as ``dtype`` panels (``Kp = K``); ``matmul(x)`` = ``x · Wᵀ`` in fp32 through the
    compiled kernel. The huge-page move may rehome ``panels`` (it is an ordinary tensor)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._kernel.small_matmul(self._rows_of(x), self.panels, bias)
        return out.view(*x.shape[:-1], self.out_features)

    # one kernel, one FMA chain per output in k order, for every batch size: already batch-invariant
    matmul_batch_invariant = matmul

    def describe(self) -> tuple[str, str]:
        """``(format, what multiplies it)`` for people (``layers/weight_report.py``)."""
        kind = str(self.panels.dtype).removeprefix("torch.")
        return kind, f"the panel kernel ({kind} read, upcast to float32 in registers, every batch size)"

    @classmethod
    def pack(cls, weight: torch.Tensor, dtype: torch.dtype, kernel: Any) -> HalfPanelWeight | None:
        """``weight`` (fp32 ``[N, K]``) as ``dtype`` panels read by ``kernel``, or None where that would
        change a value or the shape does not fit the panels."""
        n, k = weight.shape
        if dtype not in HALF_DTYPES or n % PANEL or k == 0 or weight.device.type != "cpu":
            return None
        half = weight.detach().to(dtype)
        if not torch.equal(half.float(), weight):  # not a bf16/fp16 checkpoint's values: keep fp32
            return None
        panels = half.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()
        return cls(panels, n, k, kernel)

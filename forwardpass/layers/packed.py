"""fp32 weights packed once for oneDNN's GEMM, read in place by our small-batch kernel.

``torch.ops.mkldnn._linear_pointwise`` on a plain ``[N, K]`` weight reorders it into oneDNN's blocked layout
on every call: a read and a write of the whole matrix before the GEMM starts. For a 128-token prefill of a
0.6B model that is ~5-10% of the time (measured on a Zen 4 core pair: 4-11% more GFLOP/s per projection at 128
rows with the weight reordered once, ahead), and for 16-64 rows, batched decode, 7-50%.
``_reorder_linear_weight`` does the reordering once; the catch is that the result is an opaque MKLDNN tensor,
and batch-1 decode wants our own kernel, which reads weights at the memory roof where oneDNN's set-up per call
and its GEMM blocking do not.

Keeping both layouts would double the weights' memory. Instead the packed buffer is the only copy, and our
kernel reads it too: oneDNN's layout for fp32 weights here is panels ``[N/64][Kp][64]`` (for each block of 64
outputs, the 64 weights of each k side by side, K padded to Kp), which is just what a matrix-vector kernel
wants (``layers/csrc/small_matmul.cpp``, ``panel::``). The layout is not a public contract of oneDNN, so it is
checked, not assumed: a weight is packed only if the panels view of oneDNN's buffer holds exactly the weight's
values in those places; otherwise it stays a plain tensor on the paths it used before.

A linear layer whose plan packs its weights (``layers/weight_methods.py::PackedFp32Method``) packs it once
after loading; its method then calls :meth:`PackedWeight.matmul`. Up to ``MAX_ROWS`` rows take our
kernel (decode steps), more take oneDNN's GEMM on the same buffer (prefill chunks).
``FORWARDPASS_PACKED_WEIGHTS=0`` keeps every weight plain (for comparisons).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from forwardpass.huge_pages import rebacked_on_huge_pages
from forwardpass.layers.small_matmul import MAX_ROWS

logger = logging.getLogger(__name__)

PANEL = 64  # outputs per panel
#: the batch size oneDNN is told to pack for: a prefill chunk's rows (the format is the same from 16 rows on)
PACK_FOR_ROWS = 128

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "data_ptr")
)


class PanelWeight(nn.Module):
    """``W [N, K]`` in the small-batch kernel's panels ``[N/64][Kp >= K][64]``, whatever their element type
    (fp32 here, bf16 / fp16 in ``layers/half_panels.py``): reading the values back, and the check the kernel
    cannot make. ``panels`` is a buffer, so ``state_dict`` counts its bytes."""

    panels: torch.Tensor

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int, kernel: Any):
        super().__init__()
        self._kernel = kernel  # the compiled small_matmul (``layers/small_matmul.py``) that reads the panels
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("panels", panels, persistent=True)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def _rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``[M, K]`` rows; the kernel knows only the padded Kp, so K is checked here."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight {self.in_features}")
        return x.reshape(-1, x.shape[-1])

    def dense(self) -> torch.Tensor:
        """The plain ``[N, K]`` fp32 weight (a copy), e.g. for tests and references."""
        k = self.in_features
        return self.panels[:, :k].transpose(1, 2).reshape(self.out_features, k).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 ``W[ids]`` (an embedding lookup on a tied LM head's matrix): each row gathered across its
        panel."""
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            # as nn.Embedding
            raise IndexError(f"index out of range: ids must be in [0, {self.out_features})")
        out = self.panels[flat // PANEL, : self.in_features, flat % PANEL].float()
        return out.view(*ids.shape, self.in_features)


class PackedWeight(PanelWeight):
    """``W [N, K]`` in oneDNN's packed layout; ``matmul(x)`` = ``x · Wᵀ``.

    ``panels`` is a view of the packed tensor's memory, which it keeps alive. The module cannot move to
    another device: it is built for the CPU engine that holds it.
    """

    # panels views oneDNN's buffer: a copy elsewhere (engine/huge_pages.py) would be a second one
    keeps_own_memory = True

    def __init__(self, onednn: torch.Tensor, panels: torch.Tensor, out_features: int, in_features: int,
                 kernel: Any):
        super().__init__(panels, out_features, in_features, kernel)
        self._onednn = onednn

    def _apply(self, fn, recurse=True):
        raise RuntimeError("a PackedWeight lives where it was packed (CPU memory shared with oneDNN)")

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = self._rows_of(x)
        if x2.shape[0] <= MAX_ROWS:
            out = self._kernel.small_matmul(x2, self.panels, bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self._onednn, bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)

    def matmul_batch_invariant(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x · Wᵀ (+ bias)`` through our kernel for every batch size, ``MAX_ROWS`` rows a call: a larger
        call would go to oneDNN's GEMM, which sums in another order (the batch-invariant plan)."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= MAX_ROWS:
            return self.matmul(x, bias)
        out = torch.cat([self.matmul(x2[i : i + MAX_ROWS], bias) for i in range(0, len(x2), MAX_ROWS)])
        return out.view(*x.shape[:-1], out.shape[-1])

    def describe(self) -> tuple[str, str]:
        """``(format, what multiplies it)`` for people (``layers/weight_report.py``)."""
        return "fp32", "the small-batch kernel on panels packed once (oneDNN for large batches)"

    @classmethod
    def pack(cls, weight: torch.Tensor, kernel: Any) -> PackedWeight | None:
        """``weight`` packed for the compiled ``kernel`` module (its ``small_matmul`` and ``panels_view``), or
        None where oneDNN's buffer is not the panels layout (or cannot be)."""
        n, k = weight.shape
        if not _ONEDNN or n % PANEL or k == 0 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        w = weight.detach().contiguous()
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS)
        floats = torch.ops.mkldnn._nbytes(onednn) // 4  # panels: N/64 × Kp × 64 = N × Kp
        kp = floats // n
        if floats % n or kp < k:
            return None
        panels = kernel.panels_view(onednn, torch.ops.mkldnn.data_ptr(onednn), n // PANEL, kp)
        expected = w.view(n // PANEL, PANEL, k).transpose(1, 2)
        if not torch.equal(panels[:, :k], expected):  # the layout assumed above, value by value
            return None
        rebacked_on_huge_pages(panels)
        return cls(onednn, panels, n, k, kernel)

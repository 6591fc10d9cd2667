"""``QuantizedWeight``: a block-quantized weight matrix (or a stack of them) that multiplies activations.

It takes the place of a layer's fp32 ``weight`` parameter (``Linear.weight``, an MoE layer's expert stacks,
the LM head / tied embedding) and multiplies activations through its own kernels (:meth:`matmul`; the
weight interface of ``layers/weight_interface.py``), so model code stays unchanged. It is a module holding
its tensors as buffers, so ``.to()`` and ``state_dict`` see them and ``named_parameters`` no longer lists
the fp32 weight it replaced.
"""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.kernel_build import cpu_flags
from forwardpass.layers.dense_matmul import dense_matmul
from forwardpass.quant import reference
from forwardpass.quant.formats import dequantize, quantize
from forwardpass.quant.kernel import gemm_path, load_amx_kernel, load_quant_kernel
from forwardpass.quant.tiles import TILE, from_tiles, tile_rows, to_tiles

#: from this many activation rows on, dequantize + fp32 GEMM instead of the int8 kernel (estimated from
#: the kernel's and oneDNN's compute rates and the dequantization's extra ~8 bytes per weight)
GEMM_ROWS = 48
#: the same crossover with a bf16 GEMM on bf16 hardware (AMX): measured at 8-128 rows on 0.6B- and 41M-model
#: shapes, the int8 kernel wins up to ~24 rows and the bf16 GEMM from 32 on (1.3-4x by 64 rows)
BF16_GEMM_ROWS = 32
#: the same crossover for the AVX-512 VNNI GEMM (csrc/vnni_gemm.h) on weights in the tile layout
#: (quant/tiles.py), whose small-batch kernel is the GEMM's inner loop without the per-call copy of the
#: weights: measured at 8-2048 rows on 0.6B- and 41M-model shapes (Zen 4 core pair), the kernel 3-10% faster
#: up to 512 rows, the GEMM 0-8% faster at 1024 on the 41M model's (even on the 0.6B's); both give bitwise the
#: same result. (On the GGUF layout, with the kernel pairing blocks, the GEMM won 1.3-2.5x from 32 rows on.)
TILES_GEMM_ROWS = 1024
#: the same crossover for the AMX kernel: measured on the 41M model's shapes (LM head included) at 8-24 rows,
#: the int8 kernel wins at 8 (4.7 vs 6.1 ms per step), the AMX kernel from 16 on (3.9 vs 8.0)
AMX_ROWS = 16
#: ... up to this many rows; above, dequantizing the whole matrix once and oneDNN's bf16 GEMM win (its
#: blocking for activations beyond L2; measured at 128-4096 rows: the kernel 1.4-2x faster to 512 rows, even
#: at 1024-2048 on 0.6B shapes, 0.85x at 2048 and 0.65x at 4096 on the 41M model's)
AMX_MAX_ROWS = 1024
#: the AVX2 build on the tile layout, where the CPU has no bf16 hardware (AMD Zen 2/3, Intel before Ice Lake):
#: its int8 kernel beats dequantizing for oneDNN's fp32 GEMM at every batch measured, so it takes every row
#: count, in pieces of this many rows. Measured with the AVX2 builds on a Zen 4 core pair (oneDNN held to
#: AVX2), 0.6B shapes, 48-2048 rows: Q8_0 150-165 GOP/s against 46-142, Q4_0 220-244 against 47-147; a
#: 128-token prefill 2x faster. (The 48-row crossover above dates from the GGUF-layout kernel.)
AVX2_TILES_PIECE = 2048
GEMM_SLAB = 8192  # weight rows dequantized at a time (bounds the temporary fp32 copy, e.g. of an LM head)


class QuantizedWeight(nn.Module):
    """``W [..., N, K]`` stored as ``qs`` + fp16 block scales ``d``; ``matmul(x)`` = ``x · Wᵀ``."""

    # buffers (registered in __init__), typed for readers: nn.Module's lookup says Tensor | Module
    qs: torch.Tensor
    d: torch.Tensor

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, fmt: str, in_features: int, kernel: bool = True):
        """``qs``, ``d``: the GGUF layout (``formats.quantize``)."""
        super().__init__()
        self.fmt, self.in_features = fmt, in_features
        # decided once, when the weight is made: the kernel if it builds, else the reference for good
        self._kernel = load_quant_kernel() if kernel else None
        # large batches: in bf16 (weights and activations rounded to bf16, fp32 accumulation and output) where
        # the CPU has bf16 hardware — on AMX tiles by our kernel, else oneDNN's GEMM — elsewhere an fp32 GEMM;
        # see quant/kernel.py::gemm_path. An AMX kernel that cannot be built leaves oneDNN's bf16 GEMM.
        path = gemm_path(cpu_flags())
        self._amx = load_amx_kernel() if kernel and path == "amx" else None
        # the kernel's GEMM (its AVX-512 VNNI build), for weights in CPU memory
        self._vnni = self._kernel if path == "vnni" and qs.device.type == "cpu" else None
        self.bf16_gemm = path in ("amx", "bf16")
        # where the small-batch kernel is ours on CPU memory and large batches take the VNNI GEMM or a float
        # GEMM on dequantized rows, the buffers hold the tile layout, which our kernels read faster
        # (quant/tiles.py); the AMX kernel and the reference read GGUF's
        avx2_tiles = self._kernel is not None and self._kernel.isa == "avx2" and path != "amx"
        self.tiles = (self._kernel is not None and qs.device.type == "cpu"
                      and (self._vnni is not None or avx2_tiles))  # fmt: skip
        # the AVX2 tile kernel for every batch (AVX2_TILES_PIECE)
        self._kernel_takes_all = (self.tiles and self._kernel is not None and self._kernel.isa == "avx2"
                                  and path == "avx2")  # fmt: skip
        if self.tiles:
            qs, d = to_tiles(qs, d, fmt)
        self.register_buffer("qs", qs, persistent=True)
        self.register_buffer("d", d, persistent=True)

    @property
    def gemm_rows(self) -> int:
        """From this many activation rows on, the large-batch path rather than the int8 kernel."""
        if self._amx is not None:
            return AMX_ROWS
        if self._vnni is not None:
            return TILES_GEMM_ROWS
        if self._kernel_takes_all:
            return AVX2_TILES_PIECE + 1
        return BF16_GEMM_ROWS if self.bf16_gemm else GEMM_ROWS

    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str, kernel: bool = True) -> QuantizedWeight:
        qs, d = quantize(w, fmt)
        return cls(qs, d, fmt, w.shape[-1], kernel)

    # the parts of the Tensor interface model code reads from a weight
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.d.shape[:-1], self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # the dtype of what it computes with

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def __getitem__(self, i: int) -> QuantizedWeight:
        """One matrix of a stack (an MoE layer's expert ``i``), sharing storage."""
        out = QuantizedWeight.__new__(QuantizedWeight)
        nn.Module.__init__(out)
        out.register_buffer("qs", self.qs[i])
        out.register_buffer("d", self.d[i])
        out.fmt, out.in_features, out._kernel, out._amx = self.fmt, self.in_features, self._kernel, self._amx
        out._vnni, out.tiles, out._kernel_takes_all = self._vnni, self.tiles, self._kernel_takes_all
        out.bf16_gemm = self.bf16_gemm
        return out

    def gguf_layout(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Values and scales of rows ``start:end`` in the GGUF layout (``start`` a multiple of 16 where the
        buffers hold the tile layout)."""
        if self.tiles and start % TILE:
            raise ValueError(f"rows from {start}: a tile-layout weight converts whole tiles of {TILE} rows")
        qs, d = self.qs[..., start:end, :], self.d[..., start:end, :]
        return from_tiles(qs, d, self.fmt) if self.tiles else (qs, d)

    def dequantize(self) -> torch.Tensor:
        return dequantize(*self.gguf_layout(), self.fmt, self.in_features)

    def dense(self) -> torch.Tensor:
        """The plain fp32 values (the weight interface's name for :meth:`dequantize`)."""
        return self.dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` (an embedding lookup on a tied, quantized embedding matrix)."""
        if self.tiles:
            qs, d = tile_rows(self.qs, self.d, self.fmt, ids)
            return dequantize(qs, d, self.fmt, self.in_features).view(*ids.shape, self.in_features)
        return dequantize(self.qs[ids], self.d[ids], self.fmt, self.in_features)

    def _dequantized_rows(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """fp32 or bf16 rows ``start:end`` (``start`` a multiple of 16 where the buffers hold the tile
        layout)."""
        if self._kernel is not None and self.qs.device.type == "cpu":
            name = f"{self.fmt}_dequantize" + ("_tiles" if self.tiles else "")
            name += "_bf16" if dtype == torch.bfloat16 else ""
            return getattr(self._kernel, name)(self.qs[..., start:end, :], self.d[..., start:end, :],
                                               self.in_features)
        return dequantize(*self.gguf_layout(start, end), self.fmt, self.in_features).to(dtype)

    def matmul_batch_invariant(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x · Wᵀ (+ bias)`` through the int8 kernel for every batch size, ``AVX2_TILES_PIECE`` rows a call:
        the kernel quantizes and accumulates each row on its own, so a row's result is bitwise the same
        whatever rows share its call (the large-batch GEMM paths above round differently; the batch-invariant
        plan's choice)."""
        if self._kernel is None or not x.is_cpu:
            raise RuntimeError("the batch-invariant matmul needs the C++ quantized-matmul kernel on CPU")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        step = AVX2_TILES_PIECE
        pieces = [self._kernel_matmul(x2[i : i + step]) for i in range(0, x2.shape[0], step)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if bias is not None:
            out = out + bias
        return out.view(*shape[:-1], out.shape[-1]).to(x.dtype)

    def _kernel_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        name = f"{self.fmt}_matmul" + ("_tiles" if self.tiles else "")
        return getattr(self._kernel, name)(x2, self.qs, self.d)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (bias is None and self._kernel is not None and x.dim() == 2 and x.dtype == torch.float32
                and x.shape[0] < self.gemm_rows and x.is_cpu):  # fmt: skip
            # a decode step's matmul, ~200 per token: straight to the kernel, none of the reshaping below
            return self._kernel_matmul(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if self._amx is not None and self.gemm_rows <= x2.shape[0] <= AMX_MAX_ROWS and x2.is_cpu:
            # dequantized to bf16 a panel at a time in L2 and multiplied on AMX tiles
            # (quant/csrc/amx_matmul.cpp)
            amx_matmul = self._amx.q8_0_matmul if self.fmt == "q8_0" else self._amx.q4_0_matmul
            out = amx_matmul(x2, self.qs, self.d)
        elif self._vnni is not None and x2.shape[0] >= self.gemm_rows and x2.is_cpu:
            # int8 activations · the int8 weights, copied a panel at a time for vpdpbusd
            # (quant/csrc/vnni_gemm.h)
            out = getattr(self._vnni, f"{self.fmt}_gemm_tiles")(x2, self.qs, self.d)
        elif self._kernel_takes_all and x2.is_cpu:
            # the AVX2 tile kernel, a piece of rows at a time (AVX2_TILES_PIECE)
            step = AVX2_TILES_PIECE
            pieces = [self._kernel_matmul(x2[i : i + step]) for i in range(0, x2.shape[0], step)]
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        elif x2.shape[0] >= self.gemm_rows:
            # prefill-sized batches are compute bound: a float GEMM (oneDNN) on the weights dequantized a slab
            # at a time beats the int8 dot products (measured: ~55 GFLOP/s per core for the kernel, 80-130 for
            # fp32 oneDNN, ~300-400 for bf16 on AMX), and the dequantization is paid once per GEMM_SLAB rows
            dtype = torch.bfloat16 if self.bf16_gemm and x2.is_cpu else torch.float32
            xg, n = x2.to(dtype), self.d.shape[0]
            outs = [
                dense_matmul(xg, self._dequantized_rows(s, min(n, s + GEMM_SLAB), dtype))
                for s in range(0, n, GEMM_SLAB)
            ]
            out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).float()
        elif self._kernel is not None and x2.device.type == "cpu":
            out = self._kernel_matmul(x2)
        else:
            out = reference.quant_matmul(x2, *self.gguf_layout(), self.fmt)
        if bias is not None:
            out = out + bias
        return out.view(*shape[:-1], out.shape[-1]).to(x.dtype)

    def describe(self) -> tuple[str, str]:
        """``(format, what multiplies it)`` for people (``layers/weight_report.py``)."""
        if self._kernel is None:
            return self.fmt.upper(), "the PyTorch reference"
        gemm = ("bf16" if self.bf16_gemm else "fp32") + " oneDNN"
        large = "AMX" if self._amx is not None else "VNNI GEMM" if self._vnni is not None else (
            "the same kernel" if self._kernel_takes_all else gemm)
        return self.fmt.upper(), f"the quantized-matmul kernel ({self._kernel.isa}; large batches: {large})"

    def extra_repr(self) -> str:
        path = "kernel" if self._kernel is not None else "reference"
        path += ", amx" if self._amx is not None else ", vnni gemm" if self._vnni is not None else ""
        path += ", tile layout" if self.tiles else ""
        return f"{self.fmt}, shape={tuple(self.shape)}, {path}"

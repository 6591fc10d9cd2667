"""``KBlockWeight``: a GGUF Q4_1 / Q5_0 / Q5_1 / K-quant matrix in its compute format (``kblocks.py``) that
multiplies activations; ``KBlockStack``: K-block matrices of different kinds stacked along the output rows, in
one kernel call; ``RowStack``: matrices of any formats stacked along the output rows, each on its own kernel.

Like :class:`~forwardpass.quant.weight.QuantizedWeight` it takes the place of a layer's fp32 weight and
multiplies activations through its own kernels (:meth:`KBlockWeight.matmul`; the weight interface of
``layers/weight_interface.py``):

* fewer than ``gemm_rows`` activation rows (decode): the K-block kernel (``csrc/kblock_matmul.cpp``), int8
  activations times the codes, reading the file's bits per weight;
* more (prefill chunks): the weights dequantized a slab at a time by the kernel and a float GEMM (oneDNN), in
  bf16 where the CPU multiplies bf16 in hardware (as ``QuantizedWeight`` does,
  ``quant/kernel.py::gemm_path``), else fp32 — except where the kernel beats that at every batch measured and
  so takes every row count: on CPUs without bf16 hardware (gemm path ``"avx2"``) the AVX2 build, from 3 rows
  on in its GEMM mode (``csrc/kblock_gemm_avx2.h``); on CPUs with AVX-512 VNNI but no AMX (gemm path
  ``"vnni"``: Intel Ice Lake, AMD Zen 4) the VNNI build's passes of 8 rows over a tile;
* no kernel (no compiler, ``FORWARDPASS_QUANT_KERNEL=0``): the PyTorch reference
  (``kblocks.reference_matmul``).
"""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.kernel_build import cpu_flags
from forwardpass.layers.dense_matmul import dense_matmul
from forwardpass.quant import kblocks
from forwardpass.quant.kernel import gemm_path, load_kblock_kernel

#: from this many activation rows on, dequantize + float GEMM (the crossovers QuantizedWeight measured for its
#: GGUF-layout kernel: the same int8 dot products per block, here with one FMA more)
GEMM_ROWS = 48
BF16_GEMM_ROWS = 32
GEMM_SLAB = 8192  # weight rows dequantized at a time (bounds the temporary copy, e.g. of an LM head)
#: ``gemm_rows`` where the kernel takes every batch (the AVX2 build's GEMM mode; no row count reaches it).
#: Measured on a Zen 3 core pair (AMD EPYC, AVX2 only), SmolLM2-135M's Q4_1 matrices, alternating in one
#: process: the GEMM mode 145-165 GOP/s per core at 16-1024 rows against oneDNN's fp32 GEMM on the dequantized
#: weight at 75-90 (benchmarks/quant_gemm.py; docs/gguf.md). The AVX-512 VNNI build's passes, on a 2-core
#: Intel Xeon (Ice Lake class: VNNI, no bf16, no AMX), Q4_1/Q4_K/Q5_0/Q6_K at 16-2048 rows on SmolLM2 and
#: 1B-class shapes: 230-370 GOP/s against 25-230 for oneDNN's fp32 GEMM on the dequantized weight (1.1-9x)
KERNEL_TAKES_ALL = 1 << 62
#: rows per kernel call in the batch-invariant matmul (each row is computed alone by the kernel whatever the
#: call)
INVARIANT_PIECE = 2048


class KBlockWeight(nn.Module):
    """``W [N, K]`` held as ``codes`` + ``meta`` (``kblocks.pack``); ``matmul(x)`` = ``x · Wᵀ``."""

    codes: torch.Tensor
    meta: torch.Tensor

    def __init__(
        self, kind: kblocks.KBlockKind, codes: torch.Tensor, meta: torch.Tensor, kernel: bool = True,
        bf16_gemm: bool | None = None,
    ):
        """``bf16_gemm``: many rows multiply in bf16 (None: where the CPU multiplies bf16 in hardware) or,
        False, in fp32 (an LM head's logits, whose near-ties bf16 rounding flips)."""
        super().__init__()
        self.kind = kind
        self.fmt = kind.name
        self.in_features = self._in_features(kind, codes, meta)
        # decided once, when the weight is made: the kernel if it builds, else the reference for good
        self._kernel = load_kblock_kernel() if kernel and codes.device.type == "cpu" else None
        path = gemm_path(cpu_flags())
        self.bf16_gemm = path in ("amx", "bf16") if bf16_gemm is None else bf16_gemm
        # the kernel for every batch (KERNEL_TAKES_ALL) where it beats dequantizing for a float GEMM: the AVX2
        # build's GEMM mode on CPUs without bf16 hardware, the AVX-512 VNNI build's tile passes where the
        # CPU has VNNI but no AMX (Intel Ice Lake, AMD Zen 4)
        self._kernel_takes_all = self._kernel is not None and (
            (path == "avx2" and getattr(self._kernel, "has_gemm_mode", False))
            or (path == "vnni" and self._kernel.isa == "avx512vnni"))  # fmt: skip
        self.register_buffer("codes", codes, persistent=True)
        self.register_buffer("meta", meta, persistent=True)

    @staticmethod
    def _in_features(kind: kblocks.KBlockKind, codes: torch.Tensor, meta: torch.Tensor) -> int:
        return codes.shape[1] // kind.code_bytes * 32

    @property
    def gemm_rows(self) -> int:
        """From this many activation rows on, dequantize + float GEMM rather than the kernel."""
        if self._kernel_takes_all:
            return KERNEL_TAKES_ALL
        return BF16_GEMM_ROWS if self.bf16_gemm else GEMM_ROWS

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def path(self) -> str:
        """Which code multiplies: ``"kernel (avx2)"``, ``"kernel (avx512vnni)"`` or ``"reference"``."""
        return f"kernel ({self._kernel.isa})" if self._kernel is not None else "reference"

    def matvec_capsule(self):
        """The kernel's entry point for C++ callers (the decode stack), or None without the kernel."""
        return getattr(self._kernel, f"{self.fmt}_capsule")() if self._kernel is not None else None

    def dequantize(self) -> torch.Tensor:
        return self._dequantized_rows(0, self.shape[0])

    def dense(self) -> torch.Tensor:
        """The plain fp32 values (the weight interface's name for :meth:`dequantize`)."""
        return self.dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` (a tied embedding's lookup)."""
        flat = ids.reshape(-1)
        # the rows live interleaved in tiles of 16 (kblocks.pack): dequantize each tile they fall in, once
        tiles, where = torch.unique(flat // kblocks.TILE, return_inverse=True)
        n = self.codes.shape[0]
        deq = torch.stack([torch.nn.functional.pad(self._dequantized_rows(s, min(n, s + kblocks.TILE)),
                                                   (0, 0, 0, max(0, s + kblocks.TILE - n)))
                           for s in (tiles * kblocks.TILE).tolist()])  # fmt: skip
        out = deq[where, flat % kblocks.TILE]
        return out.view(*ids.shape, self.in_features)

    def _dequantized_rows(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes, meta = self.codes[start:end], self.meta[start:end]
        if self._kernel is not None:
            name = f"{self.fmt}_dequantize" + ("_bf16" if dtype == torch.bfloat16 else "")
            return getattr(self._kernel, name)(codes, meta)
        return kblocks.dequantize(self.kind, codes, meta).to(dtype)

    def _kernel_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return getattr(self._kernel, f"{self.fmt}_matmul")(x2, self.codes, self.meta)

    def _reference_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return kblocks.reference_matmul(x2, self.kind, self.codes, self.meta)

    def matmul_batch_invariant(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x · Wᵀ (+ bias)`` through the kernel for every batch size (each row computed on its own)."""
        if self._kernel is None or not x.is_cpu:
            raise RuntimeError("the batch-invariant matmul needs the C++ K-block kernel on CPU")
        x2 = x.reshape(-1, x.shape[-1]).float()
        pieces = [
            self._kernel_matmul(x2[i : i + INVARIANT_PIECE]) for i in range(0, x2.shape[0], INVARIANT_PIECE)
        ]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if self._kernel is not None and x2.is_cpu and x2.shape[0] < self.gemm_rows:
            out = self._kernel_matmul(x2)
        elif self._kernel is not None and x2.is_cpu:
            dtype = torch.bfloat16 if self.bf16_gemm else torch.float32
            xg, n = x2.to(dtype), self.shape[0]
            outs = [dense_matmul(xg, self._dequantized_rows(s, min(n, s + GEMM_SLAB), dtype))
                    for s in range(0, n, GEMM_SLAB)]  # fmt: skip
            out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).float()
        else:
            out = self._reference_matmul(x2)
        if bias is not None:
            out = out + bias
        return out.view(*shape[:-1], out.shape[-1]).to(x.dtype)

    def describe(self) -> tuple[str, str]:
        """``(format, what multiplies it)`` for people (``layers/weight_report.py``)."""
        return self.fmt.upper(), f"the K-block kernel {self._kernel_words()}"

    def _kernel_words(self) -> str:
        if self._kernel is None:
            return "(PyTorch reference)"
        if self._kernel_takes_all:
            return f"({self._kernel.isa}, int8 activations, every batch size)"
        gemm = "bf16" if self.bf16_gemm else "fp32"
        return f"({self._kernel.isa}, int8 activations; large batches: {gemm} oneDNN)"

    def extra_repr(self) -> str:
        return f"{self.fmt}, shape={tuple(self.shape)}, {self.path}"


class KBlockStack(KBlockWeight):
    """K-block matrices of different kinds stacked along the output rows: a merged projection whose parts
    the file stores in different types (llama.cpp's Q4_K_M keeps some ``attn_v`` in Q8_0 beside Q5_0 q/k).
    Each part keeps its own kind's tiles and bits per weight (``kblocks.pack_stack``); one kernel call
    multiplies them all (``stack_matmul``), so the decode stack takes it as it takes any KBlockWeight.
    ``codes`` and ``meta`` are 1-D (the parts' bytes one after another, ``meta`` after a header)."""

    def __init__(self, codes: torch.Tensor, meta: torch.Tensor, kernel: bool = True):
        parts = kblocks.stack_parts(codes, meta)
        super().__init__(parts[0][0], codes, meta, kernel)
        self.fmt = "stack"
        self.kinds = [kind.name for kind, _, _ in parts]
        self.rows_of_parts = [c.shape[0] for _, c, _ in parts]

    @staticmethod
    def _in_features(kind: kblocks.KBlockKind, codes: torch.Tensor, meta: torch.Tensor) -> int:
        ks = {c.shape[1] // kind.code_bytes * 32 for kind, c, _ in kblocks.stack_parts(codes, meta)}
        if len(ks) != 1:
            raise ValueError(f"the parts of a stack have different K: {sorted(ks)}")
        return ks.pop()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(self.rows_of_parts), self.in_features))

    def _dequantized_rows(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # the parts whole (a stack is one layer's projection, not an embedding), then the rows asked for
        outs = []
        for kind, codes, meta in kblocks.stack_parts(self.codes, self.meta):
            if self._kernel is not None:
                name = f"{kind.name}_dequantize" + ("_bf16" if dtype == torch.bfloat16 else "")
                outs.append(getattr(self._kernel, name)(codes, meta))
            else:
                outs.append(kblocks.dequantize(kind, codes, meta).to(dtype))
        return torch.cat(outs)[start:end]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def _reference_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        parts = kblocks.stack_parts(self.codes, self.meta)
        return torch.cat([kblocks.reference_matmul(x2, kind, c, m) for kind, c, m in parts], dim=-1)

    def describe(self) -> tuple[str, str]:
        return "/".join(k.upper() for k in self.kinds), f"the K-block kernel {self._kernel_words()}"

    def extra_repr(self) -> str:
        return f"stack of {'/'.join(self.kinds)}, shape={tuple(self.shape)}, {self.path}"


class RowStack(nn.Module):
    """Matrices stacked along the output rows (a merged q/k/v or gate/up projection whose parts a GGUF file
    stores in different types, as Q4_K_M files do): each part multiplies with its own kernel, the outputs
    concatenated."""

    def __init__(self, parts: list[nn.Module | torch.Tensor]):
        super().__init__()
        self.parts = nn.ModuleList([p if isinstance(p, nn.Module) else _Dense(p) for p in parts])
        self.in_features = parts[0].shape[-1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts[0].buffers())).device

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def dense(self) -> torch.Tensor:
        return self.dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([p.matmul(x) for p in self.parts], dim=-1)
        return out if bias is None else out + bias

    def matmul_batch_invariant(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([p.matmul_batch_invariant(x) for p in self.parts], dim=-1)
        return out if bias is None else out + bias

    def describe(self) -> tuple[str, str]:
        """The parts' formats joined, and what multiplies each (once per kind of path)."""
        parts = [p.describe() for p in self.parts]
        return " + ".join(f for f, _ in parts), " / ".join(dict.fromkeys(h for _, h in parts))


class _Dense(nn.Module):
    """An fp32 part of a :class:`RowStack`."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", w.float().contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        return self.weight

    def dense(self) -> torch.Tensor:
        return self.weight

    def describe(self) -> tuple[str, str]:
        return "float32", "oneDNN"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense_matmul(x, self.weight, bias)

    def matmul_batch_invariant(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # each row alone (a matrix-vector product per row): nothing in common between rows
        return torch.stack([self.matmul(r) for r in x.reshape(-1, x.shape[-1])]).view(*x.shape[:-1], -1)

"""The compute format of GGUF's Q4_1, Q5_0, Q5_1 and K-quant tensors: their codes and scales as stored,
repacked once at load into rows the kernel (``csrc/kblock_matmul.cpp``) streams, nothing rounded.

A matrix ``[N, K]`` becomes two uint8 tensors (the kernel's comment has the byte layout):

* ``codes [N, K/32 · BB]``: per block of 32 weights 16 bytes of nibbles, plus 8 bytes of high bits for 5- and
  6-bit codes (``BB`` = 16 or 24; a 5-bit code takes 6 bits here, one spare);
* ``meta [N, meta_bytes]``: the fp16 ``d`` (and ``dmin``) per block or super-block, then for K-quants the int8
  per-group scale and min factors.

Bits per weight read by a matmul (what batch-1 decode costs; ggml's own in brackets): Q4_1 5.0 (5.0), Q5_0 6.5
(5.5), Q5_1 7.0 (6.0), Q2_K 5.1 (2.6), Q3_K 4.6 (3.4), Q4_K 4.6 (4.5), Q5_K 6.6 (5.5), Q6_K 6.6 (6.6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardpass.quant.gguf_blocks import QK_K, Unpacked


@dataclass(frozen=True)
class KBlockKind:
    """One type's layout in the compute format (the kernel's ``Kind<...>``)."""

    name: str
    bits: int  # 4 or 6: code storage
    superblock: int  # weights per fp16 d: 32 or 256
    group: int  # weights per scale: 16 or 32
    has_min: bool
    off: int

    @property
    def code_bytes(self) -> int:
        return 24 if self.bits == 6 else 16

    def meta_bytes(self, k: int) -> int:
        nd = k // self.superblock
        n = nd * 2 * (2 if self.has_min else 1)
        if self.superblock > 32:
            n += k // self.group * (2 if self.has_min else 1)
        return (n + 3) // 4 * 4

    def bits_per_weight(self, k: int) -> float:
        return 8 * (k // 32 * self.code_bytes + self.meta_bytes(k)) / k


KINDS = {
    k.name: k
    for k in (
        KBlockKind("q4_1", 4, 32, 32, True, 0),
        KBlockKind("q5_0", 6, 32, 32, False, 16),
        KBlockKind("q5_1", 6, 32, 32, True, 0),
        KBlockKind("q2_k", 4, QK_K, 16, True, 0),
        KBlockKind("q3_k", 4, QK_K, 16, False, 4),
        KBlockKind("q4_k", 4, QK_K, 32, True, 0),
        KBlockKind("q5_k", 6, QK_K, 32, True, 0),
        KBlockKind("q6_k", 6, QK_K, 16, False, 32),
    )
}


def pack(kind: KBlockKind, un: Unpacked) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, meta)`` of an unpacked matrix (``gguf_blocks.unpack``) of ``kind``."""
    if (un.off, un.group, un.superblock, un.dm is not None) != (
        kind.off,
        kind.group,
        kind.superblock,
        kind.has_min,
    ):
        raise ValueError(f"these blocks are not {kind.name}")
    n, k = un.u.shape
    u = un.u.view(n, k // 32, 32)
    nib = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)
    if kind.bits == 6:
        hi = (u >> 4).view(n, k // 32, 4, 8)  # element 8e + j → byte j, bits 2e
        plane = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
        nib = torch.cat([nib, plane], dim=-1)
    parts = [un.d.contiguous().view(torch.uint8).view(n, -1)]
    if un.dm is not None:
        parts.append(un.dm.contiguous().view(torch.uint8).view(n, -1))
    if un.sc is not None:
        parts.append(un.sc.contiguous().view(torch.uint8))
        if un.mc is not None:
            parts.append(un.mc.contiguous().view(torch.uint8))
    meta = torch.cat(parts, dim=-1)
    pad = kind.meta_bytes(k) - meta.shape[1]
    meta = torch.nn.functional.pad(meta, (0, pad))
    return nib.reshape(n, -1).contiguous(), meta.contiguous()


def unpack_packed(kind: KBlockKind, codes: torch.Tensor, meta: torch.Tensor) -> Unpacked:
    """The inverse of :func:`pack` (the PyTorch path reads the compute format through it)."""
    n = codes.shape[0]
    nb = codes.shape[1] // kind.code_bytes
    k = nb * 32
    c = codes.view(n, nb, kind.code_bytes)
    u = torch.cat([c[..., :16] & 0x0F, c[..., :16] >> 4], dim=-1)
    if kind.bits == 6:
        plane = c[..., 16:24]  # [n, nb, 8]
        hi = torch.stack([(plane >> (2 * e)) & 3 for e in range(4)], dim=-2).reshape(n, nb, 32)
        u = u | (hi << 4)
    nd = k // kind.superblock
    pos = 0

    def take(count: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal pos
        size = count * torch.empty((), dtype=dtype).element_size()
        out = meta[:, pos : pos + size].contiguous().view(dtype)
        pos += size
        return out

    d = take(nd, torch.float16)
    dm = take(nd, torch.float16) if kind.has_min else None
    sc = mc = None
    if kind.superblock > 32:
        sc = take(k // kind.group, torch.int8)
        mc = take(k // kind.group, torch.int8) if kind.has_min else None
    return Unpacked(u.reshape(n, k), kind.off, kind.bits, kind.group, d, sc, dm, mc)


def dequantize(kind: KBlockKind, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` of the compute format (bitwise the file's values, ``gguf_blocks.dequantize``)."""
    return unpack_packed(kind, codes, meta).dequantize()


def reference_matmul(
    x: torch.Tensor, kind: KBlockKind, codes: torch.Tensor, meta: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] · Wᵀ`` as the kernel defines it: the activations quantized to int8 per block of 32 (as in
    ``reference.quantize_activations``) and dequantized, times the dequantized weights, in fp32."""
    from forwardpass.quant.reference import QK, quantize_activations

    xq, xd = quantize_activations(x)
    xs = (xq.float().view(xq.shape[0], -1, QK) * xd.unsqueeze(-1)).view(xq.shape[0], -1)
    return xs @ dequantize(kind, codes, meta).T

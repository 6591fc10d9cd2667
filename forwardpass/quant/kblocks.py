"""The compute format of GGUF's Q4_1, Q5_0, Q5_1 and K-quant tensors: their codes and scales as stored,
repacked once at load into rows the kernel (``csrc/kblock_matmul.cpp``) streams, nothing rounded.

A matrix ``[N, K]`` becomes two uint8 tensors of the same rows, in tiles of 16 rows whose bytes are
interleaved (:func:`pack` has the offsets; ``csrc/kblock_tiles.h`` why):

* ``codes [N, K/32 · BB]``: per block of 32 weights 16 bytes of nibbles, plus a plane of 4 bytes of high bits
  for 5-bit codes or two for 6-bit codes (``BB`` = 16, 20 or 24: each code in as many bits as the file's);
* ``meta [N, meta_bytes]``: the fp16 ``d`` (and ``dmin``) per block or super-block, then for K-quants the
  per-group scale and min factors: int8 each, or for Q4_K / Q5_K (6-bit factors) packed as the file packs
  them, 12 bytes per super-block.

Q8_0 has a kind too (its bytes as they are, offset 128), only as a part of a stack (:func:`pack_stack`): a
merged projection whose parts the file stores in different types.

Bits per weight read by a matmul (what batch-1 decode costs; ggml's own in brackets): Q4_1 5.0 (5.0), Q5_0 5.5
(5.5), Q5_1 6.0 (6.0), Q2_K 5.1 (2.6), Q3_K 4.6 (3.4), Q4_K 4.5 (4.5), Q5_K 5.5 (5.5), Q6_K 6.56 (6.56),
Q8_0 8.5 (8.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardpass.quant.gguf_blocks import QK_K, Unpacked


@dataclass(frozen=True)
class KBlockKind:
    """One type's layout in the compute format (the kernel's ``Kind<...>``)."""

    name: str
    bits: int  # 4, 5, 6 or 8: code storage
    superblock: int  # weights per fp16 d: 32 or 256
    group: int  # weights per scale: 16 or 32
    has_min: bool
    off: int

    @property
    def code_bytes(self) -> int:
        return {4: 16, 5: 20, 6: 24, 8: 32}[self.bits]

    @property
    def pack6(self) -> bool:
        """Q4_K, Q5_K: 6-bit scale and min factors, packed (4 low bits of each per group in one byte, the high
        bits of a super-block's 8 groups in 4 bytes)."""
        return self.superblock > 32 and self.has_min and self.group == 32

    def meta_bytes(self, k: int) -> int:
        nd = k // self.superblock
        n = nd * 2 * (2 if self.has_min else 1)
        if self.pack6:
            n += k // self.group + nd * 4
        elif self.superblock > 32:
            n += k // self.group * (2 if self.has_min else 1)
        return (n + 3) // 4 * 4

    def bits_per_weight(self, k: int) -> float:
        return 8 * (k // 32 * self.code_bytes + self.meta_bytes(k)) / k


KINDS = {
    k.name: k
    for k in (
        KBlockKind("q4_1", 4, 32, 32, True, 0),
        KBlockKind("q5_0", 5, 32, 32, False, 16),
        KBlockKind("q5_1", 5, 32, 32, True, 0),
        KBlockKind("q2_k", 4, QK_K, 16, True, 0),
        KBlockKind("q3_k", 4, QK_K, 16, False, 4),
        KBlockKind("q4_k", 4, QK_K, 32, True, 0),
        KBlockKind("q5_k", 5, QK_K, 32, True, 0),
        KBlockKind("q6_k", 6, QK_K, 16, False, 32),
        KBlockKind("q8_0", 8, 32, 32, False, 128),
    )
}
#: the kernel's index of each kind in a stack's header (kblock_matmul.cpp::KIND_OPS)
STACK_KINDS = tuple(KINDS)


TILE = 16  # weight rows interleaved per tile (the kernel's vector lanes: one output row each)


def _row_tiles(n: int) -> list[tuple[int, int, int]]:
    """``(first row, rows, rows per tile)`` of the whole tiles, then of the last partial one: each run is
    reshaped at once."""
    full = n // TILE * TILE
    return [(0, full, TILE)] * (full > 0) + [(full, n - full, n - full)] * (n > full)


def _tile_fields(fields: list[torch.Tensor], r: int) -> torch.Tensor:
    """Per-row fields ``[n, units, size]`` (uint8) → tile order: per tile, per unit, the ``r`` rows' bytes."""
    out = [f.view(-1, r, f.shape[1], f.shape[2]).transpose(1, 2).reshape(-1, r * f.shape[1] * f.shape[2])
           for f in fields]  # fmt: skip
    return torch.cat(out, dim=1).view(-1, sum(f.shape[1] * f.shape[2] for f in fields))


def _untile_fields(tiled: torch.Tensor, r: int, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The inverse of :func:`_tile_fields`: ``tiled [n, Σ units·size]`` → ``[n, units, size]`` per field."""
    t = tiled.reshape(-1, r * tiled.shape[1])
    out, pos = [], 0
    for units, size in shapes:
        part = t[:, pos : pos + r * units * size].reshape(-1, units, r, size).transpose(1, 2)
        out.append(part.reshape(-1, units, size))
        pos += r * units * size
    return out


def _code_fields(kind: KBlockKind, u: torch.Tensor) -> list[torch.Tensor]:
    """``u [n, K]`` → per block ``[n, nb·(4, 5 or 6), 4]``: 4 groups of 4 bytes (element 8g + c low nibble,
    8g + 4 + c high), then the high bits: for 5-bit codes one plane of 4 bytes (byte c, bit j: bit 4 of
    element 4j + c), for 6-bit codes two (plane p, byte c: the high 2 bits of elements 16p + c, 16p + 4 + c,
    16p + 8 + c, 16p + 12 + c at bits 0-1, 2-3, 4-5, 6-7)."""
    n, k = u.shape
    nb = k // 32
    if kind.bits == 8:  # the bytes as they are: field v holds elements 4v .. 4v + 3
        return [u.reshape(n, nb * 8, 4)]
    e = u.view(n, nb, 4, 2, 4)
    groups = (e[..., 0, :] & 0x0F) | ((e[..., 1, :] & 0x0F) << 4)  # [n, nb, 4, 4]
    if kind.bits == 5:
        h = ((u >> 4) & 1).view(n, nb, 8, 4)  # [j, c]
        plane = sum(h[:, :, j] << j for j in range(8)).view(n, nb, 1, 4)
        groups = torch.cat([groups, plane.to(torch.uint8)], dim=2)
    elif kind.bits == 6:
        h = (u >> 4).view(n, nb, 2, 4, 4)  # [plane, quarter, c]
        plane = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)
        groups = torch.cat([groups, plane], dim=2)
    return [groups.reshape(n, -1, 4)]


def _codes_of(kind: KBlockKind, fields: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`_code_fields`: ``[n, nb·(4, 5 or 6), 4]`` → ``u [n, K]``."""
    n, nb = fields.shape[0], k // 32
    if kind.bits == 8:
        return fields.reshape(n, k)
    f = fields.view(n, nb, -1, 4)
    g = f[:, :, :4]
    u = torch.stack([g & 0x0F, g >> 4], dim=3)  # [n, nb, 4, 2, 4]
    if kind.bits == 5:
        p = f[:, :, 4]  # [n, nb, 4]
        hi = torch.stack([(p >> j) & 1 for j in range(8)], dim=2)  # [n, nb, 8, 4]
        u = u | (hi.view(n, nb, 4, 2, 4) << 4)
    elif kind.bits == 6:
        p = f[:, :, 4:6]  # [n, nb, 2, 4]
        hi = torch.stack([(p >> (2 * q)) & 3 for q in range(4)], dim=3)  # [n, nb, 2, 4, 4]
        u = u | (hi.view(n, nb, 4, 2, 4) << 4)
    return u.reshape(n, k)


def _meta_fields(kind: KBlockKind, un: Unpacked) -> list[torch.Tensor]:
    n = un.u.shape[0]
    fields = [un.d.contiguous().view(torch.uint8).view(n, -1, 2)]
    if un.dm is not None:
        fields.append(un.dm.contiguous().view(torch.uint8).view(n, -1, 2))
    if kind.pack6:  # factors 0..63: low 4 bits of scale | of min << 4, then the high bits per super-block
        sc, mc = un.sc.view(torch.uint8), un.mc.view(torch.uint8)  # type: ignore[union-attr]
        fields.append(((sc & 0x0F) | ((mc & 0x0F) << 4)).view(n, -1, 1))
        high = ((sc >> 4) | ((mc >> 4) << 2)).view(n, -1, 4, 2)  # [n, nd, byte, group of the byte]
        fields.append((high[..., 0] | (high[..., 1] << 4)).contiguous())
    elif un.sc is not None:
        fields.append(un.sc.contiguous().view(torch.uint8).view(n, -1, 1))
        if un.mc is not None:
            fields.append(un.mc.contiguous().view(torch.uint8).view(n, -1, 1))
    used = sum(f.shape[1] * f.shape[2] for f in fields)
    pad = kind.meta_bytes(un.u.shape[1]) - used
    return fields + [torch.zeros(n, pad, 1, dtype=torch.uint8)] * (pad > 0)


def _meta_shapes(kind: KBlockKind, k: int) -> list[tuple[int, int]]:
    nd, ng = k // kind.superblock, k // kind.group
    shapes = [(nd, 2)] * (2 if kind.has_min else 1)
    if kind.pack6:
        shapes += [(ng, 1), (nd, 4)]
    elif kind.superblock > 32:
        shapes += [(ng, 1)] * (2 if kind.has_min else 1)
    used = sum(a * b for a, b in shapes)
    return shapes + [(kind.meta_bytes(k) - used, 1)] * (kind.meta_bytes(k) > used)


def pack(kind: KBlockKind, un: Unpacked) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, meta)`` of an unpacked matrix (``gguf_blocks.unpack``) of ``kind``, in the tile layout:
    rows ``16t .. 16t + R`` (R = 16, or what is left for the last tile) keep their place, and their bytes are
    interleaved so that each 4-byte field of the R rows lies side by side (one vector load, one row per lane):

    * codes, block b of the tile at ``b · BB · R``: group g (elements 8g .. 8g + 7) of row r at
      ``(g · R + r) · 4``, then (5- and 6-bit codes) high-bit plane p of row r at ``16R + (p · R + r) · 4``;
    * meta: fp16 ``d`` of (super-)block s, row r at ``2 · (s · R + r)``, then ``dmin`` alike, then the int8
      scale of group j at ``j · R + r``, then the min factors alike (Q4_K / Q5_K: the byte of group j's low
      bits at ``j · R + r``, then super-block s's 4 bytes of high bits at ``(s · R + r) · 4``), then zero
      padding."""
    if (un.off, un.group, un.superblock, un.dm is not None) != (
        kind.off,
        kind.group,
        kind.superblock,
        kind.has_min,
    ):
        raise ValueError(f"these blocks are not {kind.name}")
    n, k = un.u.shape
    codes = _code_fields(kind, un.u)
    meta = _meta_fields(kind, un)
    cparts, mparts = [], []
    for s, rows, r in _row_tiles(n):
        cparts.append(_tile_fields([f[s : s + rows] for f in codes], r))
        mparts.append(_tile_fields([f[s : s + rows] for f in meta], r))
    return torch.cat(cparts).contiguous(), torch.cat(mparts).contiguous()


def unpack_packed(kind: KBlockKind, codes: torch.Tensor, meta: torch.Tensor) -> Unpacked:
    """The inverse of :func:`pack` (the PyTorch path reads the compute format through it). ``codes`` and
    ``meta`` are whole tiles: rows ``16t ..`` up to a multiple of 16 or the matrix's end."""
    n = codes.shape[0]
    k = codes.shape[1] // kind.code_bytes * 32
    nb = k // 32
    cshape = [(nb * kind.code_bytes // 4, 4)]
    mshapes = _meta_shapes(kind, k)
    cf, mf = [], []
    for s, rows, r in _row_tiles(n):
        cf.append(_untile_fields(codes[s : s + rows], r, cshape)[0])
        mf.append(_untile_fields(meta[s : s + rows], r, mshapes))
    u = _codes_of(kind, torch.cat(cf), k)
    fields = [torch.cat([m[i] for m in mf]).reshape(n, -1) for i in range(len(mshapes))]

    def as_type(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return f.contiguous().view(dtype)

    d = as_type(fields[0], torch.float16)
    dm = as_type(fields[1], torch.float16) if kind.has_min else None
    sc = mc = None
    if kind.pack6:
        lo, hi = fields[2], fields[3].reshape(n, -1, 4)
        high = torch.stack([hi & 0x0F, hi >> 4], dim=-1).reshape(n, -1)  # the 4 high bits of each group
        sc = ((lo & 0x0F) | ((high & 3) << 4)).view(torch.int8)
        mc = ((lo >> 4) | ((high >> 2) << 4)).view(torch.int8)
    elif kind.superblock > 32:
        i = 2 if kind.has_min else 1
        sc = as_type(fields[i], torch.int8)
        mc = as_type(fields[i + 1], torch.int8) if kind.has_min else None
    return Unpacked(u, kind.off, kind.bits, kind.group, d, sc, dm, mc)


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


def pack_stack(parts: list[tuple[KBlockKind, Unpacked]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, meta)`` of matrices of different kinds stacked along the output rows, as
    ``kblock_matmul.cpp::stack_matmul`` reads them: each part packed alone (:func:`pack`, its own tiles), its
    codes after the previous part's, its meta likewise after a header of int64: the number of parts, then per
    part the index of its kind in :data:`STACK_KINDS`, its rows and its K. Neighbours of one kind are one part
    (q and k of one type: one kernel pass)."""
    merged: list[tuple[KBlockKind, Unpacked]] = []
    for kind, un in parts:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, _cat_rows(merged[-1][1], un))
        else:
            merged.append((kind, un))
    header = [len(merged)]
    codes, metas = [], []
    for kind, un in merged:
        c, m = pack(kind, un)
        header += [STACK_KINDS.index(kind.name), c.shape[0], un.u.shape[1]]
        codes.append(c.reshape(-1))
        metas.append(m.reshape(-1))
    head = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    return torch.cat(codes), torch.cat([head, *metas])


def _cat_rows(a: Unpacked, b: Unpacked) -> Unpacked:
    def cat(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None or y is None else torch.cat([x, y])

    return Unpacked(torch.cat([a.u, b.u]), a.off, a.bits, a.group, torch.cat([a.d, b.d]), cat(a.sc, b.sc),
                    cat(a.dm, b.dm), cat(a.mc, b.mc))  # fmt: skip


StackPart = tuple[KBlockKind, torch.Tensor, torch.Tensor]


def stack_parts(codes: torch.Tensor, meta: torch.Tensor) -> list[StackPart]:
    """The inverse of :func:`pack_stack`: each part's ``(kind, codes [rows, bytes], meta [rows, bytes])``
    (views)."""
    head = meta[:8].view(torch.int64)
    n = int(head[0])
    fields = meta[: 8 * (1 + 3 * n)].view(torch.int64).tolist()[1:]
    out, co, mo = [], 0, 8 * (1 + 3 * n)
    for i in range(n):
        kind, rows, k = KINDS[STACK_KINDS[fields[3 * i]]], fields[3 * i + 1], fields[3 * i + 2]
        cb, mb = k // 32 * kind.code_bytes, kind.meta_bytes(k)
        part_codes, part_meta = codes[co : co + rows * cb], meta[mo : mo + rows * mb]
        out.append((kind, part_codes.view(rows, cb), part_meta.view(rows, mb)))
        co, mo = co + rows * cb, mo + rows * mb
    return out

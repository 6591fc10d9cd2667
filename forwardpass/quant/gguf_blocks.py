"""GGUF's weight types in plain PyTorch: each block layout unpacked into integer codes and scales, and the
reference dequantization, bit for bit ``gguf.quants.dequantize`` (``tests/test_gguf_blocks.py``).

Every type listed in :data:`BLOCK_TYPES` has the same shape once unpacked (:class:`Unpacked`): per weight an
unsigned code ``u`` (at most 6 bits) with an offset ``off`` subtracted, per group of 16 or 32 weights a scale
and for the affine types a min, the scales and mins themselves two-level in the K-quants (an fp16 ``d`` /
``dmin`` per super-block of 256 times a small integer per group)::

    w = (d · sc) · (u - off)  [+ m  (Q4_1, Q5_1) or - dmin · m  (K-quants)]

``d · sc`` is exact in fp32 (an fp16 times an integer of at most 8 bits), and so is every product with a code
except Q6_K's (rounded once, as ggml rounds it), so computing ``w`` this way gives ggml's floats exactly. The
compute formats of ``quant/kblocks.py`` keep these fields as they are (the codes repacked, nothing rounded).

Layouts: ggml's ``ggml-common.h`` (``block_q4_1``, ``block_q4_K``, ...) as gguf-py's dequantizers read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256  # weights per K-quant super-block

#: type → (weights per block, bytes per block), as ggml's GGML_QUANT_SIZES
BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class Unpacked:
    """A quantized matrix ``[R, K]`` as codes and scales (see the module's docstring).

    ``d``/``dm`` are fp16 per block of 32 (legacy types, ``sc``/``mc`` None; the min ``dm`` is added) or per
    super-block of 256 (K-quants, with int8 ``sc``/``mc`` per group of ``group`` weights; the min ``dm · mc``
    is subtracted, as ggml does, so that a zero keeps ggml's sign); ``dm``/``mc`` are None for symmetric
    types."""

    u: torch.Tensor  # uint8 [R, K], 0 <= u < 2**bits
    off: int
    bits: int  # 4, 5 or 6: how the codes are stored in the compute format
    group: int  # weights per scale: 16 or 32
    d: torch.Tensor
    sc: torch.Tensor | None = None
    dm: torch.Tensor | None = None
    mc: torch.Tensor | None = None

    @property
    def superblock(self) -> int:
        """Weights per ``d`` entry."""
        return 32 if self.sc is None else QK_K

    def scales(self) -> torch.Tensor:
        """fp32 per group ``[R, K / group]``: ``d · sc`` (exact)."""
        d = self.d.float().repeat_interleave(self.superblock // self.group, dim=-1)
        return d if self.sc is None else d * self.sc.float()

    def mins(self) -> torch.Tensor | None:
        if self.dm is None:
            return None
        dm = self.dm.float().repeat_interleave(self.superblock // self.group, dim=-1)
        return dm if self.mc is None else dm * self.mc.float()

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[R, K]``, ggml's values bit for bit."""
        r, k = self.u.shape
        q = (self.u.to(torch.int16) - self.off).float().view(r, k // self.group, self.group)
        w = self.scales().unsqueeze(-1) * q
        mins = self.mins()
        if mins is not None:  # (no + 0 for symmetric types: -0.0 stays -0.0, as in ggml)
            w = w + mins.unsqueeze(-1) if self.mc is None else w - mins.unsqueeze(-1)
        return w.view(r, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes → fp16 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """Bytes ``[..., n · span]`` holding, per chunk of ``span`` bytes, elements ``0..span`` in the low nibbles
    and ``span..2·span`` in the high ones → codes ``[..., 2 · n · span]``."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, span)
    q = torch.cat([q & 0x0F, q >> 4], dim=-2)
    return q.reshape(*qs.shape[:-1], -1)


def _bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Bit planes: ``packed [..., n, B]`` → ``[..., n, count, B]``, field ``i`` = bits ``width·i`` of each
    byte."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8).view(count, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins → ``(sc, m)`` uint8 ``[..., 8]``."""
    s = s.reshape(*s.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def unpack(kind: str, raw: torch.Tensor, k: int) -> Unpacked:
    """The blocks ``raw`` (uint8 ``[R, bytes per row]``, the file's bytes) of a ``kind`` matrix with rows of
    ``k``."""
    size, nbytes = BLOCK_TYPES[kind]
    r = raw.shape[0]
    if k % size or raw.shape[-1] != k // size * nbytes:
        raise ValueError(f"{kind}: a row of {k} weights is {k // size * nbytes} bytes, got {raw.shape[-1]}")
    b = raw.reshape(r, k // size, nbytes)
    if kind == "Q8_0":
        u = (b[..., 2:].reshape(r, k).view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return Unpacked(u, 128, 8,
                        32, _f16(b[..., :2]))  # fmt: skip
    if kind == "Q4_0":
        return Unpacked(_nibbles(b[..., 2:], 16).reshape(r, k), 8, 4, 32, _f16(b[..., :2]))
    if kind == "Q4_1":
        return Unpacked(
            _nibbles(b[..., 4:], 16).reshape(r, k), 0, 4, 32, _f16(b[..., :2]), dm=_f16(b[..., 2:4])
        )
    if kind in ("Q5_0", "Q5_1"):
        o = 2 if kind == "Q5_0" else 4
        qh = (
            _bits(b[..., o : o + 4], 1, 8).transpose(-1, -2).reshape(r, -1, 32)
        )  # bit i of the 32 → element i
        u = (_nibbles(b[..., o + 4 :], 16).reshape(r, -1, 32) | (qh << 4)).reshape(r, k)
        if kind == "Q5_0":
            return Unpacked(u, 16, 5, 32, _f16(b[..., :2]))
        return Unpacked(u, 0, 5, 32, _f16(b[..., :2]), dm=_f16(b[..., 2:4]))
    if kind == "Q2_K":  # scales[16] qs[64] d dmin
        sc = b[..., :16]
        u = _bits(b[..., 16:80].reshape(r, -1, 2, 32), 2, 4).reshape(r, k)  # byte i, shift 2s → 32s + i
        return Unpacked(u, 0, 4, 16, _f16(b[..., 80:82]), (sc & 0x0F).reshape(r, -1).view(torch.int8),
                        _f16(b[..., 82:84]), (sc >> 4).reshape(r, -1).view(torch.int8))  # fmt: skip
    if kind == "Q3_K":  # hmask[32] qs[64] scales[12] d
        lo = _bits(b[..., 32:96].reshape(r, -1, 2, 32), 2, 4).reshape(r, -1, QK_K)
        hi = _bits(b[..., :32], 1, 8).reshape(r, -1, QK_K)  # bit j of byte i → element 32j + i
        u = (lo | (hi << 2)).reshape(r, k)  # u - 4 = ggml's q (the high bit set means no -4)
        s = b[..., 96:108]
        low = _nibbles(s[..., :8], 8)
        high = _bits(s[..., 8:12], 2, 4).reshape(r, -1, 16)
        sc = ((low | (high << 4)).to(torch.int8) - 32).reshape(r, -1)
        return Unpacked(u, 4, 4, 16, _f16(b[..., 108:110]), sc)
    if kind in ("Q4_K", "Q5_K"):  # d dmin scales[12] (qh[32]) qs[128]
        sc, mn = _k_scale_min(b[..., 4:16])
        ql = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
        u = _nibbles(ql, 32).reshape(r, -1, QK_K)  # 64-weight chunks: low nibbles then high
        if kind == "Q5_K":
            u = u | (_bits(b[..., 16:48], 1, 8).reshape(r, -1, QK_K) << 4)
        return Unpacked(u.reshape(r, k), 0, 4 if kind == "Q4_K" else 5, 32, _f16(b[..., :2]),
                        sc.reshape(r, -1).view(torch.int8), _f16(b[..., 2:4]),
                        mn.reshape(r, -1).view(torch.int8))  # fmt: skip
    if kind == "Q6_K":  # ql[128] qh[64] scales[16] d
        lo = _nibbles(b[..., :128], 64).reshape(r, -1, QK_K)
        hi = _bits(b[..., 128:192].reshape(r, -1, 2, 32), 2, 4).reshape(r, -1, QK_K)
        return Unpacked((lo | (hi << 4)).reshape(r, k), 32, 6, 16, _f16(b[..., 208:210]),
                        b[..., 192:208].reshape(r, -1).view(torch.int8))  # fmt: skip
    raise ValueError(f"{kind} is not a block-quantized type we unpack")


#: symmetric types of 32-weight blocks with one fp16 scale each: their values are Q8_0 values exactly
AS_Q8_0 = ("Q8_0", "Q4_0", "Q5_0")


def to_q8_0(kind: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_0 blocks of the same values as ``raw`` of an ``AS_Q8_0`` type (the same fp16 ``d``, int8
    ``u − off``): what puts a Q5_0 q/k beside a Q8_0 v (llama.cpp's Q4_K_M) into one merged weight, nothing
    rounded."""
    if kind == "Q8_0":
        return raw
    if kind not in AS_Q8_0:
        raise ValueError(f"{kind} values are not Q8_0 values")
    un = unpack(kind, raw, k)
    r = raw.shape[0]
    q = (un.u.to(torch.int16) - un.off).to(torch.int8).view(torch.uint8).view(r, k // 32, 32)
    d = un.d.contiguous().view(torch.uint8).view(r, k // 32, 2)
    return torch.cat([d, q], dim=-1).reshape(r, -1).contiguous()


def dequantize(kind: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 ``[R, k]`` of a GGUF tensor's bytes ``raw`` (uint8 ``[R, bytes per row]``): ggml's values bit for
    bit."""
    if kind == "F32":
        return raw.contiguous().view(torch.float32).reshape(-1, k).clone()
    if kind == "F16":
        return raw.contiguous().view(torch.float16).reshape(-1, k).float()
    if kind == "BF16":
        return raw.contiguous().view(torch.bfloat16).reshape(-1, k).float()
    if kind == "Q8_0":  # ggml: x · d, the int8 values as they are (no offset arithmetic)
        r = raw.shape[0]
        b = raw.reshape(r, k // 32, 34)
        return (
            b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., :2]).float().unsqueeze(-1)
        ).view(r, k)
    return unpack(kind, raw, k).dequantize()

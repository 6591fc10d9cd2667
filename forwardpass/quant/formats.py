"""Block-quantized weight formats (the GGUF ones): rows of K weights cut into blocks of 32 along K.

* ``q8_0``: per block an fp16 scale ``d`` and 32 int8 values; weight = q · d, q in [-127, 127].
* ``q4_0``: per block an fp16 scale ``d`` and 32 4-bit values packed in 16 bytes (byte j holds value j in
  its low nibble and value j + 16 in its high nibble); weight = (q - 8) · d.

We keep values and scales in two tensors (``qs [N, ...]``, ``d [N, K_pad / 32]``) rather than GGUF's
interleaved 34- / 18-byte blocks, so each is a plain strided tensor; the bytes inside are the same.
A row whose K is not a multiple of 32 is padded with zeros to ``K_pad``. The quantizers reproduce
ggml's reference ones bit for bit (``tests/test_quant.py`` checks them against the ``gguf`` package).

Why blocks of 32 with a scale for int8 rather than one scale per output channel: one kernel and one
layout serve our own int8 and llama.cpp's Q8_0 files; a block's scale adapts to local outliers, and its
cost is 2 bytes per 32 (6% more bytes than per channel), a bandwidth price we pay for ~2× less error
(measured in ``tests/test_quant.py::test_block_scales_beat_per_channel``).
"""

from __future__ import annotations

import torch

QK = 32  # weights per block
FORMATS = ("q8_0", "q4_0")
#: bytes read per weight: the values plus one fp16 scale per block of 32
BYTES_PER_WEIGHT = {"q8_0": (QK + 2) / QK, "q4_0": (QK // 2 + 2) / QK}


def padded(k: int) -> int:
    return (k + QK - 1) // QK * QK


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """``w [..., K]`` as fp32 blocks ``[..., K_pad / 32, 32]`` (zero padded)."""
    w = w.float()
    k = w.shape[-1]
    if k % QK:
        w = torch.nn.functional.pad(w, (0, padded(k) - k))
    return w.reshape(*w.shape[:-1], -1, QK)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qs int8 [..., K_pad], d fp16 [..., K_pad / 32])`` of ``w [..., K]``."""
    b = _blocks(w)
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = b * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # C roundf: halves away from zero, as ggml does
    return q.to(torch.int8).flatten(-2), d.squeeze(-1).half()


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qs uint8 [..., K_pad / 2], d fp16 [..., K_pad / 32])`` of ``w [..., K]``."""
    b = _blocks(w)
    imax = b.abs().argmax(dim=-1, keepdim=True)  # first of the largest magnitudes, signed value below
    d = b.gather(-1, imax) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return packed.flatten(-2), d.squeeze(-1).half()


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "q8_0":
        return quantize_q8_0(w)
    if fmt == "q4_0":
        return quantize_q4_0(w)
    raise ValueError(f"unknown block format {fmt!r}; known: {', '.join(FORMATS)}")


def dequantize(qs: torch.Tensor, d: torch.Tensor, fmt: str, k: int | None = None) -> torch.Tensor:
    """fp32 weights ``[..., k]`` (``k`` drops the padding; default: all ``K_pad`` columns)."""
    if fmt == "q8_0":
        vals = qs.float().reshape(*qs.shape[:-1], -1, QK)
    elif fmt == "q4_0":
        p = qs.reshape(*qs.shape[:-1], -1, QK // 2)
        vals = torch.cat([p & 0x0F, p >> 4], dim=-1).float() - 8
    else:
        raise ValueError(f"unknown block format {fmt!r}; known: {', '.join(FORMATS)}")
    w = (vals * d.float().unsqueeze(-1)).flatten(-2)
    return w if k is None else w[..., :k]

"""The plain PyTorch definition of the quantized matmul the C++ kernel computes (and its fallback).

``y = x · Wᵀ`` with W in a block format (``formats.py``) and x quantized to int8 per block of 32 along K
(scale = absmax / 127, values rounded half to even): ``y[m, n] = Σ_b d_w[n, b] · d_x[m, b] · Σ_j q_w · q_x``.
Written as one matmul of the dequantized activations and weights; the products of the small integers
are exact, so it differs from the kernel's block-wise integer sums only in float rounding.
"""

from __future__ import annotations

import torch

from forwardpass.quant.formats import QK, dequantize, padded


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` fp32 → ``(int8 [M, K_pad], fp32 scales [M, K_pad / 32])``, the kernel's bytes exactly."""
    m, k = x.shape
    b = torch.nn.functional.pad(x.float(), (0, padded(k) - k)).reshape(m, -1, QK)
    d = b.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.round(b * inv)  # half to even, as _mm256_round_ps(_MM_FROUND_TO_NEAREST_INT)
    return q.to(torch.int8).reshape(m, -1), d.squeeze(-1)


def quant_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [M, K]`` fp32 · quantized ``W [N, K]``ᵀ → ``[M, N]`` fp32."""
    xq, xd = quantize_activations(x)
    xs = (xq.float().reshape(xq.shape[0], -1, QK) * xd.unsqueeze(-1)).reshape(xq.shape[0], -1)
    return xs @ dequantize(qs, d, fmt).T


def quant_matmul_exact(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str, block_pairs: bool = False
) -> torch.Tensor:
    """The kernel's float operations one for one, so its result is bitwise the kernel's (tests only: a
    Python loop over blocks). Per block and for each of 8 lanes (4 consecutive products each, the
    int32 lanes of ``_mm256_madd_epi16``): ``acc = fma(float(lane sum), d_w · d_x, acc)``; then the
    lanes are summed in ``hsum``'s order. The fma is computed in float64, where ``lane sum · scale``
    (< 2^17 times a float32) is exact, then rounded to float32 once.

    ``block_pairs``: the AVX-512 build holds two blocks per register, so even and odd blocks accumulate
    separately (same lane sums) and the register's halves meet in one add before ``hsum``: Q8_0 holds
    [even lanes 0-7, odd lanes 0-7], Q4_0 [even 0-3, odd 0-3, even 4-7, odd 4-7]."""
    xq, xd = quantize_activations(x)
    m, nb = xd.shape
    n = qs.shape[0]
    xv = xq.float().reshape(m, nb, 8, 4)
    wv = dequantize(qs, torch.ones_like(d), fmt).reshape(n, nb, 8, 4)  # the integer values
    dw = d.float()
    acc = torch.zeros(2 if block_pairs else 1, m, n, 8)
    for b in range(nb):
        lanes = torch.einsum("mlk,nlk->mnl", xv[:, b], wv[:, b])  # integers < 2^17: exact in float32
        # the scale is a float32 product, as in the kernel
        scale = (dw[:, b][None, :] * xd[:, b][:, None]).double().unsqueeze(-1)
        k = b % 2 if block_pairs else 0
        acc[k] = (acc[k].double() + lanes.double() * scale).float()
    if not block_pairs:
        a = acc[0].unbind(-1)
    elif fmt == "q8_0":
        a = (acc[0] + acc[1]).unbind(-1)
    else:
        a = torch.cat([acc[0][..., :4] + acc[0][..., 4:], acc[1][..., :4] + acc[1][..., 4:]], -1).unbind(-1)
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def quant_gemm_exact(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float operations of the AVX-512 VNNI GEMM (``csrc/vnni_gemm.h``) one for one, so its result is
    bitwise the kernel's (tests only): each block's integer dot product whole (exact), then
    ``acc = fma(sum, d_w · d_x, acc)`` block after block, the fma in float64 and rounded once, as in
    ``quant_matmul_exact``."""
    xq, xd = quantize_activations(x)
    m, nb = xd.shape
    n = qs.shape[0]
    xv = xq.float().reshape(m, nb, QK)
    wv = dequantize(qs, torch.ones_like(d), fmt).reshape(n, nb, QK)  # the integer values
    dw = d.float()
    acc = torch.zeros(m, n)
    for b in range(nb):
        sums = xv[:, b] @ wv[:, b].T  # integers < 2^19: exact in float32
        scale = (dw[:, b][None, :] * xd[:, b][:, None]).double()
        acc = (acc.double() + sums.double() * scale).float()
    return acc


def exact_for(isa: str, tiles: bool = False):
    """The float order of the small-batch kernel built for ``isa`` (the AVX-512 build pairs blocks; on weights
    in the tile layout it sums blocks in sequence, as the GEMM), for tests that compare whole models bit for
    bit."""

    def matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str) -> torch.Tensor:
        if tiles:
            return quant_gemm_exact(x, qs, d, fmt)
        return quant_matmul_exact(x, qs, d, fmt, block_pairs=isa == "avx512vnni")

    return matmul

"""The K-block kernel's tile layout (quant/kblocks.py::pack) holds each byte where its docstring says, and the
kernel (csrc/kblock_tiles.h) computes at the real model's sizes (SmolLM2's 576 x 1536 projections: many tiles,
a partial last one) through the tile path of each build, bit for bit gguf's dequantizer and within float
rounding of the naive reference (kblocks.reference_matmul)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from forwardpass.quant import gguf_blocks, kblocks  # noqa: E402
from forwardpass.quant.kernel import kblock_kernel_for  # noqa: E402
from tests.test_gguf_blocks import ISAS, TOL, random_blocks  # noqa: E402


@pytest.fixture(scope="module", params=ISAS)
def kernel(request):
    try:
        module = kblock_kernel_for(request.param).load(logging.getLogger(__name__))
    except Exception as e:  # no compiler here: the reference path is what runs (said in the log)
        pytest.skip(f"the K-block kernel ({request.param}) cannot be built here: {e}")
    assert module.isa == request.param
    return module


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q6_K", "Q2_K"])
def test_pack_puts_each_byte_where_documented(kind):
    n, k = 21, 512  # a whole tile and a partial one (5 rows)
    spec = kblocks.KINDS[kind.lower()]
    un = gguf_blocks.unpack(kind, torch.from_numpy(random_blocks(kind, n, k, 7)), k)
    codes, meta = kblocks.pack(spec, un)
    u, c, m = un.u.numpy(), codes.numpy().reshape(-1), meta.numpy().reshape(-1)
    row_c, row_m = codes.shape[1], meta.shape[1]
    for row in range(n):
        t0, r, big_r = row // 16 * 16, row % 16, min(16, n - row // 16 * 16)
        base = t0 * row_c
        for b in range(k // 32):
            blk = base + b * spec.code_bytes * big_r
            for g in range(4):
                for e in range(4):
                    byte = c[blk + (g * big_r + r) * 4 + e]
                    assert byte & 0x0F == u[row, 32 * b + 8 * g + e] & 0x0F
                    assert byte >> 4 == u[row, 32 * b + 8 * g + 4 + e] & 0x0F
            if spec.bits == 6:
                for p in range(2):
                    for e in range(4):
                        byte = c[blk + 16 * big_r + (p * big_r + r) * 4 + e]
                        for q in range(4):
                            assert (byte >> (2 * q)) & 3 == u[row, 32 * b + 16 * p + 4 * q + e] >> 4
        d = un.d.view(torch.int16).numpy().view(np.uint8).reshape(n, -1)
        nd = d.shape[1] // 2
        mbase = t0 * row_m
        for s in range(nd):
            assert m[mbase + 2 * (s * big_r + r)] == d[row, 2 * s]
            assert m[mbase + 2 * (s * big_r + r) + 1] == d[row, 2 * s + 1]
        if un.sc is not None:
            sc = un.sc.view(torch.uint8).numpy()
            start = mbase + nd * big_r * 2 * (2 if spec.has_min else 1)
            for j in range(sc.shape[1]):
                assert m[start + j * big_r + r] == sc[row, j]


# SmolLM2-135M's projections: K = 576 (18 blocks, not whole super-blocks: legacy types only) and K = 1536
SIZES = [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q5_0", 576, 1536), ("Q6_K", 200, 1536),
         ("Q4_K", 200, 1536)]  # fmt: skip


@pytest.mark.parametrize(("kind", "n", "k"), SIZES)
def test_kernel_at_model_sizes(kernel, kind, n, k):
    spec = kblocks.KINDS[kind.lower()]
    raw = random_blocks(kind, n, k, 11)
    un = gguf_blocks.unpack(kind, torch.from_numpy(raw), k)
    codes, meta = kblocks.pack(spec, un)
    want_w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    got_w = getattr(kernel, f"{kind.lower()}_dequantize")(codes, meta).numpy()
    assert np.array_equal(got_w.view(np.int32), np.ascontiguousarray(want_w, dtype=np.float32).view(np.int32))
    scale = un.scales().repeat_interleave(un.group, -1).abs()
    mins = un.mins()
    mins = 0 if mins is None else mins.abs().repeat_interleave(un.group, -1)
    mags = scale * (un.u.float() + un.off) + mins
    g = torch.Generator().manual_seed(n)
    for m in (1, 7):  # decode, and a small batch: 4 rows per pass plus the 2 and 1 left
        x = torch.randn(m, k, generator=g)
        before = kernel.calls()
        got = getattr(kernel, f"{kind.lower()}_matmul")(x, codes, meta)
        assert kernel.calls() == before + 1
        want = kblocks.reference_matmul(x, spec, codes, meta)
        bound = TOL * (x.abs() @ mags.T) + 1e-30
        assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()

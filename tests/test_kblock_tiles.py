"""The K-block kernel's tile layout (quant/kblocks.py::pack) holds each byte where its docstring says, and the
kernel (csrc/kblock_tiles.h) computes at the real model's sizes (SmolLM2's 576 x 1536 projections: many tiles,
a partial last one) through the tile path of each build, bit for bit gguf's dequantizer and within float
rounding of the naive reference (kblocks.reference_matmul)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from forwardpass.quant import gguf_blocks, kblocks  # noqa: E402
from tests import test_gguf_blocks  # noqa: E402
from tests.test_gguf_blocks import TOL, random_blocks  # noqa: E402

kernel = test_gguf_blocks.kernel  # the fixture: each build this CPU runs, skipped where none builds


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q8_0"])
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
            for v in range(8 if spec.bits == 8 else 0):  # 8-bit codes as they are: field v, elements 4v ..
                for e in range(4):
                    assert c[blk + (v * big_r + r) * 4 + e] == u[row, 32 * b + 4 * v + e]
            for g in range(4 if spec.bits < 8 else 0):
                for e in range(4):
                    byte = c[blk + (g * big_r + r) * 4 + e]
                    assert byte & 0x0F == u[row, 32 * b + 8 * g + e] & 0x0F
                    assert byte >> 4 == u[row, 32 * b + 8 * g + 4 + e] & 0x0F
            if spec.bits == 5:
                for e in range(4):
                    byte = c[blk + 16 * big_r + r * 4 + e]
                    for j in range(8):
                        assert (byte >> j) & 1 == u[row, 32 * b + 4 * j + e] >> 4
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
                if spec.pack6:  # low 4 bits of scale and min in one byte, the high 2 bits of each after them
                    mc = un.mc.view(torch.uint8).numpy()
                    assert m[start + j * big_r + r] == (sc[row, j] & 15) | (mc[row, j] & 15) << 4
                    at = start + sc.shape[1] * big_r + (j // 8 * big_r + r) * 4 + j % 8 // 2
                    hi = m[at] >> (4 * (j % 2))
                    assert (hi & 3, (hi >> 2) & 3) == (sc[row, j] >> 4, mc[row, j] >> 4)
                else:
                    assert m[start + j * big_r + r] == sc[row, j]


# SmolLM2-135M's projections: K = 576 (18 blocks, not whole super-blocks: legacy types only) and K = 1536
SIZES = [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q5_0", 576, 1536), ("Q5_0", 1536, 576),
         ("Q5_1", 200, 576), ("Q6_K", 200, 1536), ("Q4_K", 200, 1536), ("Q5_K", 200, 1536)]  # fmt: skip


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


def _mags(un) -> torch.Tensor:
    """|scale · (u - off)| + |min| per weight, bounding each weight's share of the float rounding."""
    scale = un.scales().repeat_interleave(un.group, -1).abs()
    mins = un.mins()
    mins = 0 if mins is None else mins.abs().repeat_interleave(un.group, -1)
    return scale * (un.u.float() + un.off) + mins


# merged projections whose parts a file stores in different types: SmolLM2 Q4_K_M's q/k/v where attn_v is
# Q8_0, and a Q4_K q/k beside a Q6_K v (row counts not multiples of 16: every part has its own partial tile)
STACKS = [([("Q5_0", 576), ("Q5_0", 192), ("Q8_0", 192)], 576), ([("Q4_K", 200), ("Q6_K", 40)], 1536),
          ([("Q5_K", 24), ("Q8_0", 37), ("Q5_K", 16)], 256)]  # fmt: skip


@pytest.mark.parametrize(("parts", "k"), STACKS)
def test_stack_of_kinds(kernel, parts, k):
    raws = [random_blocks(kind, n, k, 13 + i) for i, (kind, n) in enumerate(parts)]
    uns = [gguf_blocks.unpack(kind, torch.from_numpy(r), k) for (kind, _), r in zip(parts, raws)]
    codes, meta = kblocks.pack_stack([(kblocks.KINDS[kind.lower()], un) for (kind, _), un in zip(parts, uns)])
    stacked = kblocks.stack_parts(codes, meta)
    assert len(stacked) == len(parts) - (parts[0][0] == parts[1][0])  # neighbours of one kind: one part
    # each part at its file's bits per weight: the same bytes as the file, plus the header
    assert codes.numel() + meta.numel() == sum(r.nbytes for r in raws) + 8 * (1 + 3 * len(stacked))
    want_w = np.concatenate([gguf.quants.dequantize(r, gguf.GGMLQuantizationType[kind])
                             for (kind, _), r in zip(parts, raws)])  # fmt: skip
    got_w = torch.cat([getattr(kernel, f"{kind.name}_dequantize")(c, m) for kind, c, m in stacked]).numpy()
    assert np.array_equal(got_w.view(np.int32), np.ascontiguousarray(want_w, dtype=np.float32).view(np.int32))
    mags = torch.cat([_mags(un) for un in uns])
    g = torch.Generator().manual_seed(k)
    for m in (1, 5):
        x = torch.randn(m, k, generator=g)
        before = kernel.calls()
        got = kernel.stack_matmul(x, codes, meta)
        assert kernel.calls() == before + len(stacked)  # each part through its kind's tile kernel
        want = torch.cat([kblocks.reference_matmul(x, kind, c, mt) for kind, c, mt in stacked], dim=-1)
        bound = TOL * (x.abs() @ mags.T) + 1e-30
        assert got.shape == (m, sum(n for _, n in parts))
        assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()


def test_stack_weight_computes_on_the_kernel():
    """``KBlockStack`` (what the loader makes of a mixed q/k/v): the host's kernel build multiplies it
    (counted), its values are the file's, and large batches take the dequantized rows' GEMM (or, without bf16
    hardware, each part the AVX2 build's GEMM mode; with VNNI but no AMX, the VNNI build's tile passes)."""
    from forwardpass.quant.kblock_weight import KERNEL_TAKES_ALL, KBlockStack
    from forwardpass.quant.kernel import load_kblock_kernel

    module = load_kblock_kernel()
    if module is None:
        pytest.skip("the K-block kernel cannot be built here")
    parts, k = STACKS[0]
    raws = [random_blocks(kind, n, k, 3 + i) for i, (kind, n) in enumerate(parts)]
    uns = [gguf_blocks.unpack(kind, torch.from_numpy(r), k) for (kind, _), r in zip(parts, raws)]
    kinds = [kblocks.KINDS[kind.lower()] for kind, _ in parts]
    w = KBlockStack(*kblocks.pack_stack(list(zip(kinds, uns))))
    assert w.path == f"kernel ({module.isa})" and w.shape == (960, 576) and w.kinds == ["q5_0", "q8_0"]
    want_w = np.concatenate([gguf.quants.dequantize(r, gguf.GGMLQuantizationType[kind])
                             for (kind, _), r in zip(parts, raws)])  # fmt: skip
    assert np.array_equal(w.dequantize().numpy(), want_w)
    x = torch.randn(2, k)
    before = module.calls()
    bound = TOL * (x.abs() @ torch.cat([_mags(un) for un in uns]).T) + 1e-30
    assert ((w.matmul(x) - w._reference_matmul(x)).abs() <= bound).all()
    assert module.calls() == before + 2
    if w.gemm_rows == KERNEL_TAKES_ALL:  # each part in the AVX2 build's GEMM mode (no bf16 hardware) or the
        # VNNI build's tile passes (VNNI, no AMX)
        big = torch.randn(300, k)
        gemm_before = module.gemm_calls()
        bound = TOL * (big.abs() @ torch.cat([_mags(un) for un in uns]).T) + 1e-30
        assert ((w.matmul(big) - w._reference_matmul(big)).abs() <= bound).all()
        assert module.calls() == before + 4
        assert module.gemm_calls() == gemm_before + (2 if module.has_gemm_mode else 0)
        return
    big = torch.randn(w.gemm_rows, k)
    ref = big @ w.dequantize().T
    rel = 1e-2 if w.bf16_gemm else 1e-5
    assert ((w.matmul(big) - ref).abs() <= rel * (big.abs() @ w.dequantize().abs().T) + 1e-6).all()
    assert module.calls() == before + 2

"""GGUF weight types: our PyTorch unpacking and dequantization (quant/gguf_blocks.py) bit for bit
``gguf.quants.dequantize`` on random blocks with edge values (fp16 scale extremes and subnormals, all-zero
blocks, maximal codes); the repacked compute format (quant/kblocks.py) loses nothing; the K-block kernel
(csrc/kblock_matmul.cpp) dequantizes bit for bit and multiplies within float rounding of the reference, in its
AVX2 build and (where the CPU has it) its AVX-512 VNNI build, and ``KBlockWeight`` says which of them ran."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from forwardpass.kernel_build import cpu_flags  # noqa: E402
from forwardpass.quant import gguf_blocks, kblocks  # noqa: E402
from forwardpass.quant.gguf_blocks import BLOCK_TYPES  # noqa: E402
from forwardpass.quant.kernel import AVX512_CPU_FLAGS, kblock_kernel_for  # noqa: E402

QUANTIZED = [t for t in BLOCK_TYPES if t not in gguf_blocks.FLOAT_TYPES]
KBLOCK = [t for t in QUANTIZED if t.lower() in kblocks.KINDS]
#: byte offsets of each type's fp16 fields (d, dmin) in its block
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}  # fmt: skip
#: fp16 max / -max, smallest subnormal +/-, smallest normal, +0, -0, 1.0, largest subnormal
EDGE_F16 = [0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x0000, 0x8000, 0x3C00, 0x03FF]
ISAS = ["avx2"] + (["avx512vnni"] if AVX512_CPU_FLAGS <= cpu_flags() else [])


def random_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random bytes as ``rows`` rows of ``k`` weights of ``kind`` (every bit pattern is a valid block), fp16
    fields finite with 15% edge values; block 0 all zero, the last block of row 1 all ones (maximal codes,
    fp16 max)."""
    size, nbytes = BLOCK_TYPES[kind]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, k // size, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        h = raw[..., off : off + 2].copy().view(np.uint16)[..., 0]
        h = np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h)  # no inf / nan
        h = np.where(g.random(h.shape) < 0.15, g.choice(EDGE_F16, size=h.shape), h).astype(np.uint16)
        raw[..., off : off + 2] = h[..., None].view(np.uint8).reshape(*h.shape, 2)
    raw[0, 0] = 0
    raw[1, -1, :] = 0xFF
    for off in F16_FIELDS[kind]:
        raw[1, -1, off : off + 2] = np.array([0x7BFF], np.uint16).view(np.uint8)
    return raw.reshape(rows, -1)


def _bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantization_is_bitwise_ggufs(kind, seed):
    k = 512
    raw = random_blocks(kind, 7, k, seed)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(_bits(gguf_blocks.dequantize(kind, torch.from_numpy(raw), k)), _bits(want))


@pytest.mark.parametrize("kind", gguf_blocks.FLOAT_TYPES)
def test_float_types_read_exactly(kind):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 64, generator=g) * torch.logspace(-30, 30, 64)  # fp16 overflows to inf, bf16 does not
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
    raw = w.to(dtype).contiguous().view(torch.uint8).view(5, -1)
    np_raw = raw.numpy().view(np.float32 if kind == "F32" else np.float16 if kind == "F16" else np.uint8)
    if kind == "BF16":
        want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.BF16)
    else:
        want = np_raw.astype(np.float32)
    assert np.array_equal(_bits(gguf_blocks.dequantize(kind, raw, 64)), _bits(want))


@pytest.mark.parametrize("kind", KBLOCK)
def test_repacking_loses_nothing(kind):
    k = 512
    raw = random_blocks(kind, 9, k, 3)
    spec = kblocks.KINDS[kind.lower()]
    codes, meta = kblocks.pack(spec, gguf_blocks.unpack(kind, torch.from_numpy(raw), k))
    assert codes.dtype == meta.dtype == torch.uint8 and meta.shape[1] == spec.meta_bytes(k)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(_bits(kblocks.dequantize(spec, codes, meta)), _bits(want))
    # what a matmul reads per weight: the file's own size, but for Q2_K / Q3_K (2- and 3-bit codes in 4 bits,
    # int8 scale factors)
    stored = BLOCK_TYPES[kind][1] * 8 / BLOCK_TYPES[kind][0]
    extra = {"Q2_K": 2.5, "Q3_K": 1.13}.get(kind, 0.0)
    assert stored <= spec.bits_per_weight(k) <= stored + extra


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0"])
def test_symmetric_blocks_become_q8_0_exactly(kind):
    """A Q5_0 q/k beside a Q8_0 v (llama.cpp's Q4_K_M) is merged as Q8_0: the same values bit for bit."""
    raw = random_blocks(kind, 9, 256, 8)
    q8 = gguf_blocks.to_q8_0(kind, torch.from_numpy(raw), 256).numpy()
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(_bits(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)), _bits(want))


@pytest.fixture(scope="module", params=ISAS)
def kernel(request):
    try:
        module = kblock_kernel_for(request.param).load(logging.getLogger(__name__))
    except Exception as e:  # no compiler here: the reference path is what runs (said in the log)
        pytest.skip(f"the K-block kernel ({request.param}) cannot be built here: {e}")
    assert module.isa == request.param
    return module


@pytest.mark.parametrize("kind", KBLOCK)
def test_kernel_dequantizes_bitwise(kernel, kind):
    k = 512 if "K" in kind[1:] else 160
    raw = random_blocks(kind, 21, k, 4)
    spec = kblocks.KINDS[kind.lower()]
    codes, meta = kblocks.pack(spec, gguf_blocks.unpack(kind, torch.from_numpy(raw), k))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    got = getattr(kernel, f"{kind.lower()}_dequantize")(codes, meta)
    assert np.array_equal(_bits(got), _bits(want))
    bf16 = getattr(kernel, f"{kind.lower()}_dequantize_bf16")(codes, meta)
    assert torch.equal(bf16, torch.from_numpy(want).to(torch.bfloat16))


# |kernel - reference| <= TOL · Σ |terms|: the kernel sums exact integer dot products per block in another
# order and folds mins and code offsets into the activations' block sums, so its float rounding is bounded
# relative to the magnitudes it adds (the activations times |scale · (u - off)| + |min| per weight), not to
# the result
TOL = 2e-6


@pytest.mark.parametrize("kind", KBLOCK)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_kernel_matmul_equals_reference(kernel, kind, m):
    g = torch.Generator().manual_seed(m)
    for k in [256, 512, 1536] if "K" in kind[1:] else [32, 96, 160, 576]:  # whole quads of blocks and tails
        raw = random_blocks(kind, 37, k, m)
        spec = kblocks.KINDS[kind.lower()]
        un = gguf_blocks.unpack(kind, torch.from_numpy(raw), k)
        codes, meta = kblocks.pack(spec, un)
        x = torch.randn(m, k, generator=g)
        x[0, :32] = 0  # a zero activation block
        before = kernel.calls()
        got = getattr(kernel, f"{kind.lower()}_matmul")(x, codes, meta)
        assert kernel.calls() == before + 1
        want = kblocks.reference_matmul(x, spec, codes, meta)
        scale = un.scales().repeat_interleave(un.group, -1).abs()
        mins = un.mins()
        mags = scale * (un.u.float() + un.off) + (
            0 if mins is None else mins.abs().repeat_interleave(un.group, -1)
        )
        bound = TOL * (x.abs() @ mags.T) + 1e-30
        assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()


def _off_and_on(matmul, args, set_min_rows, calls, on_from: int):
    """``matmul(*args)`` with a kernel mode off (its minimum row count 0) and on from ``on_from`` rows,
    asserting by the mode's call counter that the second call took it; the setting is restored."""
    before = set_min_rows(0)
    try:
        off = matmul(*args)
        set_min_rows(on_from)
        n = calls()
        on = matmul(*args)
        assert calls() == n + 1  # the mode ran
    finally:
        set_min_rows(before)
    return off, on


@pytest.mark.parametrize("kind", KBLOCK)
def test_amx_sums_are_the_vnni_loops_bit_for_bit(kernel, kind):
    """9-31 activation rows take AMX tiles where the CPU has them (kblock_amx.h): the same integer sums and
    the same float steps as the VNNI loop, so the same outputs bit for bit — 16-row passes and a remainder,
    tiles of fewer than 16 weight rows, rounds of blocks cut short by a row's end."""
    if not getattr(kernel, "has_amx", False):
        pytest.skip(f"no AMX-INT8 on this CPU (or in the {kernel.isa} build)")
    g = torch.Generator().manual_seed(3)
    spec = kblocks.KINDS[kind.lower()]
    for k in [256, 512] if "K" in kind[1:] else [96, 160, 576]:
        raw = torch.from_numpy(random_blocks(kind, 37, k, 5))
        codes, meta = kblocks.pack(spec, gguf_blocks.unpack(kind, raw, k))
        matmul = getattr(kernel, f"{kind.lower()}_matmul")
        for m in (9, 16, 17, 31):
            x = torch.randn(m, k, generator=g)
            vnni, amx = _off_and_on(matmul, (x, codes, meta), kernel.set_amx_min_rows, kernel.amx_calls, 2)
            assert torch.equal(amx, vnni), (k, m, (amx - vnni).abs().max())


def _one_row_outputs(kernel, kind: str, n: int, k: int, seed: int, rows: int, g: torch.Generator):
    """A random ``kind`` matrix ``[n, k]`` packed for the kernel, ``rows`` random activation rows and each
    row's one-row kernel call: ``(matmul, codes, meta, x, alone)``."""
    spec = kblocks.KINDS[kind.lower()]
    raw = torch.from_numpy(random_blocks(kind, n, k, seed))
    codes, meta = kblocks.pack(spec, gguf_blocks.unpack(kind, raw, k))
    matmul = getattr(kernel, f"{kind.lower()}_matmul")
    x = torch.randn(rows, k, generator=g)
    alone = torch.cat([matmul(x[i : i + 1], codes, meta) for i in range(rows)])
    return matmul, codes, meta, x, alone


@pytest.mark.parametrize("kind", KBLOCK)
def test_rows_are_computed_alone_whatever_rows_pass_a_tile_together(kernel, kind):
    """Each activation row's output is bitwise the one-row call's, with 4 or (AVX-512) 8 rows passing a weight
    tile together and a tile's last rows in one pass of however many are left (1-7): what a speculative verify
    step (1 + k rows) relies on to round as one-row decoding."""
    k = 512 if "K" in kind[1:] else 160
    g = torch.Generator().manual_seed(4)
    matmul, codes, meta, x, alone = _one_row_outputs(kernel, kind, 37, k, 6, 13, g)
    amx_before = kernel.set_amx_min_rows(0)
    per_pass = kernel.set_rows_per_pass(8)
    try:
        for rows_per_pass in sorted({4, min(8, kernel.max_rows_per_pass)}):
            kernel.set_rows_per_pass(rows_per_pass)
            for m in (2, 3, 5, 6, 7, 8, 9, 13):  # whole passes and every remainder
                assert torch.equal(matmul(x[:m], codes, meta), alone[:m]), (rows_per_pass, m)
    finally:
        kernel.set_rows_per_pass(per_pass)
        kernel.set_amx_min_rows(amx_before)
    assert kernel.isa != "avx512vnni" or kernel.max_rows_per_pass == 8


@pytest.mark.parametrize("kind", KBLOCK)
def test_tile_passes_over_chunks_of_rows_are_the_one_row_calls(kernel, kind):
    """Batches of more than one chunk of rows (256: prefill on the VNNI build, which takes every batch where
    the CPU has no AMX) pass each tile chunk by chunk: every row bitwise its one-row call's, for a remainder
    of 1 row, of 44 and two whole chunks; counted as tile passes (not the AVX2 GEMM mode, not AMX)."""
    k = 256 if "K" in kind[1:] else 96
    g = torch.Generator().manual_seed(8)
    matmul, codes, meta, x, alone = _one_row_outputs(kernel, kind, 21, k, 9, 512, g)
    amx_before, gemm_before = kernel.set_amx_min_rows(0), kernel.set_gemm_min_rows(0)
    try:
        for m in (257, 300, 512):
            calls, gemm_calls, amx_calls = kernel.calls(), kernel.gemm_calls(), kernel.amx_calls()
            assert torch.equal(matmul(x[:m], codes, meta), alone[:m]), m
            counts = (kernel.calls(), kernel.gemm_calls(), kernel.amx_calls())
            assert counts == (calls + 1, gemm_calls, amx_calls)
    finally:
        kernel.set_amx_min_rows(amx_before)
        kernel.set_gemm_min_rows(gemm_before)


@pytest.mark.parametrize("kind", KBLOCK)
def test_gemm_mode_rows_are_bitwise_the_tile_passes(kernel, kind):
    """The AVX2 build's GEMM mode (csrc/kblock_gemm_avx2.h: a tile unpacked once, 4 activation rows at a time)
    gives bitwise the tile passes' outputs (2 rows a pass) for every row count: the same exact integer sums
    and float steps, so the kernel stays batch-invariant — tiles of fewer than 16 rows (a half of 8 or fewer),
    a remainder of 1-3 rows, more rows than one chunk (256), and the calls counted as taken."""
    if not kernel.has_gemm_mode:
        pytest.skip(f"the {kernel.isa} build has no GEMM mode (its passes take 8 rows)")
    g = torch.Generator().manual_seed(7)
    spec = kblocks.KINDS[kind.lower()]
    matmul = getattr(kernel, f"{kind.lower()}_matmul")
    for k in [256, 512] if "K" in kind[1:] else [96, 576]:
        for n in (37, 16, 5):
            raw = torch.from_numpy(random_blocks(kind, n, k, n))
            codes, meta = kblocks.pack(spec, gguf_blocks.unpack(kind, raw, k))
            for m in (3, 4, 5, 6, 7, 16, 17, 300):
                x = torch.randn(m, k, generator=g)
                x[0, :32] = 0
                passes, gemm = _off_and_on(matmul, (x, codes, meta), kernel.set_gemm_min_rows,
                                           kernel.gemm_calls, 3)
                assert torch.equal(gemm, passes), (k, n, m, (gemm - passes).abs().max())


def test_weight_reports_its_path_and_computes_large_batches():
    """``KBlockWeight`` on the host's build: decode-sized batches through the kernel (counted), prefill-sized
    ones through the dequantized rows and a float GEMM (bf16 where the CPU has bf16 hardware) or, on CPUs
    without bf16 hardware, the AVX2 build's GEMM mode (counted) and on CPUs with VNNI but no AMX the VNNI
    build's tile passes (counted), all close to fp32."""
    from forwardpass.quant.kblock_weight import KERNEL_TAKES_ALL, KBlockWeight
    from forwardpass.quant.kernel import load_kblock_kernel

    module = load_kblock_kernel()
    if module is None:
        pytest.skip("the K-block kernel cannot be built here")
    raw = torch.from_numpy(random_blocks("Q4_K", 64, 512, 5))
    spec = kblocks.KINDS["q4_k"]
    w = KBlockWeight(spec, *kblocks.pack(spec, gguf_blocks.unpack("Q4_K", raw, 512)))
    assert w.path == f"kernel ({module.isa})" and w.shape == (64, 512)
    x = torch.randn(3, 512)
    before = module.calls()
    small = w.matmul(x)
    assert module.calls() == before + 1
    torch.testing.assert_close(
        small, kblocks.reference_matmul(x, spec, w.codes, w.meta), rtol=1e-4, atol=1e-3
    )
    if w.gemm_rows == KERNEL_TAKES_ALL:  # the kernel takes every batch: the AVX2 build's GEMM mode (no bf16
        # hardware) or the VNNI build's tile passes (VNNI, no AMX)
        big = torch.randn(300, 512)
        gemm_before = module.gemm_calls()
        out = w.matmul(big)
        assert module.calls() == before + 2
        assert module.gemm_calls() == gemm_before + (1 if module.has_gemm_mode else 0)
        # within the kernel's float rounding of the reference, relative to the magnitudes it adds (as in
        # test_kernel_matmul_equals_reference)
        un = gguf_blocks.unpack("Q4_K", raw, 512)
        mags = un.scales().repeat_interleave(un.group, -1).abs() * (un.u.float() + un.off) + (
            un.mins().abs().repeat_interleave(un.group, -1))
        err = (out - kblocks.reference_matmul(big, spec, w.codes, w.meta)).abs()
        assert (err <= TOL * (big.abs() @ mags.T) + 1e-30).all()
    else:
        big = torch.randn(w.gemm_rows + 5, 512)
        out = w.matmul(big)
        assert module.calls() == before + 1  # not the kernel: the GEMM on dequantized rows
        ref = big @ w.dequantize().T
        rel = 1e-2 if w.bf16_gemm else 1e-5  # bf16 rounds both operands
        assert ((out - ref).abs() <= rel * (big.abs() @ w.dequantize().abs().T) + 1e-6).all()
    assert torch.equal(w.rows(torch.tensor([3, 0])), w.dequantize()[[3, 0]])


def test_forced_avx2_build_is_the_one_that_runs():
    """``FORWARDPASS_QUANT_ISA=avx2`` (an AVX2-only machine's build, on any host): a KBlockWeight made in that
    process multiplies with the AVX2 build, and its result equals the reference."""
    code = (
        "import torch; from forwardpass.quant import kblocks, gguf_blocks;"
        "from forwardpass.quant.kblock_weight import KBlockWeight;"
        "from tests.test_gguf_blocks import random_blocks;"
        "raw = torch.from_numpy(random_blocks('Q6_K', 16, 256, 6)); s = kblocks.KINDS['q6_k'];"
        "w = KBlockWeight(s, *kblocks.pack(s, gguf_blocks.unpack('Q6_K', raw, 256)));"
        "x = torch.randn(2, 256); y = w.matmul(x); r = kblocks.reference_matmul(x, s, w.codes, w.meta);"
        "print(w.path, w._kernel.calls(), float(((y - r).abs().max() / r.abs().max())))"
    )
    env = {**os.environ, "FORWARDPASS_QUANT_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    path, calls, rel = out.stdout.split("\n")[-2].rsplit(" ", 2)
    assert path == "kernel (avx2)" and int(calls) == 1 and float(rel) < 1e-5

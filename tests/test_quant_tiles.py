"""The tile layout of quantized weights (forwardpass/quant/tiles.py, csrc/tile_layout.h): the same bytes
reordered 16 rows at a time, converted both ways exactly, and multiplied by both builds' kernels
(csrc/tiles.h, tiles_avx2.h) with the VNNI GEMM's float operations."""

import logging

import pytest
import torch

from forwardpass.kernel_build import cpu_flags
from forwardpass.quant import formats, reference
from forwardpass.quant.kernel import AVX512_CPU_FLAGS, gemm_path, kernel_for, load_quant_kernel
from forwardpass.quant.tiles import from_tiles, tile_rows, to_tiles
from forwardpass.quant.weight import QuantizedWeight
from tests.helpers.isa import builds

FORMATS = ["q8_0", "q4_0"]
# rows: under one tile, one tile, a tile and a short one, several; K: padded blocks (33, 70, 1000) and whole
# ones
SHAPES = [(1, 32), (15, 70), (16, 64), (17, 33), (37, 256), (130, 1000)]


def _quantized(n, k, fmt, seed=0):
    return formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1, fmt)


@pytest.fixture(scope="module")
def vnni_kernel():
    kernel = load_quant_kernel()
    if kernel is None or kernel.isa != "avx512vnni":
        pytest.skip("the tile GEMM is in the AVX-512 VNNI build; this CPU runs the AVX2 one")
    return kernel


@pytest.fixture(scope="module", params=builds("avx512vnni", AVX512_CPU_FLAGS))
def tile_kernel(request):
    """Each build this CPU runs (an AVX-512 VNNI CPU runs both)."""
    try:
        return kernel_for(request.param).load(logging.getLogger(__name__))
    except Exception as exc:  # noqa: BLE001 - no compiler: the reference path is what runs
        pytest.skip(f"the {request.param} build cannot be made here: {exc}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_converts_both_ways_exactly(fmt):
    for n, k in SHAPES:
        qs, d = _quantized(n, k, fmt)
        tq, td = to_tiles(qs, d, fmt)
        assert tq.shape == qs.shape and td.shape == d.shape and tq.dtype == qs.dtype
        back_q, back_d = from_tiles(tq, td, fmt)
        assert torch.equal(back_q, qs) and torch.equal(back_d, d)
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])  # the short last tile, repeats
        rq, rd = tile_rows(tq, td, fmt, ids)
        assert torch.equal(rq, qs[ids]) and torch.equal(rd, d[ids])
    stacked_q, stacked_d = _quantized(3 * 37, 64, fmt)  # an MoE layer's experts: each matrix on its own
    stacked_q, stacked_d = stacked_q.view(3, 37, -1), stacked_d.view(3, 37, -1)
    tq, td = to_tiles(stacked_q, stacked_d, fmt)
    assert torch.equal(tq[1], to_tiles(stacked_q[1], stacked_d[1], fmt)[0])
    assert all(map(torch.equal, from_tiles(tq, td, fmt), (stacked_q, stacked_d)))


def test_layout_puts_each_value_where_the_kernel_reads_it():
    """The offsets csrc/tiles.h documents: row r, k = 32b + c of a tile of R rows."""
    n, k = 20, 64  # a full tile (rows 0-15) and a short one (R = 4)
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    qs = (torch.arange(n * k) % 251 - 125).to(torch.int8).view(n, k)  # distinct enough to find each value
    d = torch.arange(n * 2, dtype=torch.float16).view(n, 2)
    tq, td = to_tiles(qs, d, "q8_0")
    for row, kk in [(0, 0), (5, 37), (15, 63), (16, 1), (19, 62)]:
        start, rows = (0, 16) if row < 16 else (16, 4)
        r, b, c = row - start, kk // 32, kk % 32
        assert tq[start:].flatten()[((b * 8 + c // 4) * rows + r) * 4 + c % 4] == qs[row, kk]
        assert td[start:].flatten()[b * rows + r] == d[row, b]
    # Q4_0: the byte of group c // 8 holds the 4-bit codes of c (low nibble) and c + 4 (high), c % 8 < 4
    q4, d4 = formats.quantize(w * 0.001 - 0.5, "q4_0")
    codes = formats.dequantize(q4, torch.ones_like(d4), "q4_0").round().to(torch.int32) + 8  # [n, k] in 0..15
    t4, _ = to_tiles(q4, d4, "q4_0")
    for row, kk in [(0, 0), (7, 44), (17, 3)]:
        start, rows = (0, 16) if row < 16 else (16, 4)
        r, b, c = row - start, kk // 32, kk % 32
        byte = int(t4[start:].flatten()[((b * 4 + c // 8) * rows + r) * 4 + c % 4])
        low_k = 32 * b + c // 8 * 8 + c % 4  # the group's first 4 k are low nibbles, its last 4 high
        assert (byte & 15, byte >> 4) == (codes[row, low_k], codes[row, low_k + 4])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33, 64])
def test_tile_kernels_are_the_gemms_float_operations(tile_kernel, fmt, m):
    """Small-batch kernel (both builds) and GEMM (VNNI build) on the tile layout: bitwise the GEMM's reference
    (blocks in sequence), so also bitwise each other, whatever the batch size or the CPU."""
    g = torch.Generator().manual_seed(m)
    for n, k in SHAPES:
        qs, d = _quantized(n, k, fmt, seed=n)
        # the extreme value too: a GGUF file may hold -128, which our quantizer never writes
        if fmt == "q8_0":
            qs.view(-1)[::7] = -128
        tq, td = to_tiles(qs, d, fmt)
        x = torch.randn(m, k, generator=g)
        want = reference.quant_gemm_exact(x, qs, d, fmt)
        assert torch.equal(getattr(tile_kernel, f"{fmt}_matmul_tiles")(x, tq, td), want)
        if tile_kernel.isa == "avx512vnni":
            assert torch.equal(getattr(tile_kernel, f"{fmt}_gemm_tiles")(x, tq, td), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tile_weights_dequantize_to_the_same_floats(tile_kernel, fmt):
    """What large batches multiply on CPUs without the VNNI GEMM: the tile layout's weights as fp32 (bitwise
    formats.dequantize) and bf16 (torch's rounding of those)."""
    for n, k in SHAPES:
        qs, d = _quantized(n, k, fmt, seed=n + 1)
        tq, td = to_tiles(qs, d, fmt)
        want = formats.dequantize(qs, d, fmt, k)
        assert torch.equal(getattr(tile_kernel, f"{fmt}_dequantize_tiles")(tq, td, k), want)
        assert torch.equal(getattr(tile_kernel, f"{fmt}_dequantize_tiles_bf16")(tq, td, k), want.bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_weight_holds_tiles_where_our_kernels_multiply_it(fmt):
    w = torch.randn(37, 70, generator=torch.Generator().manual_seed(1)) * 0.1
    qw = QuantizedWeight.from_float(w, fmt)
    qs, d = formats.quantize(w, fmt)
    path = gemm_path(cpu_flags())  # the tile layout wherever our kernels do every batch size's work
    avx2_tiles = qw._kernel is not None and qw._kernel.isa == "avx2" and path != "amx"
    assert qw.tiles == (qw._kernel is not None and (path == "vnni" or avx2_tiles))
    assert all(map(torch.equal, qw.gguf_layout(), (qs, d)))
    assert torch.equal(qw.dequantize(), formats.dequantize(qs, d, fmt, 70))
    ids = torch.tensor([[36, 3], [16, 16]])
    assert torch.equal(qw.rows(ids), formats.dequantize(qs, d, fmt, 70)[ids])
    isa = getattr(qw._kernel, "isa", "avx2")
    exact = reference.quant_gemm_exact if qw.tiles else reference.exact_for(isa)
    for m in (1, 3, 40):  # the small-batch kernel, and (the VNNI build) its GEMM from gemm_rows on
        x = torch.randn(m, 70, generator=torch.Generator().manual_seed(m))
        got = qw.matmul(x)
        # else the reference or a float GEMM
        if qw._kernel is not None and (qw._vnni is not None or m < qw.gemm_rows):
            assert torch.equal(got, exact(x, qs, d, fmt))
        want = reference.quant_matmul(x, qs, d, fmt)  # (a bf16 GEMM, on CPUs that take one, rounds more)
        assert (got - want).norm() < 1e-2 * want.norm()
    assert not QuantizedWeight.from_float(w, fmt, kernel=False).tiles  # the reference reads the GGUF layout


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_request_reads_the_same_alone_or_among_forty(vnni_kernel, checkpoint_factory, quantization,
                                                       monkeypatch):
    """On the tile layout the small-batch kernel and the GEMM make the same float operations, so a request's
    tokens and log-probabilities do not depend on how many others share its steps (the GEMM made to take 32+
    rows here, so that the 40-sequence steps cross over)."""
    from forwardpass import LLM, SamplingParams
    from forwardpass.quant import weight as weight_module
    from tests.helpers.checkpoints import random_prompts

    monkeypatch.setattr(weight_module, "TILES_GEMM_ROWS", 32)

    llm = LLM(checkpoint_factory("qwen3"), quantization=quantization, num_kv_blocks=256, block_size=16,
              cpu_kernels=True, enable_prefix_caching=False, max_num_seqs=40)  # fmt: skip
    weights = [w for w in llm.engine.model.modules() if isinstance(w, QuantizedWeight)]
    if not all(w.tiles for w in weights):
        pytest.skip("this CPU's large batches take another GEMM (AMX, oneDNN): no tile layout")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = random_prompts(40, [5, 17, 33])

    def read(out):
        return out.outputs[0].token_ids, out.outputs[0].logprobs

    alone = read(llm.generate([prompts[7]], params, use_tqdm=False)[0])
    among = read(llm.generate(prompts, params, use_tqdm=False)[7])  # steps of 40+ rows: the GEMM
    assert alone == among


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_avx2_build_multiplies_every_batch_with_its_tile_kernel(fmt, monkeypatch):
    """Where a CPU has AVX2 and no bf16 hardware, the tile kernel outruns dequantizing for oneDNN's fp32 GEMM
    at every batch size, so prefill chunks take it too, a piece of AVX2_TILES_PIECE rows at a time: the same
    float operations for every row count, so a row's result does not depend on the batch it is in."""
    from forwardpass.quant import weight as weight_module

    try:
        avx2 = kernel_for("avx2").load(logging.getLogger(__name__))
    except Exception as exc:  # noqa: BLE001 - no compiler: nothing to test
        pytest.skip(f"the avx2 build cannot be made here: {exc}")
    monkeypatch.setattr(weight_module, "load_quant_kernel", lambda: avx2)
    monkeypatch.setenv("FORWARDPASS_QUANT_ISA", "avx2")  # as on a CPU without AVX-512 VNNI ...
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "avx2")  # ... nor bf16 hardware
    monkeypatch.setattr(weight_module, "AVX2_TILES_PIECE", 32)  # so that 100 rows are four pieces
    w = torch.randn(37, 70, generator=torch.Generator().manual_seed(2)) * 0.1
    qw = QuantizedWeight.from_float(w, fmt)
    assert qw.tiles and qw._kernel_takes_all and qw.gemm_rows == 33
    qs, d = formats.quantize(w, fmt)
    x = torch.randn(100, 70, generator=torch.Generator().manual_seed(3))
    got = qw.matmul(x)
    assert torch.equal(got, reference.quant_gemm_exact(x, qs, d, fmt))
    assert torch.equal(got[40:43], qw.matmul(x[40:43]))  # the same rows alone
    assert torch.equal(qw.matmul(x.view(4, 25, 70)).view(100, -1), got)  # 3-D input: the same path
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "bf16")  # bf16 hardware: its GEMM keeps large batches
    assert not QuantizedWeight.from_float(w, fmt)._kernel_takes_all
    # asked for: dequantize + fp32 GEMM, transformers' math
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "fp32")
    assert not QuantizedWeight.from_float(w, fmt)._kernel_takes_all

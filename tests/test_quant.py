"""Weight-only quantization: block formats vs ggml's reference quantizers, the AVX2 kernel vs its PyTorch
reference, quantized models vs the same model computing with the reference, and the quality bounds on the
embedded model's held-out text (teacher-forced top-1 agreement and perplexity vs float32)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forwardpass.config import EngineConfig
from forwardpass.errors import ConfigError
from forwardpass.kernel_build import cpu_flags
from forwardpass.quant import formats, reference
from forwardpass.quant import weight as weight_module
from forwardpass.quant.kernel import AMX_CPU_FLAGS, gemm_path, load_amx_kernel, load_quant_kernel
from forwardpass.quant.weight import QuantizedWeight
from tests.helpers.plans import quantized_model

FORMATS = ["q8_0", "q4_0"]


@pytest.fixture(scope="module")
def kernel():
    k = load_quant_kernel()
    if k is None:
        pytest.skip("the C++ quantized-matmul kernel cannot be built here (the reference path is used)")
    return k


# ----- formats ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizers_match_ggml_bytes(fmt):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = torch.randn(24, 160, generator=torch.Generator().manual_seed(1)) * 0.05
    w[3, :32] = 0  # an all-zero block: scale 0, values 0
    w[5, 7] = 1.5  # an outlier that sets its block's scale
    qs, d = formats.quantize(w, fmt)
    kind = GGMLQuantizationType.Q8_0 if fmt == "q8_0" else GGMLQuantizationType.Q4_0
    ref = torch.from_numpy(gguf_quants.quantize(w.numpy(), kind)).reshape(24, 5, -1)  # GGUF blocks: d, values
    assert torch.equal(ref[..., :2].contiguous().view(torch.float16).squeeze(-1), d)
    assert torch.equal(ref[..., 2:].reshape(24, -1), qs.view(torch.uint8))


# error per weight, in units of its block's absmax: q8_0 half a step of amax/127 plus the fp16 rounding of the
# scale (|q| · d · 2^-11 ≤ 0.062 of a step); q4_0 up to one step of amax/8 (the clamp at +7 on the side
# opposite the block's extreme value)
@pytest.mark.parametrize("fmt,bound", [("q8_0", 0.57 / 127), ("q4_0", 1.01 / 8)])
def test_dequantized_error_is_bounded(fmt, bound):
    w = torch.randn(16, 70, generator=torch.Generator().manual_seed(2))  # K = 70: padded to 96
    qs, d = formats.quantize(w, fmt)
    back = formats.dequantize(qs, d, fmt, 70)
    amax = torch.nn.functional.pad(w, (0, 26)).reshape(16, 3, 32).abs().amax(-1, keepdim=True)
    limit = amax.expand(16, 3, 32).reshape(16, 96)[:, :70] * bound
    assert ((back - w).abs() <= limit).all()


def test_block_scales_beat_per_channel():
    """Why int8 uses blocks of 32: on the embedded model's weights the error is much lower than with one
    scale per output channel, for 6% more bytes."""
    from forwardpass.assets import default_llm_path
    from forwardpass.models.loading import load_model

    model, _ = load_model(default_llm_path())
    block_err = channel_err = 0.0
    for name, p in model.named_parameters():
        if p.dim() != 2 or "proj" not in name:
            continue
        block_err += (
            (formats.dequantize(*formats.quantize_q8_0(p), "q8_0", p.shape[1]) - p).pow(2).sum().item()
        )
        scale = p.abs().amax(dim=1, keepdim=True) / 127
        channel_err += ((p / scale).round().clamp(-127, 127) * scale - p).pow(2).sum().item()
    assert block_err < 0.7 * channel_err, (block_err, channel_err)


# ----- kernel == reference ------------------------------------------------------------------------
def test_activation_quantization_is_bitwise_the_reference(kernel):
    x = torch.randn(9, 77, generator=torch.Generator().manual_seed(3)) * 3
    x[2] = 0  # zero rows: scale 0
    x[4, :32] = torch.linspace(-1, 1, 32) * 127 / 2  # exact halves: round half to even
    q, d = kernel.quantize_activations(x)
    rq, rd = reference.quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33, 64])
def test_kernel_equals_reference(kernel, fmt, m):
    g = torch.Generator().manual_seed(m)
    for n, k in [(1, 32), (37, 70), (64, 256), (19, 1000), (130, 33)]:  # K = 70, 1000, 33: padded blocks
        w = torch.randn(n, k, generator=g) * 0.1
        x = torch.randn(m, k, generator=g)
        qs, d = formats.quantize(w, fmt)
        fn = kernel.q8_0_matmul if fmt == "q8_0" else kernel.q4_0_matmul
        got, want = fn(x, qs, d), reference.quant_matmul(x, qs, d, fmt)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(k))
        # the kernel's float operations, bitwise (the AVX-512 build keeps two blocks per register)
        assert torch.equal(got, reference.exact_for(kernel.isa)(x, qs, d, fmt))
        # and close to the fp32 product (the quantization error itself, loosely)
        assert (got - x @ w.T).abs().max() < (0.1 if fmt == "q8_0" else 0.6) * math.sqrt(k) / 10


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_dequantization_is_torchs_rounding(kernel, fmt):
    """The bf16 weights a large GEMM multiplies on bf16 hardware: the fp32 dequantization rounded to nearest
    even, bit for bit, including a padded last block."""
    for n, k in [(37, 70), (130, 33), (64, 256)]:
        qs, d = formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.1, fmt)
        got = getattr(kernel, f"{fmt}_dequantize_bf16")(qs, d, k)
        assert torch.equal(got.view(torch.int16),
                           formats.dequantize(qs, d, fmt, k).bfloat16().view(torch.int16))


def test_gemm_path_follows_the_cpu(monkeypatch):
    """Large quantized matmuls multiply in bf16 only where the CPU has bf16 hardware (elsewhere torch emulates
    it, hundreds of times slower than fp32), on our AMX kernel where it has AMX; the environment variable
    wins, except that it cannot send a CPU without AMX to the AMX kernel."""
    monkeypatch.delenv("FORWARDPASS_QUANT_GEMM", raising=False)
    monkeypatch.delenv("FORWARDPASS_QUANT_ISA", raising=False)  # (which would override the flags given here)
    sapphire_rapids = frozenset({"avx2", "fma"} | AMX_CPU_FLAGS)
    assert gemm_path(sapphire_rapids) == "amx"
    # AMX without AVX-512 BF16: oneDNN
    assert gemm_path(frozenset({"avx2", "amx_bf16", "amx_tile"})) == "bf16"
    assert gemm_path(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "bf16"  # AVX512-BF16 without VNNI
    zen4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"})
    assert gemm_path(zen4) == "vnni"  # the int8 GEMM beats oneDNN's bf16 one there
    monkeypatch.setenv("FORWARDPASS_QUANT_ISA", "avx2")  # the AVX2 build has no GEMM
    assert gemm_path(zen4) == "bf16"
    monkeypatch.delenv("FORWARDPASS_QUANT_ISA")
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "vnni")
    assert gemm_path(sapphire_rapids - {"avx512_vnni"}) == "amx"  # not without the instructions
    monkeypatch.delenv("FORWARDPASS_QUANT_GEMM")
    zen3 = frozenset({"avx2", "fma", "f16c"})
    assert gemm_path(zen3) == "avx2"  # no bf16 hardware, no VNNI: the AVX2 tile kernel takes every batch
    assert gemm_path(frozenset({"avx2", "fma", "avx512f"})) == "avx2"
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "fp32")  # dequantize + fp32 GEMM: asked for, on every CPU
    assert gemm_path(sapphire_rapids) == "fp32" and gemm_path(zen3) == "fp32"
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "avx2")
    # the VNNI build is the one this CPU runs: its GEMM, not the AVX2 kernel's
    assert gemm_path(zen4) == "vnni"
    monkeypatch.setenv("FORWARDPASS_QUANT_ISA", "avx2")
    assert gemm_path(zen4) == "avx2"
    monkeypatch.delenv("FORWARDPASS_QUANT_ISA")
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "bf16")
    assert gemm_path(sapphire_rapids) == "bf16" and gemm_path(frozenset()) == "bf16"
    assert QuantizedWeight.from_float(torch.randn(4, 32), "q8_0").gemm_rows == weight_module.BF16_GEMM_ROWS
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "amx")
    assert gemm_path(frozenset({"avx2", "fma", "avx512f"})) == "avx2"


def test_cpu_isa_avx2_reports_an_avx2_only_cpu(monkeypatch):
    """``FORWARDPASS_CPU_ISA=avx2`` (how the suite runs on an AVX-512 host for the AVX2-only machines CI may
    land on): the detected flags lose every AVX-512 and AMX flag, so every choice made from them is an AVX2
    CPU's."""
    from forwardpass.quant.kernel import host_isa

    monkeypatch.delenv("FORWARDPASS_QUANT_GEMM", raising=False)
    monkeypatch.delenv("FORWARDPASS_QUANT_ISA", raising=False)
    real = cpu_flags()  # (already AVX2-only where the whole suite runs so)
    try:
        with monkeypatch.context() as m:
            m.setenv("FORWARDPASS_CPU_ISA", "avx2")
            cpu_flags.cache_clear()
            emulated = cpu_flags()
            assert {f for f in real if not f.startswith(("avx512", "amx"))} == emulated
            assert host_isa() == "avx2" and gemm_path(emulated) == "avx2"  # no VNNI, no bf16 hardware left
    finally:
        cpu_flags.cache_clear()  # the flags as the process's environment says, for the tests after this one
    assert cpu_flags() == real


HAS_AMX = gemm_path(cpu_flags()) == "amx"
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 tiles")
HAS_VNNI_GEMM = gemm_path(cpu_flags()) in ("amx", "vnni") and "avx512_vnni" in cpu_flags()


@pytest.mark.skipif(not HAS_VNNI_GEMM, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("fmt", FORMATS)
def test_vnni_gemm_equals_reference(kernel, fmt):
    """The GEMM for many rows (weights in the tile layout, quant/tiles.py) computes the matvec kernel's math
    (the same int8 activations, exact block sums, float32 scales) with the float additions block after block:
    bitwise the reference written that way, close to the plain reference. Shapes: rows not a multiple of the
    4-row blocks and beyond one 256-row pass, columns not a multiple of the 32-column panels or the 16-row
    tiles, K with a padded last block."""
    from forwardpass.quant.tiles import to_tiles

    assert kernel.isa == "avx512vnni"
    g = torch.Generator().manual_seed(11)
    for m, n, k in [(1, 5, 32), (3, 33, 70), (17, 100, 1024), (64, 64, 256), (300, 40, 33), (5, 1000, 96)]:
        w, x = torch.randn(n, k, generator=g) * 0.1, torch.randn(m, k, generator=g)
        qs, d = formats.quantize(w, fmt)
        got = getattr(kernel, f"{fmt}_gemm_tiles")(x, *to_tiles(qs, d, fmt))
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert torch.equal(got, reference.quant_gemm_exact(x, qs, d, fmt))
        torch.testing.assert_close(got, reference.quant_matmul(x, qs, d, fmt), rtol=1e-5,
                                   atol=1e-5 * math.sqrt(k))


@needs_amx
@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_kernel_equals_bf16_reference(fmt):
    """The AMX kernel multiplies exactly the bf16 GEMM path's operands (weights dequantized and rounded to
    bf16, activations rounded to bf16) with fp32 accumulation: equal to that product in float64 up to the
    order of the fp32 additions. Shapes: rows not a multiple of the 16-row tiles or the 32-row groups, columns
    not a multiple of the 32-row weight panels, K with a padded last block, a panel split across threads."""
    amx = load_amx_kernel()
    assert amx is not None, "this CPU has AMX but the kernel did not build"
    g = torch.Generator().manual_seed(7)
    for m, n, k in [(16, 32, 32), (17, 37, 70), (33, 130, 33), (64, 1000, 512), (100, 300, 1536), (1, 5, 64)]:
        w, x = torch.randn(n, k, generator=g) * 0.1, torch.randn(m, k, generator=g)
        qs, d = formats.quantize(w, fmt)
        got = getattr(amx, f"{fmt}_matmul")(x, qs, d)
        want = x.bfloat16().double() @ formats.dequantize(qs, d, fmt, k).bfloat16().double().T
        assert got.shape == (m, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * math.sqrt(k))


def test_quantized_weight_stacks_and_bias():
    w = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(4))
    qw = QuantizedWeight.from_float(w, "q8_0")
    x = torch.randn(5, 64)
    assert qw.shape == (3, 40, 64) and qw[1].shape == (40, 64)
    bias = torch.randn(40)
    want = reference.quant_matmul(x, *formats.quantize(w[1], "q8_0"), "q8_0") + bias
    torch.testing.assert_close(qw[1].matmul(x, bias), want, rtol=1e-5, atol=1e-4)


# ----- models -------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Model-level tests check numbers, not speed: one thread keeps them fast on a loaded machine (2 OpenMP
    threads waiting on each other at every barrier ran a tiny forward 20× slower there). Each output of
    the kernel is computed by one thread in a fixed order, so the results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        t = torch.tensor(ids)
        return model.compute_logits(model(t, torch.arange(len(t))))


def _embedded(quantization: str | None, kernel_path: bool = True):
    from forwardpass.assets import default_llm_path
    from forwardpass.models.loading import load_model

    if quantization is None:
        return load_model(default_llm_path())[0]
    return quantized_model(default_llm_path(), quantization, kernel=kernel_path)


# bf16 only on bf16 hardware, the AMX kernel only with AMX
HAS_BF16_HARDWARE = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
#: the large-batch paths this CPU can take (fp32 everywhere; bf16 only on bf16 hardware, which others emulate)
GEMM_KINDS = (["fp32"] + (["bf16"] if HAS_BF16_HARDWARE else []) + (["amx"] if HAS_AMX else [])
              + (["vnni"] if gemm_path(cpu_flags()) == "vnni" else [])
              + (["avx2"] if gemm_path(cpu_flags()) == "avx2" else []))


@pytest.mark.parametrize("gemm", GEMM_KINDS)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_equals_reference_model(kernel, quantization, gemm, monkeypatch, one_thread):
    """Same weights, same math: the kernel model and the model computing every quantized matmul with the
    bitwise reference give identical logits (a rounding difference would not stay small: it flips an
    activation's int8 value in the next layer); the dequantized-matmul fallback agrees closely. Large
    batches multiply the dequantized weights in fp32, or in bf16 on bf16 hardware: both models alike, except
    that the reference model has no AMX kernel: it multiplies the same bf16 operands with oneDNN, whose fp32
    additions come in another order (close, not equal)."""
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", gemm)
    # tile-layout weights take their GEMM from 1024 rows; from 32 here, so both paths run at these lengths
    # (and the AVX2 tile kernel, which takes every batch, its pieces of 32 rows)
    monkeypatch.setattr(weight_module, "TILES_GEMM_ROWS", 32)
    monkeypatch.setattr(weight_module, "AVX2_TILES_PIECE", 32)
    fast = _embedded(quantization)
    emb = fast.model.embed_tokens
    # tied head: 8 bits in both modes
    assert isinstance(emb.weight, QuantizedWeight) and emb.weight.fmt == "q8_0"
    down = fast.model.layers[0].mlp.down_proj.weight
    assert down.fmt == ("q8_0" if quantization == "int8" else "q4_0")
    assert down.bf16_gemm == (gemm in ("bf16", "amx"))
    assert (down._amx is not None) == (gemm == "amx") and (down._vnni is not None) == (gemm == "vnni")
    assert not any(p.dim() == 2 and "proj" in n for n, p in fast.named_parameters())  # no fp32 copy left
    rows = down.gemm_rows  # short: the int8 kernel; long: the dequantized GEMM
    short, long = list(range(5, 5 + 3 * (rows - 8), 3)), list(range(5, 5 + 3 * (rows + 17), 3))
    a, b = _logits(fast, short), _logits(fast, long)
    ref = _embedded(quantization, kernel_path=False)
    assert (a.argmax(-1) == _logits(ref, short).argmax(-1)).float().mean() > 0.95
    # the reference model: long batches in the kernel's operations too
    if gemm == "vnni" or down._kernel_takes_all:
        with monkeypatch.context() as m:
            m.setattr(weight_module, "GEMM_ROWS", 1 << 30)
            m.setattr(reference, "quant_matmul", reference.quant_gemm_exact)
            assert torch.equal(b, _logits(ref, long))
    elif gemm == "amx":
        ref_b = _logits(ref, long)
        assert (b - ref_b).norm() < 1e-2 * ref_b.norm() and (b.argmax(-1) == ref_b.argmax(-1)).all()
    else:
        assert torch.equal(b, _logits(ref, long))
    monkeypatch.setattr(reference, "quant_matmul", reference.exact_for(load_quant_kernel().isa, down.tiles))
    assert torch.equal(a, _logits(ref, short))
    few = short[:3]  # a decode-sized batch
    assert torch.equal(_logits(fast, few), _logits(ref, few))


def _heldout_ids(n_tokens: int) -> list[int]:
    from forwardpass.assets import default_llm_path
    from forwardpass.loader.tokenizer import Tokenizer

    root = Path(default_llm_path())
    text = (root.parents[0] / "data" / "austen_heldout.txt").read_text()
    return Tokenizer.from_dir(root).encode(text)[:n_tokens]


def _score(model, ids: list[int], window: int = 256) -> tuple[torch.Tensor, float]:
    """Teacher-forced top-1 predictions and the summed NLL over non-overlapping windows."""
    preds, nll = [], 0.0
    for s in range(0, len(ids) - 1, window):
        chunk = ids[s : s + window + 1]
        logits = _logits(model, chunk[:-1]).float()
        logp = torch.log_softmax(logits, -1)
        nll -= logp[torch.arange(len(chunk) - 1), torch.tensor(chunk[1:])].sum().item()
        preds.append(logits.argmax(-1))
    return torch.cat(preds), nll


@pytest.fixture(scope="module")
def fp32_scores():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = _heldout_ids(3073)
        return ids, _score(_embedded(None), ids)
    finally:
        torch.set_num_threads(before)


# the fp32 GEMM multiplies the dequantized weights exactly; the bf16 one also rounds weights and activations
QUALITY_CASES = [("int8", "kernel", 0.97, 0.01), ("int4", "kernel", None, 0.05)] + [
    (q, f"gemm-{kind}", agree, rise)
    for kind in ("bf16", "amx", "vnni") if kind in GEMM_KINDS
    for q, agree, rise in [("int8", 0.97, 0.01), ("int4", None, 0.05)]
]


@pytest.mark.parametrize("quantization,path,min_agree,max_ppl_rise", QUALITY_CASES)
def test_quality_on_heldout_text(
    kernel, fp32_scores, one_thread, monkeypatch, quantization, path, min_agree, max_ppl_rise
):
    """The issue's bounds on the decode math (every row through the int8 kernel, activations quantized too)
    and on the prefill math (256-row windows through the dequantized GEMM, in bf16 on bf16 hardware: by
    oneDNN, or on AMX tiles by our kernel)."""
    if path == "kernel":
        monkeypatch.setattr(weight_module, "GEMM_ROWS", 1 << 30)
        monkeypatch.setattr(weight_module, "BF16_GEMM_ROWS", 1 << 30)
        monkeypatch.setattr(weight_module, "AMX_ROWS", 1 << 30)
        monkeypatch.setattr(weight_module, "TILES_GEMM_ROWS", 1 << 30)
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", path.removeprefix("gemm-") if path != "kernel" else "fp32")
    ids, (ref_pred, ref_nll) = fp32_scores
    pred, nll = _score(_embedded(quantization), ids)
    n = len(ids) - 1
    agree = (pred == ref_pred).float().mean().item()
    ppl_rise = math.exp((nll - ref_nll) / n) - 1
    print(
        f"{quantization} ({path}): top-1 agreement {agree:.4f}, perplexity {math.exp(ref_nll / n):.3f} → "
        f"{math.exp(nll / n):.3f} ({ppl_rise:+.2%})"
    )
    if min_agree is not None:
        assert agree >= min_agree
    assert ppl_rise <= max_ppl_rise


def test_moe_experts_quantize(tmp_path, monkeypatch, one_thread):
    from forwardpass.layers.moe import ExpertWeights
    from forwardpass.models.loading import load_model
    from tests.helpers.moe_checkpoints import make_moe_checkpoint

    ckpt = make_moe_checkpoint(tmp_path / "moe", "qwen3_moe_k2_norm")
    model = quantized_model(ckpt, "int8")
    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    assert experts and all(isinstance(m.gate_up_proj, QuantizedWeight) for m in experts)
    ids = list(range(3, 15))  # fewer rows than any GEMM threshold: the int8 kernel
    got = _logits(model, ids)
    want = _logits(load_model(ckpt)[0], ids)
    # near the float model: 13% here (a random tiny MoE flips some expert choices; a dense random model of
    # the same shape: 4%, the trained embedded model: 0.6%); a wrong expert layout gives ~100%
    assert (got - want).norm() < 0.2 * want.norm()
    tiles = experts[0].gate_up_proj.tiles
    monkeypatch.setattr(reference, "quant_matmul", reference.exact_for(load_quant_kernel().isa, tiles))
    assert torch.equal(got, _logits(quantized_model(ckpt, "int8", kernel=False), ids))


def test_build_follows_the_cpu(monkeypatch):
    """The AVX-512 VNNI build only on a CPU that has every flag it is compiled with; AVX2 otherwise."""
    from forwardpass.quant import kernel as kernel_module

    monkeypatch.delenv("FORWARDPASS_QUANT_ISA", raising=False)
    vnni = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
    monkeypatch.setattr(kernel_module, "cpu_flags", lambda: vnni)
    assert kernel_module.host_isa() == "avx512vnni"
    monkeypatch.setattr(kernel_module, "cpu_flags", lambda: vnni - {"avx512_vnni"})
    assert kernel_module.host_isa() == "avx2"
    monkeypatch.setenv("FORWARDPASS_QUANT_ISA", "avx2")
    monkeypatch.setattr(kernel_module, "cpu_flags", lambda: vnni)
    assert kernel_module.host_isa() == "avx2"
    builds = {kernel_module.kernel_for(isa).build_name for isa in ("avx2", "avx512vnni")}
    assert len(builds) == 2  # each build has its own folder: a cache shared by two hosts never mixes them


# ----- API and flags ------------------------------------------------------------------------------
def test_unknown_quantization_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown quantization 'int3'; use int8 or int4"):
        EngineConfig(quantization="int3")
    with pytest.raises(ConfigError, match="float32"):
        EngineConfig(quantization="int8", dtype="bfloat16")
    out = subprocess.run(
        [sys.executable, "-m", "forwardpass.cli", "generate", "--quantization", "int3", "hi"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "invalid choice: 'int3'" in out.stderr


def test_llm_generates_with_int8(kernel, one_thread):
    from forwardpass import LLM
    from forwardpass.sampling.params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["It is a truth universally acknowledged", "Mr. Darcy"]
    # cpu_kernels=False: this test is about the weights; it must not wait on the attention kernel's build
    llm = LLM(None, quantization="int8", max_num_seqs=4, cpu_kernels=False)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone and all(len(t) == 8 for t in batched)


def test_lora_adapters_apply_on_a_quantized_base(checkpoint_factory, tmp_path):
    """The adapter slot adds its update to whatever computed the base output: with int8 weights, the
    adapter's effect on the prompt's log-probabilities is the fp32 engine's, up to int8 rounding."""
    pytest.importorskip("peft")
    from forwardpass import LLM, LoRARequest, SamplingParams
    from tests.test_lora import make_adapter

    base = checkpoint_factory("qwen3")
    make_adapter(base, tmp_path / "lora", 8, 16, False, 1)
    lora = LoRARequest("a", 1, str(tmp_path / "lora"))
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = list(range(5, 45))

    def logprobs(llm, request):
        out = llm.generate([prompt], sp, lora_request=request, use_tqdm=False)[0].prompt_logprobs[1:]
        return torch.tensor([d[t].logprob for d, t in zip(out, prompt[1:])])

    kw = {"enable_lora": True, "max_lora_rank": 8, "cpu_kernels": False}
    fp, q = LLM(base, **kw), LLM(base, quantization="int8", **kw)
    fp_lora, q_lora, q_base = logprobs(fp, lora), logprobs(q, lora), logprobs(q, None)
    effect = (q_lora - q_base).abs().mean()
    print(f"adapter effect {effect:.4f}, int8 vs fp32 with the adapter {(q_lora - fp_lora).abs().mean():.4f}")
    assert (q_lora - fp_lora).abs().mean() < 0.1 * effect


def test_step_cost_counts_quantized_bytes():
    """The engine's achieved-GB/s accounting reads the weights' real width: an int8 engine's decode step
    moves ~34/32 bytes per layer weight (int4: 18/32), not 4 (the LM head stays 8-bit in both modes)."""
    from forwardpass.config import EngineConfig
    from forwardpass.engine.builder import _weight_bytes
    from forwardpass.engine.scheduling.cost import StepCostModel
    from forwardpass.models.model_spec import ModelSpec

    spec = ModelSpec.from_config({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                  "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                                  "vocab_size": 4096,
                                     "tie_word_embeddings": True})  # fmt: skip
    fp32 = StepCostModel(spec, 4)
    body = spec.params - spec.embedding_params - spec.lm_head_params
    head = spec.vocab * spec.hidden
    kv = fp32.step([(10, 1)], 1)[1] - (4 * body + 4 * head)
    for quantization, per_weight in (("int8", 34 / 32), ("int4", 18 / 32)):
        model = StepCostModel(spec, 4, *_weight_bytes(EngineConfig(quantization=quantization)))
        want = per_weight * body + 34 / 32 * head + kv
        assert model.step([(10, 1)], 1)[1] == pytest.approx(want)

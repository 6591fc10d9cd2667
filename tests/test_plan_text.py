"""The execution plan in words (forwardpass/commands/plan_text.py): serve's banner and generate / chat
--verbose say each layer kind's weight format and what multiplies it (a Q4_1 file is not "float32"), the
kernels with their instruction sets, the KV cache's dtype and the threads."""

from __future__ import annotations

from forwardpass.cli import main
from forwardpass.commands.plan_text import kernels_line, plan_lines, weights_line

# described_plan() of SmolLM2's Q4_1 file on an AVX2 host, as the engine reports it
SMOLLM2 = {
    "device": "cpu", "dtype": "float32", "checkpoint_format": "gguf", "kv_cache_dtype": "float16",
    "decode_kernel": True, "fused_ops": True, "small_matmul": True, "decode_stack": True,
    "batch_invariant": False, "huge_pages": True, "isa": {"small_matmul": "avx2", "quant_matmul": "avx2",
                                                          "quant_gemm": "avx2"},
    "env": {"FORWARDPASS_QUANT_ISA": "avx2"},
    "loaded_weights": {"projections": "GGUF Q4_1 via the K-block kernel (avx2, int8 activations)",
                       "lm_head": "GGUF Q8_0 via the K-block kernel (avx2) (the tied embedding)"},
}


def test_the_plan_names_formats_kernels_isa_kv_dtype_and_threads():
    weights = weights_line(SMOLLM2)
    assert weights.startswith("projections: GGUF Q4_1 via the K-block kernel (avx2")
    assert "lm head: GGUF Q8_0" in weights and weights.endswith("KV cache float16")
    assert "float32" not in weights
    kernels = kernels_line(SMOLLM2, 2)
    assert "paged-decode attention with the fused per-layer ops and the decode stack" in kernels
    assert "small-batch fp32 matmul (avx2)" in kernels and "quantized matmul (avx2" in kernels
    assert kernels.endswith("2 threads, 2 MB pages, FORWARDPASS_QUANT_ISA=avx2")
    bare = {"kv_cache_dtype": "float32", "isa": {}, "env": {}}
    assert kernels_line(bare, 1) == "PyTorch only (no compiled kernel); 1 thread"
    assert [line.split()[0] for line in plan_lines(SMOLLM2, 2)] == ["weights", "kernels"]


def test_generate_verbose_says_the_plan(capsys):
    assert main(["generate", "Hi", "--max-tokens", "1", "--seed", "0", "--verbose", "--threads", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    head = next(i for i, line in enumerate(err) if line.startswith("forwardpass: the embedded model: "))
    assert "computing in float32 on cpu" in err[head]
    weights = err[head + 1]
    assert weights.startswith("  weights     projections: fp32 via ") and "KV cache float32" in weights
    assert err[head + 2].startswith("  kernels     ") and "1 thread" in err[head + 2]

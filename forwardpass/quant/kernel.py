"""Builds and loads the quantized-matmul kernel (``csrc/quant_matmul.cpp``) for this CPU: an AVX-512 VNNI
build where the CPU has it (decode batches use ``vpdpbusd``, two blocks per instruction), else AVX2.

Compiled with torch's cpp_extension (a C++ compiler and ninja; ~40 s once, then cached in
``$TORCH_EXTENSIONS_DIR`` / ``~/.cache/torch_extensions``), the same way as the paged-decode kernel
(``forwardpass/attention/cpu_kernel.py``). Quantizing a model loads it first and waits, so an engine
never swaps kernels mid-run: a model computes either with the kernel or, when it cannot be built (no
compiler, not x86-64 with AVX2) or ``FORWARDPASS_QUANT_KERNEL=0``, with the PyTorch reference
(``reference.py``, same math, much slower), which is said once in the log.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from forwardpass.kernel_build import CppKernel, cpu_flags, pick_isa

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.cpp"
# no -ffast-math: the activation quantization must round exactly like the reference's float ops.
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
# VNNI's vpdpbusd does 64 int8 products per instruction (AVX2: 32 in three): chosen when this CPU has it
AVX512_FLAGS = (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
AVX512_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def kernel_for(isa: str) -> CppKernel:
    """The build of the kernel for ``isa`` ("avx2" or "avx512vnni"); each has its own build folder."""
    return CppKernel(
        f"forwardpass_quant_matmul_{isa}", SOURCE, cflags=AVX512_FLAGS if isa == "avx512vnni" else AVX2_FLAGS,
        ldflags=("-fopenmp",), what=f"the C++ quantized-matmul kernel ({isa})", expected_s=40,
    )  # fmt: skip


def host_isa() -> str:
    """The best instruction set this CPU runs (``FORWARDPASS_QUANT_ISA=avx2`` forces the AVX2 build)."""
    return pick_isa("FORWARDPASS_QUANT_ISA", "avx512vnni", AVX512_CPU_FLAGS, cpu_flags())


def bf16_gemm_default(flags: frozenset[str]) -> bool:
    """Whether large quantized matmuls dequantize to bf16 (not fp32) for the GEMM: where the CPU multiplies bf16
    in hardware (AMX tiles or AVX512-BF16 dot products; measured on a Sapphire Rapids core at 128-512 rows: bf16
    ~3x fp32 GFLOP/s). Elsewhere bf16 GEMMs are emulated and far slower than fp32 (an AVX2 CPU: ~300x).
    ``FORWARDPASS_QUANT_GEMM=fp32`` / ``bf16`` overrides."""
    forced = os.environ.get("FORWARDPASS_QUANT_GEMM")
    if forced in ("fp32", "bf16"):
        return forced == "bf16"
    return bool({"amx_bf16", "avx512_bf16"} & flags)


KERNEL = kernel_for(host_isa())
_module = None
_failed = False


def load_quant_kernel():
    """The compiled module (``q8_0_matmul``, ``q4_0_matmul``, ``quantize_activations``), or None."""
    global _module, _failed
    if _module is not None or _failed or os.environ.get("FORWARDPASS_QUANT_KERNEL", "1") == "0":
        return _module
    try:
        _module = KERNEL.load(logger)
    except Exception as exc:  # noqa: BLE001 - compiler or headers missing, no AVX2, ...: fall back, loudly once
        _failed = True
        logger.warning(
            "C++ quantized-matmul kernel unavailable (%s); using the PyTorch reference (slow)", exc
        )
    return _module


if __name__ == "__main__":  # build ahead of time: python -m forwardpass.quant.kernel
    print("built" if load_quant_kernel() is not None else "not built")

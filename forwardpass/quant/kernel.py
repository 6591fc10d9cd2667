"""Builds and loads the quantized-matmul kernels for this CPU: ``csrc/quant_matmul.cpp`` (small batches; an
AVX-512 VNNI build where the CPU has it, ``vpdpbusd`` two blocks per instruction, else AVX2; the VNNI build
also has the GEMM for many rows, ``csrc/vnni_gemm.h``) and, on CPUs with AMX, ``csrc/amx_matmul.cpp`` (batches
of 16+ rows on the bf16 tile unit).

Compiled with torch's cpp_extension (a C++ compiler and ninja; ~40 s once, then cached in
``$TORCH_EXTENSIONS_DIR`` / ``~/.cache/torch_extensions``), the same way as the paged-decode kernel
(``forwardpass/attention/cpu_kernel.py``). Quantizing a model loads it first and waits, so an engine
never swaps kernels mid-run: a model computes either with the kernel or, when it cannot be built (no
compiler, not x86-64 with AVX2) or ``FORWARDPASS_QUANT_KERNEL=0``, with the PyTorch reference
(``reference.py``, same math, much slower), which is said once in the log.
"""

from __future__ import annotations

import logging
from pathlib import Path

from forwardpass import envs
from forwardpass.kernel_build import SHARED_CSRC, TORCH_EXT, CppKernel, KernelLoader, cpu_flags, pick_isa

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.cpp"
# the weight layout and its argument checks, shared by both kernels
HEADER = SOURCE.with_name("block_weights.h")
# the activations' int8 quantization, shared with the K-block kernel
ACT_HEADER = SOURCE.with_name("activations.h")
GEMM_HEADER = SOURCE.with_name("vnni_gemm.h")  # the VNNI build's GEMM for many rows
# the tile layout of the weights, and the small-batch matmul on it of each build
TILES_HEADERS = tuple(SOURCE.with_name(n) for n in ("tile_layout.h", "tiles.h", "tiles_avx2.h"))
# the AMX kernel's stores
TRANSPOSE_HEADER = SHARED_CSRC / "transpose16.h"
# no -ffast-math: the activation quantization must round exactly like the reference's float ops.
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
# VNNI's vpdpbusd does 64 int8 products per instruction (AVX2: 32 in three): chosen when this CPU has it
AVX512_FLAGS = (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
AVX512_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def kernel_for(isa: str) -> CppKernel:
    """The build of the kernel for ``isa`` ("avx2" or "avx512vnni"); each has its own build folder."""
    return CppKernel(
        f"forwardpass_quant_matmul_{isa}", SOURCE, cflags=AVX512_FLAGS if isa == "avx512vnni" else AVX2_FLAGS,
        ldflags=("-fopenmp",), what=f"the C++ quantized-matmul kernel ({isa})", expected_s=25,
        headers=(TORCH_EXT, HEADER, ACT_HEADER, GEMM_HEADER, *TILES_HEADERS),
    )  # fmt: skip


def host_isa() -> str:
    """The best instruction set this CPU runs (``FORWARDPASS_QUANT_ISA=avx2`` forces the AVX2 build)."""
    return pick_isa("FORWARDPASS_QUANT_ISA", "avx512vnni", AVX512_CPU_FLAGS, cpu_flags())


#: what the AMX kernel is compiled for (tiles, bf16 tiles, AVX-512 with its bf16 conversions)
AMX_CPU_FLAGS = {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"}
AMX_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c", "-mfma", "-mamx-tile",
             "-mamx-bf16", "-fopenmp")  # fmt: skip


def gemm_path(flags: frozenset[str]) -> str:
    """How quantized matmuls of many rows multiply (prefill chunks, large decode batches), from the CPU's
    flags:

    * ``"amx"``: the AMX kernel, weights dequantized to bf16 a panel at a time into L2 and multiplied on the
      tile unit (Intel since Sapphire Rapids);
    * ``"vnni"``: the AVX-512 VNNI GEMM of the quantized-matmul kernel (``csrc/vnni_gemm.h``), int8
      activations times the int8 weights (in the tile layout, quant/tiles.py) copied a panel at a time (AMD
      Zen 4, Intel Ice Lake and others without AMX); measured on a Zen 4 core pair at 32-512 rows: 1.4-2x
      oneDNN's bf16 GEMM on the dequantized weights. The K-block kinds (Q4_1, Q5_x, K-quants) take the K-block
      kernel's VNNI tile passes at every batch there (``quant/kblock_weight.py``);
    * ``"bf16"``: the weights dequantized to bf16 in memory and oneDNN's bf16 GEMM, where the CPU multiplies
      bf16 in hardware but has neither of the above; measured on a Sapphire Rapids core at 128-512 rows, bf16
      ~3x fp32 GFLOP/s;
    * ``"avx2"``: the AVX2 build's small-batch kernel on the tile layout takes every batch size, int8
      activations as in decode (quant/weight.py, AVX2_TILES_PIECE), where the CPU has none of the above (AMD
      Zen 2/3);
    * ``"fp32"``: the weights dequantized to fp32 and oneDNN's fp32 GEMM: transformers' math on the same
      weights. Only when asked for (or where the kernel cannot be built): an AVX2 CPU emulates bf16, ~300x
      slower, and its tile kernel beats this GEMM at every batch size measured.

    ``FORWARDPASS_QUANT_GEMM=amx|vnni|avx2|bf16|fp32`` overrides (``amx``, ``vnni`` and ``avx2`` only where
    the kernel build they name is the one this CPU runs)."""
    forced = envs.get("FORWARDPASS_QUANT_GEMM")
    vnni = pick_isa("FORWARDPASS_QUANT_ISA", "avx512vnni", AVX512_CPU_FLAGS, flags) == "avx512vnni"
    amx = AMX_CPU_FLAGS <= flags
    if (forced in ("bf16", "fp32") or (forced == "amx" and amx) or (forced == "vnni" and vnni)
            or (forced == "avx2" and not vnni)):  # fmt: skip
        return forced
    if amx:
        return "amx"
    if vnni:
        return "vnni"
    return "bf16" if {"amx_bf16", "avx512_bf16"} & flags else "avx2"


AMX_KERNEL = CppKernel(
    "forwardpass_quant_amx", SOURCE.with_name("amx_matmul.cpp"), cflags=AMX_FLAGS, ldflags=("-fopenmp",),
    what="the C++ AMX quantized-matmul kernel", expected_s=30,
    headers=(TORCH_EXT, HEADER, TRANSPOSE_HEADER, SOURCE.with_name("amx_state.h")),
)  # fmt: skip


def _check_amx(module) -> None:
    if not module.available():
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl)")


# a compiler without AMX support, an old Linux, ...: large batches take the dequantize + oneDNN bf16 GEMM
AMX_LOADER = KernelLoader(AMX_KERNEL, "large batches use oneDNN's bf16 GEMM", logger, check=_check_amx)


def load_amx_kernel():
    """The AMX kernel (``q8_0_matmul``, ``q4_0_matmul``: fp32 in and out), or None (not built: the caller
    falls back to the dequantize + oneDNN bf16 GEMM, said once in the log). Only call it where ``gemm_path``
    is amx."""
    return AMX_LOADER.load()


KERNEL = kernel_for(host_isa())
# no compiler, no AVX2, ...: the PyTorch reference, said once in the log
LOADER = KernelLoader(KERNEL, "using the PyTorch reference (slow)", logger, switch="FORWARDPASS_QUANT_KERNEL")


def load_quant_kernel():
    """The compiled module (``q8_0_matmul``, ``q4_0_matmul``, ``quantize_activations``), or None."""
    return LOADER.load()


KBLOCK_SOURCE = SOURCE.with_name("kblock_matmul.cpp")

KBLOCK_HEADERS = ("kblock_tiles.h", "kblock_gemm_avx2.h", "kblock_amx.h", "amx_state.h")  # VNNI / AVX2, AMX


def kblock_kernel_for(isa: str) -> CppKernel:
    """The build of the GGUF K-block kernel (Q4_1, Q5_0, Q5_1, Q2_K..Q6_K; ``kblocks.py``) for ``isa``."""
    return CppKernel(
        f"forwardpass_kblock_matmul_{isa}", KBLOCK_SOURCE,
        # AMX-INT8 for batches of 9-31 rows (kblock_amx.h), only where the CPU has it (checked at run time)
        cflags=(*AVX512_FLAGS, "-mamx-tile", "-mamx-int8") if isa == "avx512vnni" else AVX2_FLAGS,
        ldflags=("-fopenmp",), what=f"the C++ GGUF K-block matmul kernel ({isa})", expected_s=45,
        headers=(TORCH_EXT, HEADER, ACT_HEADER, *(KBLOCK_SOURCE.with_name(h) for h in KBLOCK_HEADERS)),
    )  # fmt: skip


KBLOCK_KERNEL = kblock_kernel_for(host_isa())
KBLOCK_LOADER = KernelLoader(KBLOCK_KERNEL, "using the PyTorch reference (slow)", logger,
                             switch="FORWARDPASS_QUANT_KERNEL")  # fmt: skip


def load_kblock_kernel():
    """The compiled K-block module (``<type>_matmul``, ``<type>_dequantize``, ``calls``), or None."""
    return KBLOCK_LOADER.load()


if __name__ == "__main__":  # build ahead of time: python -m forwardpass.quant.kernel
    print("built" if load_quant_kernel() is not None else "not built")
    print("K-block kernel", "built" if load_kblock_kernel() is not None else "not built")
    if gemm_path(cpu_flags()) == "amx":
        print("AMX kernel", "built" if load_amx_kernel() is not None else "not built")

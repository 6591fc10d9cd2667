"""Builds and loads the AVX2 quantized-matmul kernel (``csrc/quant_matmul.cpp``).

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

from forwardpass.kernel_build import CppKernel

logger = logging.getLogger(__name__)

# no -ffast-math: the activation quantization must round exactly like the reference's float ops.
KERNEL = CppKernel(
    "forwardpass_quant_matmul", Path(__file__).with_name("csrc") / "quant_matmul.cpp",
    cflags=("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"), ldflags=("-fopenmp",),
    what="the C++ quantized-matmul kernel", expected_s=40,
)
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

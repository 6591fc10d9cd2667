"""Builds and loads the small-batch fp32 matmul kernel (``csrc/small_matmul.cpp``) for this CPU.

An AVX-512 build where the CPU has AVX-512F, else AVX2/FMA; compiled with torch's cpp_extension (~20 s
once, then cached), like the other CPU kernels. It is part of the engine's compiled CPU path: an engine
that decided on the paged-decode kernel (``forwardpass/attention/cpu_kernel.py``) loads this one too, at
build time, and its linear layers use it for batches of at most :data:`MAX_ROWS` rows (decode steps);
larger batches (prefill chunks) stay on oneDNN, which is at the compute roof there.
"""

from __future__ import annotations

import logging
from pathlib import Path

from forwardpass.kernel_build import SHARED_CSRC, TORCH_EXT, CppKernel, KernelLoader, cpu_flags, pick_isa

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "small_matmul.cpp"
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
AVX512_FLAGS = (*AVX2_FLAGS, "-mavx512f")


def kernel_for(isa: str) -> CppKernel:
    """The build for ``isa`` ("avx2" or "avx512"); each has its own build folder."""
    return CppKernel(
        f"forwardpass_small_matmul_{isa}", SOURCE, cflags=AVX512_FLAGS if isa == "avx512" else AVX2_FLAGS,
        ldflags=("-fopenmp",), what=f"the C++ small-batch matmul kernel ({isa})", expected_s=20,
        headers=(TORCH_EXT, SHARED_CSRC / "transpose16.h", SOURCE.with_name("half_panels.h")),
    )  # fmt: skip


def host_isa() -> str:
    """``FORWARDPASS_MATMUL_ISA=avx2`` forces the AVX2 build on an AVX-512 CPU."""
    return pick_isa("FORWARDPASS_MATMUL_ISA", "avx512", {"avx512f"}, cpu_flags())


#: Rows up to which the kernel beats oneDNN/MKL (measured with benchmarks/small_matmul.py): the AVX-512
#: build's broadcast kernel for 17-64 rows holds on to 64, the AVX2 build to 32.
MAX_ROWS = 64 if host_isa() == "avx512" else 32

KERNEL = kernel_for(host_isa())  # the build MAX_ROWS is measured for
LOADER = KernelLoader(KERNEL, "using oneDNN/MKL", logger, switch="FORWARDPASS_CPU_KERNEL")
# the loaded module, what LOADER.load() returned: a name of its own because tests hand loaded_kernel() a build
# of their choosing by setting it
_module = None


def load_small_matmul():
    """The compiled ``small_matmul(x, w, bias=None)``, or None (no compiler: the library GEMMs are used)."""
    global _module
    if _module is None:
        _module = LOADER.load()
    return None if _module is None else _module.small_matmul


if __name__ == "__main__":  # build ahead of time: python -m forwardpass.layers.small_matmul
    print("built" if load_small_matmul() is not None else "not built")


def small_matmul_capsule():
    """The loaded kernel's entry point as a PyCapsule, for C++ callers (``attention/csrc/decode_stack.h``)."""
    return None if _module is None else _module.matmul_capsule()


def loaded_kernel():
    """The loaded kernel module (``small_matmul`` and ``panels_view``, for ``layers/packed.py``), or None."""
    return _module

"""Builds and loads the C++ paged-decode kernel (``csrc/paged_decode.cpp``).

Compiled with torch's cpp_extension (a C++ compiler and ninja; ~30 s once, then cached in
``$TORCH_EXTENSIONS_DIR`` / ``~/.cache/torch_extensions``).

An engine decides once, when it is built, whether it uses the kernel (:func:`resolve_decode_kernel`),
and keeps that choice for its lifetime: the kernel and the PyTorch path in ``paged.py`` agree only to
rounding, so swapping one for the other mid-run would let identical greedy requests diverge depending
on wall-clock time. ``cpu_kernels``:

* ``True`` — build now if needed and wait (benchmarks, ``roofline --measure``);
* ``"auto"`` — use the kernel if it is already built; otherwise start the build in a background
  process for later runs and use the PyTorch path. The first decision in a process is remembered,
  so every ``"auto"`` engine of that process computes the same way;
* ``False`` — the PyTorch path. ``FORWARDPASS_CPU_KERNEL=0`` disables the kernel everywhere.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from forwardpass.kernel_build import CppKernel, KernelLoader
from forwardpass.layers import small_matmul

logger = logging.getLogger(__name__)

KERNEL = CppKernel(
    "forwardpass_paged_decode", Path(__file__).with_name("csrc") / "paged_decode.cpp",
    cflags=("-O3", "-mavx2", "-mfma", "-mf16c", "-ffast-math", "-fopenmp"), ldflags=("-fopenmp",),
    what="the C++ paged-decode kernel", expected_s=30,
    headers=(Path(__file__).with_name("csrc") / "decode_stack.h",),
)
SMALL_MATMUL = small_matmul.KERNEL  # built with it, in the background build too
# the whole extension: paged_decode and the fused per-layer ops (rms_norm, qk_norm_rope_); the small-batch
# matmul is loaded with it (None and a log line if it alone cannot be built)
LOADER = KernelLoader(KERNEL, "using the PyTorch path", logger, switch="FORWARDPASS_CPU_KERNEL",
                      check=lambda module: small_matmul.load_small_matmul())  # fmt: skip
_background: subprocess.Popen | None = None


def load_paged_decode(wait: bool = True):
    """The compiled ``paged_decode(q, kv_cache, block_tables, seq_lens, scale, window)``, or None.

    ``wait=False`` returns None at once if the kernel still has to be compiled (and starts that in
    the background); call again later to pick it up.
    """
    return _paged_decode(LOADER.load(ready=None if wait else _built_in_background))


def _built_in_background() -> bool:
    """Whether the kernels are built; if not, whether the background build (started on the first call, in a
    process of its own, so that this one serves on the PyTorch path meanwhile) has finished."""
    global _background
    if KERNEL.is_built() and SMALL_MATMUL.is_built():
        return True
    if _background is None:
        _background = subprocess.Popen(
            [sys.executable, "-m", "forwardpass.attention.cpu_kernel"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
    return _background.poll() is not None


def _paged_decode(module):
    return None if module is None else module.paged_decode


def small_matmul_for(decode_kernel):
    """The small-batch fp32 matmul (``forwardpass/layers/small_matmul.py``) that ships with ``decode_kernel``:
    part of the same compiled CPU path, decided together, kept for the engine's lifetime."""
    return small_matmul.load_small_matmul() if _is_ours(decode_kernel) else None


def fused_ops_for(decode_kernel):
    """The fused per-layer ops that ship with ``decode_kernel`` (None for the PyTorch path): an engine
    that decided on the kernel uses both, for its whole lifetime."""
    return LOADER.module if _is_ours(decode_kernel) else None


def _is_ours(decode_kernel) -> bool:
    return decode_kernel is not None and decode_kernel is _paged_decode(LOADER.module)


_auto_decision: list = []  # the first "auto" decision of this process, remembered


def resolve_decode_kernel(mode: bool | str, device: str, dtype, backend: str):
    """The decode kernel an engine uses for its whole lifetime, or None for the PyTorch path."""
    import torch

    if mode is False or backend != "sdpa" or device != "cpu" or dtype != torch.float32:
        return None
    if mode is True:
        return load_paged_decode(wait=True)
    if mode != "auto":
        raise ValueError(f"cpu_kernels must be True, False or 'auto', got {mode!r}")
    if not _auto_decision:
        _auto_decision.append(load_paged_decode(wait=False))
    return _auto_decision[0]


if __name__ == "__main__":  # the background build
    os.nice(10)
    KERNEL.load(logger)
    SMALL_MATMUL.load(logger)

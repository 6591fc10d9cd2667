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

from forwardpass.kernel_build import CppKernel
from forwardpass.layers.small_matmul import host_isa, kernel_for, load_small_matmul

logger = logging.getLogger(__name__)

KERNEL = CppKernel(
    "forwardpass_paged_decode", Path(__file__).with_name("csrc") / "paged_decode.cpp",
    cflags=("-O3", "-mavx2", "-mfma", "-mf16c", "-ffast-math", "-fopenmp"), ldflags=("-fopenmp",),
    what="the C++ paged-decode kernel", expected_s=30,
    headers=(Path(__file__).with_name("csrc") / "decode_stack.h",),
)
SMALL_MATMUL = kernel_for(host_isa())
_kernel = None
_module = None  # the whole extension: paged_decode and the fused per-layer ops (rms_norm, qk_norm_rope_)
_failed = False
_background: subprocess.Popen | None = None


def load_paged_decode(wait: bool = True):
    """The compiled ``paged_decode(q, kv_cache, block_tables, seq_lens, scale, window)``, or None.

    ``wait=False`` returns None at once if the kernel still has to be compiled (and starts that in
    the background); call again later to pick it up.
    """
    global _kernel, _module, _failed, _background
    if _kernel is not None or _failed or os.environ.get("FORWARDPASS_CPU_KERNEL", "1") == "0":
        return _kernel
    try:
        if not wait and not (KERNEL.is_built() and SMALL_MATMUL.is_built()):
            if _background is None:
                _background = subprocess.Popen(
                    [sys.executable, "-m", "forwardpass.attention.cpu_kernel"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                )
            if _background.poll() is None:
                return None
        _module = KERNEL.load(logger)
        load_small_matmul()  # built and loaded with it (None and a log line if it alone cannot be built)
        _kernel = _module.paged_decode
    except Exception as exc:  # noqa: BLE001 - compiler or headers missing, ...: fall back, loudly once
        _failed = True
        logger.warning("C++ paged-decode kernel unavailable (%s); using the PyTorch path", exc)
    return _kernel


def small_matmul_for(decode_kernel):
    """The small-batch fp32 matmul (``forwardpass/layers/small_matmul.py``) that ships with ``decode_kernel``:
    part of the same compiled CPU path, decided together, kept for the engine's lifetime."""
    return load_small_matmul() if decode_kernel is not None and decode_kernel is _kernel else None


def fused_ops_for(decode_kernel):
    """The fused per-layer ops that ship with ``decode_kernel`` (None for the PyTorch path): an engine
    that decided on the kernel uses both, for its whole lifetime."""
    return _module if decode_kernel is not None and decode_kernel is _kernel else None


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

"""Builds and loads the C++ paged-decode kernel (``csrc/paged_decode.cpp``).

Compiled with torch's cpp_extension (a C++ compiler and ninja; ~30 s once, then cached in
``$TORCH_EXTENSIONS_DIR`` / ``~/.cache/torch_extensions``).

An engine decides once, when it is built, whether it uses the kernel (:func:`resolve_decode_kernel`),
and keeps that choice for its lifetime: the kernel and the PyTorch path in ``paged.py`` agree only to
rounding, so swapping one for the other mid-run would let identical greedy requests diverge depending
on wall-clock time. ``cpu_kernels``:

* ``True`` — build now if needed and wait (benchmarks, ``roofline --measure``);
* ``"auto"`` — the same, with the build (when needed) shown by name on the terminal: it happens in this
  process, in the foreground, never in a detached one that outlives the command (``forwardpass warmup``
  builds every kernel ahead of time). The first decision in a process is remembered, so every
  ``"auto"`` engine of that process computes the same way;
* ``False`` — the PyTorch path. ``FORWARDPASS_CPU_KERNEL=0`` disables the kernel everywhere.
"""

from __future__ import annotations

import logging
from pathlib import Path

from forwardpass.kernel_build import TORCH_EXT, CppKernel, KernelLoader
from forwardpass.layers import small_matmul

logger = logging.getLogger(__name__)

KERNEL = CppKernel(
    "forwardpass_paged_decode", Path(__file__).with_name("csrc") / "paged_decode.cpp",
    cflags=("-O3", "-mavx2", "-mfma", "-mf16c", "-ffast-math", "-fopenmp"), ldflags=("-fopenmp",),
    what="the C++ paged-decode kernel", expected_s=25,
    headers=(TORCH_EXT, Path(__file__).with_name("csrc") / "decode_stack.h"),
)
SMALL_MATMUL = small_matmul.KERNEL  # built with it (and by `forwardpass warmup`)
# the whole extension: paged_decode and the fused per-layer ops (rms_norm, qk_norm_rope_); the small-batch
# matmul is loaded with it (None and a log line if it alone cannot be built)
LOADER = KernelLoader(KERNEL, "using the PyTorch path", logger, switch="FORWARDPASS_CPU_KERNEL",
                      check=lambda module: small_matmul.load_small_matmul())  # fmt: skip


def load_paged_decode(wait: bool = True):
    """The compiled ``paged_decode(q, kv_cache, block_tables, seq_lens, scale, window)``, or None.

    ``wait=False`` returns None at once if the kernels are not built yet (nothing is started: no build runs
    in the background); ``wait=True`` builds them first if needed, showing the wait by name.
    """
    return _paged_decode(LOADER.load(ready=None if wait else is_built))


def is_built() -> bool:
    """Whether this machine's builds of the decode kernel and its small-batch matmul are in the cache."""
    return KERNEL.is_built() and SMALL_MATMUL.is_built()


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
    if not _auto_decision:  # built now if needed, in the foreground, with its wait named on the terminal
        _auto_decision.append(load_paged_decode(wait=True))
    return _auto_decision[0]

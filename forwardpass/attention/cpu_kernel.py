"""Builds and loads the C++ paged-decode kernel (``csrc/paged_decode.cpp``).

Compiled with torch's cpp_extension (a C++ compiler and ninja; ~30 s once, then cached in
``$TORCH_EXTENSIONS_DIR`` / ``~/.cache/torch_extensions``). The engine never waits for the build: when
the kernel is not built yet, ``load_paged_decode(wait=False)`` starts the build in a background
process (so a first ``forwardpass generate`` still answers within seconds) and the engine uses the
PyTorch formulation in ``paged.py`` until the kernel is ready. If the build fails, the fallback stays,
with one warning in the log. ``FORWARDPASS_CPU_KERNEL=0`` disables the kernel.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

NAME = "forwardpass_paged_decode"
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_kernel = None
_failed = False
_background: subprocess.Popen | None = None


def _build_and_load():
    from torch.utils.cpp_extension import load

    module = load(
        name=NAME,
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    return module.paged_decode


def _built_library() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(NAME, verbose=False)) / f"{NAME}.so"


def load_paged_decode(wait: bool = True):
    """The compiled ``paged_decode(q, kv_cache, block_tables, seq_lens, scale, window)``, or None.

    ``wait=False`` returns None at once if the kernel still has to be compiled (and starts that in
    the background); call again later to pick it up.
    """
    global _kernel, _failed, _background
    if _kernel is not None or _failed or os.environ.get("FORWARDPASS_CPU_KERNEL", "1") == "0":
        return _kernel
    try:
        if not wait and not _built_library().exists():
            if _background is None:
                _background = subprocess.Popen(
                    [sys.executable, "-m", "forwardpass.attention.cpu_kernel"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                )
            if _background.poll() is None:
                return None
        _kernel = _build_and_load()
    except Exception as exc:  # noqa: BLE001 - compiler or headers missing, ...: fall back, loudly once
        _failed = True
        logger.warning("C++ paged-decode kernel unavailable (%s); using the PyTorch path", exc)
    return _kernel


if __name__ == "__main__":  # the background build
    os.nice(10)
    _build_and_load()

"""Builds and loads the C++ paged-decode kernel (``csrc/paged_decode.cpp``) on first use.

Compiled with torch's cpp_extension (needs a C++ compiler and ninja; ~1 minute once, then cached in
``~/.cache/torch_extensions``). If anything fails the engine falls back to the PyTorch formulation
in ``paged.py`` and says so once in the log — the kernel is a fast path, never a requirement.
Set ``FORWARDPASS_CPU_KERNEL=0`` to disable it.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def load_paged_decode():
    """The compiled ``paged_decode(q, kv_cache, block_tables, seq_lens, scale, window)`` or None."""
    if os.environ.get("FORWARDPASS_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        src = Path(__file__).with_name("csrc") / "paged_decode.cpp"
        module = load(
            name="forwardpass_paged_decode",
            sources=[str(src)],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        return module.paged_decode
    except Exception as exc:  # compiler missing, headers missing, ...: fall back, loudly once
        logger.warning("C++ paged-decode kernel unavailable (%s); using the PyTorch path", exc)
        return None

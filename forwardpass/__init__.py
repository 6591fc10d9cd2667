"""forwardpass: an inference engine for generative models, built to be read.

Public API (imported lazily so ``import forwardpass`` stays cheap)::

    from forwardpass import LLM, SamplingParams
    llm = LLM(model="path/to/hf-dir")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.8, max_tokens=64))
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# OpenMP workers that spin a bounded while after a parallel region, then sleep (unless the user chose a
# policy): spinning without bound made decode 5-20x slower on a shared machine when compute threads outnumber
# the free cores; sleeping at once made every parallel region of a decode step wait for a woken thread (2x
# slower decode on a quiet VM); a long spin (100,000) collapsed under load as spinning without bound does.
# Effective only when set before torch loads; see forwardpass/threads.py.
OPENMP_WAIT = {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "1000"}


def set_openmp_wait() -> None:
    """Set :data:`OPENMP_WAIT` unless the user chose a policy (a user's own spin count is kept)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        for name, value in OPENMP_WAIT.items():
            os.environ.setdefault(name, value)


set_openmp_wait()

_LAZY = {
    "LLM": "forwardpass.llm",
    "SamplingParams": "forwardpass.sampling.params",
    "LoRARequest": "forwardpass.lora.request",
    "EngineConfig": "forwardpass.config",
    "ImagePipeline": "forwardpass.diffusion.pipeline",
    "analyze": "forwardpass.analysis.roofline",
}

__all__ = ["__version__", *_LAZY]  # noqa: PLE0604 - the lazily imported names (strings: the keys)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'forwardpass' has no attribute {name!r}")

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

# OpenMP workers that sleep between parallel regions instead of spinning (unless the user chose a policy):
# with spinning workers, compute threads that outnumber the free cores made decode 5-20x slower on a shared
# machine. Effective only when set before torch loads; see forwardpass/threads.py (prefer_passive_wait).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

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

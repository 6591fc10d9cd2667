"""Sampling: validated request parameters and the batched sampler.

``SamplingParams`` is imported eagerly (it needs nothing but the standard library); the sampler, which
needs torch, is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from forwardpass.sampling.params import SamplingParams

_LAZY = {
    "Sampler": "forwardpass.sampling.sampler",
    "SamplerOutput": "forwardpass.sampling.sampler",
    "SamplingRow": "forwardpass.sampling.sampler",
    "TokenLogprobs": "forwardpass.sampling.sampler",
    "make_generator": "forwardpass.sampling.sampler",
}

__all__ = ["Sampler", "SamplerOutput", "SamplingParams", "SamplingRow", "TokenLogprobs", "make_generator"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'forwardpass.sampling' has no attribute {name!r}")

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

# passive with a bounded spin: see set_openmp_wait
OPENMP_WAIT = {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "1000"}


def set_openmp_wait() -> None:
    """Set :data:`OPENMP_WAIT` unless the user chose a policy (a user's own spin count is kept); called at
    import, so a script that imports forwardpass before torch gets it, and the ``forwardpass`` command
    always does (a no-op once libgomp has loaded).

    With the default (active) policy each OpenMP worker spins after a parallel region without bound, burning
    the core another thread or process needs: on a shared 2-core Xeon (AVX-512, AMX; load average 4-15), the
    embedded model's decode with 2 threads ran at 1.7-36 tok/s spinning against 31-198 passive (docs/cli.md,
    "Threads"). Passive alone sleeps at once, so every parallel region of a decode step (dozens per token)
    waits for a woken worker; libgomp's spin count bounds the spin instead: 1,000 pause loops (tens of
    microseconds) span the gaps inside a step. On a 2-core Zen 4, quiet, the embedded model at 2 threads:
    passive 310-415 tok/s, this spin 839-1,274; under two busy loops per core one thread decodes 1.03x as
    fast as two with passive, 1.60x with this spin, 2.67x with 100,000 (some rounds collapse to 4 tok/s, as
    unbounded spinning does; benchmarks/threads_under_load.py). SmolLM2 Q4_1 at batch 1: 86 tok/s passive,
    185 with this spin."""
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

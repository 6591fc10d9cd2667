"""GGUF files for tests: our converter, ``scripts/to_gguf.py`` (a script, not a package module)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def converter() -> ModuleType:
    """``scripts/to_gguf.py`` loaded as a fresh module (``convert(model_dir, out, type)``); fresh on each
    call, so a test may patch its functions (``tensor_type``) without touching another's."""
    spec = importlib.util.spec_from_file_location("to_gguf", REPO / "scripts" / "to_gguf.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

"""Kernel builds as test parameters: each build runs where this CPU has its instructions and is skipped, with
the missing flags named, elsewhere (CI lands on AVX2-only, AVX-512 and AMX hosts alike)."""

from __future__ import annotations

import pytest

from forwardpass.kernel_build import cpu_flags


def builds(wide: str, wide_needs: set[str]) -> list:
    """``["avx2", wide]`` for ``pytest.mark.parametrize`` / fixture ``params``; ``wide`` (an AVX-512 build)
    skipped where the CPU lacks a flag it is compiled for."""
    missing = sorted(wide_needs - cpu_flags())
    reason = f"the {wide} build needs CPU flags this CPU lacks: {', '.join(missing)}"
    return ["avx2", pytest.param(wide, marks=pytest.mark.skipif(bool(missing), reason=reason))]

"""The execution plan in words, for the start-up banner of ``serve`` and ``generate`` / ``chat --verbose``:
what the weights are and what multiplies them, per layer kind ("GGUF Q4_1 via the K-block kernel (avx2,
...)", not the compute dtype), the compiled kernels with the instruction set of each build, the KV cache's
dtype and the threads. It reads the plan as ``layers/weight_report.py::described_plan`` gives it (the same
plain values ``/v1/models`` and ``explain --json`` show), so every report says the same."""

from __future__ import annotations

from typing import Any


def weights_line(plan: dict[str, Any]) -> str:
    """``projections: GGUF Q4_1 via the K-block kernel (...); lm head: ...; KV cache float16``."""
    loaded = plan.get("loaded_weights") or {}
    roles = "; ".join(f"{role.replace('_', ' ')}: {what}" for role, what in loaded.items())
    return f"{roles}; KV cache {plan.get('kv_cache_dtype', '?')}" if roles else \
        f"KV cache {plan.get('kv_cache_dtype', '?')}"


def kernels_line(plan: dict[str, Any], threads: int) -> str:
    """The compiled kernels the plan loaded, each build's instruction set, the threads; ``PyTorch only``
    where it loaded none."""
    isa = plan.get("isa") or {}
    parts = []
    if plan.get("decode_kernel"):
        fused = " with the fused per-layer ops" if plan.get("fused_ops") else ""
        stack = " and the decode stack (a layer's decode step in C++)" if plan.get("decode_stack") else ""
        parts.append(f"paged-decode attention{fused}{stack}")
    if plan.get("small_matmul"):
        parts.append(f"small-batch fp32 matmul ({isa.get('small_matmul', '?')})")
    if "quant_matmul" in isa:
        gemm = isa.get("quant_gemm", "?")
        parts.append(f"quantized matmul ({isa['quant_matmul']}; many rows: {gemm} GEMM)")
    text = ", ".join(parts) if parts else "PyTorch only (no compiled kernel)"
    extras = [f"{threads} thread{'s' if threads != 1 else ''}"]
    if plan.get("huge_pages"):
        extras.append("2 MB pages")
    if plan.get("batch_invariant"):
        extras.append("batch-invariant")
    extras += [f"{k}={v}" for k, v in (plan.get("env") or {}).items()]
    return f"{text}; {', '.join(extras)}"


def plan_lines(plan: dict[str, Any], threads: int) -> list[str]:
    """The banner's two plan lines, aligned with its others."""
    return [f"  weights     {weights_line(plan)}", f"  kernels     {kernels_line(plan, threads)}"]

"""The execution plan and what a loaded model's weights really are, and which kernel multiplies them, in words
a person reads: the start-up banner, ``/v1/models`` and ``explain`` show it. The execution plan names each
role's *method* (:func:`describe_plan`), but a GGUF file's tensors keep their own types (Q4_1 projections
beside a Q8_0 head), so :func:`weight_formats` reads the weights themselves."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from forwardpass import envs
from forwardpass.layers.weight_interface import Weight
from forwardpass.layers.weight_methods import ROLES, method_for
from forwardpass.plan import ExecutionPlan


def describe_weight(w: torch.Tensor | Weight) -> tuple[str, str]:
    """One weight matrix as ``(format, what multiplies it)``: ``("Q4_1", "the K-block kernel (...)")``; a
    weight in a format of its own says it itself (``describe()``)."""
    if isinstance(w, torch.Tensor):
        return str(w.dtype).removeprefix("torch."), "oneDNN"
    return w.describe()


def _phrase(found: Counter[tuple[str, str]]) -> str:
    """``"Q4_K x 68, Q6_K x 10 via the K-block kernel (...)"``: formats counted, grouped by what multiplies
    them (a single matrix or a single format: no counts)."""
    by_how: dict[str, Counter[str]] = {}
    for (fmt, how), n in found.items():
        by_how.setdefault(how, Counter())[fmt] += n
    return "; ".join(
        (next(iter(fmts)) if len(fmts) == 1 else ", ".join(f"{f} x {n}" for f, n in fmts.most_common()))
        + f" via {how}" for how, fmts in by_how.items())


def weight_formats(model: nn.Module) -> dict[str, str]:
    """``{"projections": ..., "lm_head": ...}``: the formats of the layers' linear weights (how many matrices
    of each, where they differ) and of the LM head (or the tied embedding that is the head), with what
    multiplies them."""
    projections: Counter[tuple[str, str]] = Counter()
    head = None
    for module in model.modules():
        role = getattr(module, "role", None)
        w = getattr(module, "weight", None)
        if w is None:
            continue
        if role == "projection":
            projections[describe_weight(w)] += 1
        elif role == "lm_head" or getattr(module, "head_method", None) is not None:
            tied = "" if role == "lm_head" else " (the tied embedding)"
            head = _phrase(Counter([describe_weight(w)])) + tied
    out = {}
    if projections:
        out["projections"] = _phrase(projections)
    if head is not None:
        out["lm_head"] = head
    return out


def describe_plan(plan: ExecutionPlan) -> dict[str, Any]:
    """The plan for people and reports (start-up log, ``/v1/models``, ``explain --json``): plain JSON values,
    each role's weight method by name (``layers/weight_methods.py``)."""
    return {
        "device": plan.device,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "checkpoint_format": plan.checkpoint_format,
        "kv_cache_dtype": str(plan.kv_cache_dtype).removeprefix("torch."),
        "weights": {role: method_for(plan, role).name for role in ROLES},
        "decode_kernel": plan.kernels.decode is not None,
        "fused_ops": plan.kernels.fused_ops is not None,
        "small_matmul": plan.kernels.small_matmul is not None,
        "decode_stack": plan.decode_stack,
        "batch_invariant": plan.batch_invariant,
        "huge_pages": plan.huge_pages,
        "lora_slots": plan.lora_slot is not None,
        "isa": dict(plan.isa),
        "env": envs.describe(),
    }


def described_plan(plan: ExecutionPlan, model: nn.Module) -> dict[str, Any]:
    """:func:`describe_plan` with ``loaded_weights``: what the weights really are (the start-up banner,
    ``/v1/models`` and ``explain`` show it)."""
    formats = weight_formats(model)
    if plan.checkpoint_format == "gguf":  # the file's own types, as llama.cpp names them
        formats = {role: f"GGUF {what}" for role, what in formats.items()}
    return {**describe_plan(plan), "loaded_weights": formats}

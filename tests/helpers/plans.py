"""Models built with an execution plan, outside an engine: how tests get a quantized or packed model."""

from __future__ import annotations

from pathlib import Path

from forwardpass.models.prepare import prepare_model
from forwardpass.plan import ExecutionPlan
from forwardpass.quant import QUANTIZATIONS
from forwardpass.quant.apply import HEAD_FORMAT


def quantized_plan(quantization: str, kernel: bool = True) -> ExecutionPlan:
    """The plan of an ``int8`` / ``int4`` engine's weights (``kernel=False``: the PyTorch
    reference multiplies)."""
    return ExecutionPlan(quantized_format=QUANTIZATIONS[quantization], head_format=HEAD_FORMAT,
                         quant_kernel=kernel)


def quantized_model(model_dir: str | Path, quantization: str, kernel: bool = True):
    return prepare_model(model_dir, quantized_plan(quantization, kernel))[0]

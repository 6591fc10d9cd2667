"""Stacked routed-expert weights of the MoE blocks that are not ``layers/moe.py::FusedMoE`` (DeepSeek-V4's
``experts.w13`` / ``experts.w2``, Nemotron-H's relu² ``experts.up_proj`` / ``experts.down_proj``).

They take the plan's block format after loading, as ``FusedMoE``'s ``ExpertWeights`` do (``quant/apply.py``:
MoE expert stacks are quantized like the projections): without this an int8 / int4 engine kept these models'
routed experts, most of their weights, in fp32 while its plan said ``q8_0`` / ``q4_0``. A quantized stack is
indexed per expert (``QuantizedWeight.__getitem__``) and multiplied through its own matmul, a tensor's
matrix through the dense one (``layers/weight_interface.py::matmul``).
"""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.plan import current_plan
from forwardpass.quant.weight import QuantizedWeight


class ExpertStacks(nn.Module):
    """``[E, N, K]`` parameters under the names a checkpoint's loader fills
    (``ExpertStacks(w13=(E, 2I, H), ...)``), quantized one stack at a time after loading where the plan
    quantizes (peak memory: one stack's blocks)."""

    def __init__(self, **shapes: tuple[int, int, int]):
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(*shape), requires_grad=False))
        self.stack_names = tuple(shapes)
        plan = current_plan()
        self.quantized_format, self.quant_kernel = plan.quantized_format, plan.quant_kernel

    def process_weights_after_loading(self) -> None:
        if self.quantized_format is None:
            return
        for name in self.stack_names:
            w = getattr(self, name)
            if isinstance(w, nn.Parameter):
                qw = QuantizedWeight.from_float(w.data, self.quantized_format, self.quant_kernel)
                delattr(self, name)  # drop the fp32 parameter before registering its replacement
                setattr(self, name, qw)

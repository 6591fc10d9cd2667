"""The gated MLP (SwiGLU) of Llama-family models: down(act(gate(x)) * up(x))."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.layers.activation import get_activation, silu_and_mul
from forwardpass.layers.linear import Linear, MergedLinear
from forwardpass.plan import current_plan


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 bias: bool = False):
        super().__init__()
        # gate and up read the same input: one merged matmul instead of two.
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(hidden_act)
        # the plan's compiled SwiGLU, for exactly this class (a subclass may change the math)
        self.fused: Any = current_plan().fused_ops if type(self) is GatedMLP else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (self.fused is not None and self.act is F.silu and gate_up.dtype == torch.float32
                and gate_up.is_cpu):
            return self.down_proj(self.fused.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul(gate_up, self.act))

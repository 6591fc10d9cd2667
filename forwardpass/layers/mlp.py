"""The gated MLP (SwiGLU) of Llama-family models: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.layers.activation import get_activation, silu_and_mul
from forwardpass.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        # gate and up read the same input: one merged matmul instead of two.
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.act))

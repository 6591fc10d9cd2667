"""Activations used by (gated) MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forwardpass.errors import UnsupportedArchitectureError

_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
         "relu2": lambda x: F.relu(x).square()}  # relu2: Nemotron-H's squared ReLU


def get_activation(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise UnsupportedArchitectureError(f"hidden_act {name!r} is not supported (supported: "
                                           f"{sorted(_ACTS)})") from None


def silu_and_mul(gate_up: torch.Tensor, act=F.silu) -> torch.Tensor:
    """SwiGLU: act(gate) * up, with gate and up side by side in the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up

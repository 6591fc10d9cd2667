"""RMSNorm, computed in fp32 whatever the storage dtype (as HF does), so low-precision runs stay stable."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forwardpass.plan import current_plan


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        # the plan's compiled op, for exactly this class (a subclass may change the math)
        self.fused: Any = current_plan().fused_ops if type(self) is RMSNorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

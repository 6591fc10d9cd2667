"""Linear layers: a weight held and multiplied by the layer's weight method (``layers/weight_methods.py``).

A weight the method quantized or packed (or a GGUF file's blocks) multiplies through its own kernels
(``layers/weight_interface.py::Weight``); a plain fp32 weight through the dense matmul
(``layers/dense_matmul.py``: oneDNN, or the compiled small-batch kernel for decode-sized batches).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from forwardpass.layers.dense_matmul import SmallMatmul
from forwardpass.layers.weight_interface import dense
from forwardpass.layers.weight_methods import method_for
from forwardpass.plan import current_plan


class LinearDelta(Protocol):
    """Something added to a linear layer's output, computed from its input (a LoRA adapter slot)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    """A linear layer whose weight is held and multiplied by its weight method (``layers/weight_methods.py``),
    taken from the execution plan at construction by the layer's ``role``; the loader fills the weight, then
    :meth:`process_weights_after_loading` lets the method pack or quantize it once.

    ``delta`` is the layer's LoRA slot where the plan has LoRA (``forwardpass/lora/manager.py``): it adds the
    low-rank updates of the adapters in the current batch to the base output. The LM head is no adapter
    target.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, role: str = "projection"):
        super().__init__()
        plan = current_plan()
        self.in_features, self.out_features, self.role = in_features, out_features, role
        self.method = method_for(plan, role)
        self.method.create_weights(self, out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.delta: LinearDelta | None = (plan.lora_slot() if plan.lora_slot is not None and role != "lm_head"
                                          else None)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.delta is None else self.delta(x, out)

    def dense_weight(self) -> torch.Tensor:
        """The weight's plain ``[N, K]`` values, whatever holds them (for code that reads it as a matrix)."""
        return dense(self.weight)

    @property
    def small_matmul(self) -> SmallMatmul | None:
        """The compiled small-batch fp32 matmul this layer's method uses (None: oneDNN for every batch)."""
        return getattr(self.method, "small_matmul", None)


class MergedLinear(Linear):
    """Several projections that read the same input, stored as one weight so they cost one matmul.

    Used for q/k/v and for gate/up. ``output_sizes`` records where each original projection lives in
    the merged output, so the loader (and LoRA) can address ``q_proj`` etc. by name.
    """

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes.values()), bias=bias)
        self.output_sizes = dict(output_sizes)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in output_sizes.items():
            self.offsets[name] = (start, start + size)
            start += size

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split(list(self.output_sizes.values()), dim=-1))

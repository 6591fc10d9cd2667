"""Linear layers and the matmul path they take.

On this kind of CPU (AMD, AVX2, no AVX-512) ``F.linear`` goes through MKL's generic path, which reads
weights at ~18–29 GB/s; oneDNN's ``_linear_pointwise`` reads the same fp32 weights 2–4× faster (see
``benchmarks/decode.py``). We use oneDNN for fp32 CPU tensors
and fall back to ``F.linear`` everywhere else (CUDA, other dtypes, autograd). A weight the quantize pass
replaced by a :class:`~forwardpass.quant.weight.QuantizedWeight` (``forwardpass/quant/apply.py``) computes
through its own kernel, so every caller of :func:`linear` (layers, MoE experts, LM heads) takes it as is; so
does an fp32 weight the engine packed for oneDNN (:class:`~forwardpass.layers.packed.PackedWeight`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.layers.packed import PackedWeight
from forwardpass.layers.small_matmul import MAX_ROWS
from forwardpass.quant.kblock_weight import KBlockWeight, RowStack
from forwardpass.quant.weight import QuantizedWeight


class SmallMatmul(Protocol):
    """The compiled small-batch fp32 matmul: ``x [M, K] @ weight [N, K].T (+ bias)``."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor: ...


class LinearDelta(Protocol):
    """Something added to a linear layer's output, computed from its input (a LoRA adapter slot)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | PackedWeight, bias: torch.Tensor | None = None,
    small_matmul: SmallMatmul | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` through the fastest path available for these tensors.

    ``small_matmul`` is the engine's compiled kernel for decode-sized batches (``layers/small_matmul.py``):
    fp32 batches of at most ``MAX_ROWS`` rows take it, larger ones oneDNN.
    """
    # computes through its own kernels
    if isinstance(weight, (QuantizedWeight, PackedWeight, KBlockWeight, RowStack)):
        return weight.matmul(x, bias)
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
    ):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if small_matmul is not None and x2.shape[0] <= MAX_ROWS:
            out = small_matmul(x2, weight, bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
        return out.view(*shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


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
        from forwardpass.layers.weight_methods import method_for
        from forwardpass.plan import current_plan

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
        from forwardpass.layers.weight_methods import dense_weight

        return dense_weight(self.weight)

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

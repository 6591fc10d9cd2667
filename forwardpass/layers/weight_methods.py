"""Weight methods: how a linear layer holds its weight and multiplies by it (vLLM's ``quant_method`` idea).

A :class:`~forwardpass.layers.linear.Linear` takes its method from the execution plan when it is constructed
(:func:`method_for`, by the layer's role) and hands it three moments of its life:

* ``create_weights``: the parameters the checkpoint loader fills (an fp32 ``weight`` for every method here);
* ``process_weights_after_loading``: once, after loading: pack the weight for oneDNN, keep a bf16 / fp16
  checkpoint's weight in its dtype (``layers/half_panels.py``), or quantize it to blocks;
* ``apply``: ``x · Wᵀ (+ bias)``: a weight in a format of its own (quantized blocks, packed panels:
  ``layers/weight_interface.py::Weight``) through its own matmul, a plain fp32 tensor through the dense
  matmul (``layers/dense_matmul.py``).

Code that needs a weight's values (a grouped projection, a reference) asks ``Linear.dense_weight()``, never
the stored object. A GGUF file's quantized tensors arrive as blocks already (``models/gguf_weights.py``): a
layer holding a ``QuantizedWeight`` (Q8_0, Q4_0), a ``KBlockWeight`` (Q4_1, Q5_x, K-quants) or a
``RowStack`` of them keeps it whatever its method, which then leaves it as stored.

Roles: ``"projection"`` (attention and MLP projections), ``"lm_head"`` (a separate output matrix, 8 bits when
quantizing), ``"dense"`` (read as a matrix or too sensitive to round: MoE routers, DeepSeek's ``kv_b_proj``
and ``wo_a``): kept plain fp32 by every plan.

A batch-invariant plan (``ExecutionPlan.batch_invariant``) gives every method ``batch_invariant=True``: each
batch size takes the one kernel whose rows do not interact (the small-batch fp32 kernel a piece of rows at a
time, the int8 kernel for quantized weights), never the GEMM a larger batch would switch to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from forwardpass.layers.dense_matmul import dense_matmul
from forwardpass.layers.half_panels import HalfPanelWeight
from forwardpass.layers.packed import PackedWeight
from forwardpass.layers.weight_interface import Weight
from forwardpass.quant.weight import QuantizedWeight

if TYPE_CHECKING:
    from forwardpass.plan import ExecutionPlan

ROLES = ("projection", "lm_head", "dense")
#: the small-batch kernel on a plain (unpacked) weight is row-invariant up to this many rows (its transposed
#: path for larger batches sums in another order); on packed panels up to MAX_ROWS (PackedWeight's own
#: batch-invariant matmul; tests/test_batch_invariance.py)
PLAIN_INVARIANT_ROWS = 16


@dataclass(frozen=True)
class Fp32Method:
    """fp32 weights as loaded; decode-sized batches on the compiled small-batch matmul where the plan has
    it."""

    small_matmul: Any = None
    #: every batch through the small-batch kernel, a piece of rows at a time (the batch-invariant plan)
    batch_invariant: bool = False

    @property
    def name(self) -> str:
        return "fp32" + ("+small-matmul" if self.small_matmul is not None else "")

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load_blocks(self, layer: nn.Module, weight: Weight) -> None:
        """A checkpoint tensor that arrives quantized (a GGUF file's blocks, ``models/gguf_weights.py``): the
        layer holds it as stored, whatever its method; the methods' post-processing leaves it as it is."""
        del layer.weight  # the fp32 parameter made by create_weights, never filled
        layer.weight = weight

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight
        # quantized or packed after loading, or a GGUF file's blocks: its own kernels
        if not isinstance(w, torch.Tensor):
            return w.matmul_batch_invariant(x, bias) if self.batch_invariant else w.matmul(x, bias)
        if self.batch_invariant:
            x2 = x.reshape(-1, x.shape[-1])
            rows = PLAIN_INVARIANT_ROWS
            if x2.shape[0] > rows:  # pieces the kernel takes: a larger batch would go to oneDNN's GEMM
                pieces = [dense_matmul(x2[i : i + rows], w, bias, self.small_matmul)
                          for i in range(0, len(x2), rows)]  # fmt: skip
                out = torch.cat(pieces)
                return out.view(*x.shape[:-1], out.shape[-1])
        return dense_matmul(x, w, bias, self.small_matmul)


@dataclass(frozen=True)
class PackedFp32Method(Fp32Method):
    """fp32 weights packed once for oneDNN and read in place by the small-batch kernel (layers/packed.py); a
    weight whose packed layout does not check out stays plain (``Fp32Method``)."""

    kernel_module: Any = None  # the small-batch matmul's module (``panels_view``)

    @property
    def name(self) -> str:
        return "fp32-packed"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        if not isinstance(w, nn.Parameter) or w.dim() != 2:  # blocks from a GGUF file: kept as stored
            return
        packed = PackedWeight.pack(w.data, self.kernel_module)
        if packed is not None:
            del layer.weight  # the fp32 parameter goes; its memory returns once nothing else holds it
            layer.weight = packed


@dataclass(frozen=True)
class HalfPanelMethod(PackedFp32Method):
    """A bf16 / fp16 checkpoint's weights kept in their dtype, in panels the small-batch kernel upcasts in
    registers (layers/half_panels.py); a weight whose values are not all of that dtype is packed as fp32."""

    storage: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return str(self.storage).removeprefix("torch.") + "-panels"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        if not isinstance(w, nn.Parameter) or w.dim() != 2:  # blocks from a GGUF file: kept as stored
            return
        half = HalfPanelWeight.pack(w.data, self.storage, self.kernel_module)
        if half is None:
            super().process_weights_after_loading(layer)
            return
        del layer.weight  # the fp32 parameter goes: the panels are the only copy
        layer.weight = half


@dataclass(frozen=True)
class QuantizeAtLoadMethod(Fp32Method):
    """fp32 weights loaded, then quantized to ``fmt`` blocks one matrix at a time (peak memory: the fp32 model
    plus one quantized matrix); the C++ kernels multiply them (``kernel=False``: the PyTorch reference)."""

    fmt: str = "q8_0"
    kernel: bool = True

    @property
    def name(self) -> str:
        return self.fmt + ("" if self.kernel else " (reference)")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        if isinstance(w, nn.Parameter):
            qw = QuantizedWeight.from_float(w.data, self.fmt, self.kernel)
            del layer.weight  # drop the fp32 parameter before registering its replacement
            layer.weight = qw


def method_for(plan: ExecutionPlan, role: str) -> Fp32Method:
    """The weight method of a linear layer of ``role`` under ``plan``."""
    if role not in ROLES:
        raise ValueError(f"unknown linear role {role!r}; one of {', '.join(ROLES)}")
    small, invariant = plan.kernels.small_matmul, plan.batch_invariant
    if role == "dense":
        return Fp32Method(small, invariant)
    fmt = plan.head_format if role == "lm_head" else plan.quantized_format
    if fmt is not None:
        return QuantizeAtLoadMethod(small, invariant, fmt=fmt, kernel=plan.quant_kernel)
    if plan.packed_weights and small is not None and plan.kernels.small_matmul_module is not None:
        if plan.weight_storage != torch.float32:
            return HalfPanelMethod(small, invariant, plan.kernels.small_matmul_module, plan.weight_storage)
        return PackedFp32Method(small, invariant, plan.kernels.small_matmul_module)
    return Fp32Method(small, invariant)

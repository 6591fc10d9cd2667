"""One operation's cost (FLOPs and bytes by kind) and its roofline time on a device.

The vocabulary every cost is written in: the LLM accounting (``analysis/roofline.py``,
``analysis/forward.py``), the DiT and video accounting, and the roofline terms each model family gives for
itself (``models/family.py``, ``models/*_roofline.py``) — which is why it sits below both ``analysis/`` and
``models/``.

Time model: ``time = max(flops / peak, bytes / bandwidth)`` per operation, and operations run one after
another (a stage's time is the sum of its operations' times, never overlapped). ``peak`` is the dense
matrix peak in the compute dtype for ``matmul`` operations and the plain FP32 rate for ``vector``
(elementwise) operations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

MATMUL = "matmul"
VECTOR = "vector"


class Roofs(Protocol):
    """What an operation's time needs of a device (``analysis/hardware.py``'s ``Hardware`` has it)."""

    vector_flops: float
    bandwidth: float

    def peak(self, dtype: str) -> float: ...


@dataclass
class OpCost:
    """FLOPs and bytes of one operation, summed over the ``count`` layers it stands for."""

    stage: str
    name: str
    kind: str  # MATMUL or VECTOR
    flops: float
    weight_bytes: float = 0.0
    act_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    count: int = 1
    batch: int | None = None
    context: int | None = None
    # filled by evaluate()
    peak: float = 0.0
    compute_time_s: float = 0.0
    memory_time_s: float = 0.0
    time_s: float = 0.0
    bound: str = ""

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.act_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved; ``inf`` for an op that moves nothing (e.g. softmax
        inside fused attention)."""
        if self.bytes <= 0:
            return math.inf if self.flops > 0 else 0.0
        return self.flops / self.bytes

    def times(self, k: float, count: int | None = None) -> OpCost:
        """This op repeated ``k`` times (e.g. once per layer)."""
        return replace(
            self,
            flops=self.flops * k,
            weight_bytes=self.weight_bytes * k,
            act_bytes=self.act_bytes * k,
            kv_read_bytes=self.kv_read_bytes * k,
            kv_write_bytes=self.kv_write_bytes * k,
            count=count if count is not None else int(self.count * k),
        )

    def evaluate(self, hw: Roofs, dtype: str) -> OpCost:
        """Fill ``peak``, the two times, ``time_s`` and ``bound`` for device ``hw`` computing in ``dtype``."""
        self.peak = hw.peak(dtype) if self.kind == MATMUL else hw.vector_flops
        self.compute_time_s = self.flops / self.peak
        self.memory_time_s = self.bytes / hw.bandwidth
        self.time_s = max(self.compute_time_s, self.memory_time_s)
        self.bound = "compute" if self.compute_time_s >= self.memory_time_s and self.flops > 0 else "memory"
        return self

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["bytes"] = self.bytes
        d["intensity"] = json_number(self.intensity)
        return d


def json_number(x: float) -> float | None:
    """JSON has no infinity: unbounded intensities become ``null``."""
    return None if (isinstance(x, float) and not math.isfinite(x)) else x


def linear(
    stage: str,
    name: str,
    tokens: float,
    d_in: int,
    d_out: int,
    *,
    wb: float,
    ab: float,
    weight_params: float | None = None,
    out_kv_bytes: float | None = None,
    out_bytes: float | None = None,
) -> OpCost:
    """``tokens × d_in`` activations times a ``d_in × d_out`` weight.

    Reads the weight once (``weight_params`` overrides the number of weight elements read, e.g. for MoE
    where only the touched experts are read) and the input activations; writes the output either as
    activations (``ab`` bytes each, or ``out_bytes`` per element) or, with ``out_kv_bytes``, straight
    into the KV cache.
    """
    w = (d_in * d_out if weight_params is None else weight_params) * wb
    act = tokens * d_in * ab
    kv_write = 0.0
    if out_kv_bytes is not None:
        kv_write = tokens * d_out * out_kv_bytes
    else:
        act += tokens * d_out * (ab if out_bytes is None else out_bytes)
    return OpCost(stage, name, MATMUL, 2.0 * tokens * d_in * d_out, w, act, 0.0, kv_write)


def elementwise(
    stage: str,
    name: str,
    elements: float,
    *,
    flops_per_element: float,
    ab: float,
    reads: float = 1,
    writes: float = 1,
    weight_bytes: float = 0.0,
) -> OpCost:
    """A vector op over ``elements`` outputs reading ``reads`` and writing ``writes`` tensors of that size."""
    return OpCost(
        stage, name, VECTOR, flops_per_element * elements, weight_bytes, elements * (reads + writes) * ab
    )


@dataclass
class StageTotals:
    """Sum of a stage's operations."""

    flops: float
    bytes: float
    weight_bytes: float
    act_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    compute_time_s: float
    memory_time_s: float
    time_s: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def bound(self) -> str:
        """Whichever roof takes longer for the stage as a whole (sum of compute vs sum of memory time)."""
        return "compute" if self.compute_time_s >= self.memory_time_s else "memory"


def totals(ops: list[OpCost]) -> StageTotals:
    return StageTotals(
        flops=sum(o.flops for o in ops),
        bytes=sum(o.bytes for o in ops),
        weight_bytes=sum(o.weight_bytes for o in ops),
        act_bytes=sum(o.act_bytes for o in ops),
        kv_read_bytes=sum(o.kv_read_bytes for o in ops),
        kv_write_bytes=sum(o.kv_write_bytes for o in ops),
        compute_time_s=sum(o.compute_time_s for o in ops),
        memory_time_s=sum(o.memory_time_s for o in ops),
        time_s=sum(o.time_s for o in ops),
    )

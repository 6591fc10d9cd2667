"""Adapters in memory and the per-batch row mapping the adapter layers read.

**How a mixed batch is computed.** When the engine is built with LoRA enabled, its execution plan gives
every adapter-capable projection (``layers.linear.Linear``) a :class:`LoRALayer` as its ``delta``
slot when the layer is constructed (:meth:`LoRAManager.slot_factory`), and the manager finds them: after the
untouched base matmul, ``Linear.forward`` calls it, and it adds for each adapter present in the batch
``B(A·x[rows])`` to ``y[rows]``. Before each forward pass the model runner calls
:meth:`LoRAManager.begin_step` with the adapter of each chunk; it groups the flattened rows by adapter
(``[(adapter id, rows)]``, rows as a slice when contiguous, else an index tensor), shared by every slot, and
:meth:`end_step` clears it. Rows without an adapter cost nothing; a batch with no adapter costs one empty-list
check per projection. The manager is also the scheduler's admission policy (:meth:`can_admit`: at most
``max_loras`` distinct adapters run at once).

Trade-off (vs. gathering a per-row ``A``/``B`` and one batched matmul, as in vLLM's punica/SGMV
kernels): grouping does ``2 × (adapters in the batch)`` small matmuls per projection and never copies
weights per row; the gather formulation does two batched matmuls whatever the adapter mix, but copies
``T × r × (in + out)`` weights (GBs for a long prefill) unless a custom kernel reads them in place. On
CPU with few adapters per batch (``max_loras`` bounds it), grouping wins; a GPU kernel would change
that. The grouping is computed once per step and shared by every layer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from forwardpass.layers.dense_matmul import dense_matmul
from forwardpass.layers.linear import Linear
from forwardpass.lora.adapter import LoRAAdapter, LoRAAdapterError, adapter_targets, load_adapter
from forwardpass.lora.request import LoRARequest
from forwardpass.models.model_spec import ModelSpec

logger = logging.getLogger(__name__)


class AdapterUser(Protocol):
    """What admission reads of a request: its adapter (``None``: the base model) and that adapter's id. The
    engine's ``Sequence`` is one; lora/ names this instead, as it does not import engine/."""

    @property
    def lora_request(self) -> LoRARequest | None: ...

    @property
    def lora_id(self) -> int: ...


@dataclass
class LoRABatch:
    """Which rows of the current flattened batch use which adapter (shared by all LoRA layers)."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoRALayer:
    """The delta slot of one base linear module: adds the batch's adapters' low-rank updates to its output."""

    def __init__(self, batch: LoRABatch):
        self.batch = batch
        # adapter id -> (A [R, in], B [out, R])
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        groups = self.batch.groups
        if not groups or not self.weights:
            return out
        for adapter_id, rows in groups:
            w = self.weights.get(adapter_id)
            if w is None:
                continue
            delta = dense_matmul(dense_matmul(x[rows], w[0]), w[1])
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out


class LoRAManager:
    """Loads adapters on first use (validated against the model), keeps up to ``max_cpu_loras`` of them
    (least recently used evicted; reloaded from disk if needed again), and maps batch rows to adapters."""

    @staticmethod
    def slot_factory(batch: LoRABatch) -> Callable[[], LoRALayer]:
        """What the execution plan gives each adapter-capable projection at construction: a
        slot reading ``batch``."""
        return lambda: LoRALayer(batch)

    def __init__(self, model: nn.Module, spec: ModelSpec, batch: LoRABatch, max_loras: int = 1,
                 max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        if not isinstance(max_loras, int) or max_loras < 1:
            raise LoRAAdapterError(f"max_loras must be a positive integer, got {max_loras!r}",
                                   param="max_loras")
        if not isinstance(max_lora_rank, int) or max_lora_rank < 1:
            raise LoRAAdapterError(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}",
                                   param="max_lora_rank")
        self.model, self.spec = model, spec
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or 0, max_loras, 8)
        self.dtype, self.device = dtype, device
        self.batch = batch
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU order
        self.requests: dict[int, LoRARequest] = {}  # adapter id -> the LoRARequest that named it
        # our module name -> its slot: every projection an adapter may target got one at construction, so the
        # model's structure is fixed when it is built
        self.layers: dict[str, LoRALayer] = {}
        for name in adapter_targets(model).values():
            module = model.get_submodule(name[0])
            if (isinstance(module, Linear) and isinstance(module.delta, LoRALayer)
                    and module.delta.batch is batch):
                self.layers[name[0]] = module.delta

    # ----- adapters ------------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Load (or touch) the adapter named by ``request``; raises LoRAAdapterError if unusable."""
        if not isinstance(request, LoRARequest):
            raise LoRAAdapterError("lora_request must be a forwardpass.LoRARequest, got "
                                   f"{type(request).__name__}", param="lora_request")
        aid = request.lora_int_id
        known = self.requests.get(aid)
        if known is not None and (known.lora_path != request.lora_path
                                  or known.lora_name != request.lora_name):
            raise LoRAAdapterError(
                f"lora_int_id {aid} already names adapter {known.lora_name!r} ({known.lora_path}); give "
                f"{request.lora_name!r} ({request.lora_path}) another id", param="lora_request")
        if aid in self.adapters:
            self.adapters.move_to_end(aid)
            return self.adapters[aid]
        adapter = load_adapter(request, self.model, self.spec, self.max_lora_rank, self.dtype, self.device)
        self.requests[aid] = request
        self._install(aid, adapter)
        self._evict(keep={aid})
        logger.info("loaded LoRA adapter %r (id %d, rank %d, %d modules, %.1f MB)", request.lora_name, aid,
                    adapter.rank, len(adapter.modules), adapter.num_bytes / 1e6)
        return adapter

    def remove_adapter(self, lora_id: int) -> bool:
        self.requests.pop(lora_id, None)
        return self._uninstall(lora_id)

    def list_adapters(self) -> list[LoRARequest]:
        return [self.requests[i] for i in self.adapters]

    def _install(self, aid: int, adapter: LoRAAdapter) -> None:
        for name, weights in adapter.modules.items():
            self.layers[name].weights[aid] = (weights.A, weights.B)
        self.adapters[aid] = adapter

    def _uninstall(self, aid: int) -> bool:
        adapter = self.adapters.pop(aid, None)
        if adapter is None:
            return False
        for name in adapter.modules:
            self.layers[name].weights.pop(aid, None)
        return True

    def _evict(self, keep: set[int]) -> None:
        for aid in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                break
            if aid not in keep:
                self._uninstall(aid)  # the request stays known: reloaded from disk if used again

    # ----- per step ------------------------------------------------------------------------------
    def can_admit(self, seq: AdapterUser, running: Iterable[AdapterUser]) -> bool:
        """Scheduler admission rule: at most ``max_loras`` distinct adapters among running sequences."""
        if seq.lora_request is None:
            return True
        active = {s.lora_id for s in running if s.lora_request is not None}
        return seq.lora_id in active or len(active) < self.max_loras

    def load_missing(self, adapter_ids: set[int]) -> dict[int, str]:
        """Reload this step's evicted adapters (keeping all of the step's resident); those that fail — their
        files deleted or changed since they were validated — with the reason, so only their requests fail."""
        broken: dict[int, str] = {}
        for aid in adapter_ids - set(self.adapters):
            request = self.requests[aid]
            try:
                adapter = load_adapter(request, self.model, self.spec, self.max_lora_rank, self.dtype,
                                       self.device)
            except Exception as exc:  # noqa: BLE001 - any load error is this adapter's, reported to its requests
                broken[aid] = f"LoRA adapter {request.lora_name!r} could not be reloaded: {exc}"
                continue
            self._install(aid, adapter)
            logger.info("reloaded LoRA adapter %r (id %d)", request.lora_name, aid)
        self._evict(keep=adapter_ids)
        return broken

    def begin_step(self, row_adapters: list[tuple[int, int]]) -> None:
        """Map the rows of the flattened batch to adapters: ``[(adapter id or 0, rows)]`` per chunk
        (``load_missing`` has made them resident)."""
        spans: dict[int, list[list[int]]] = {}
        row = 0
        for aid, n in row_adapters:
            if aid:
                runs = spans.setdefault(aid, [])
                if runs and runs[-1][1] == row:
                    runs[-1][1] = row + n  # adjacent rows: extend the run
                else:
                    runs.append([row, row + n])
            row += n
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for aid, runs in spans.items():
            self.adapters.move_to_end(aid)
            if len(runs) == 1:
                groups.append((aid, slice(runs[0][0], runs[0][1])))
            else:
                groups.append((aid, torch.cat([torch.arange(a, b) for a, b in runs]).to(self.device)))
        self.batch.groups = groups

    def end_step(self) -> None:
        self.batch.groups = []

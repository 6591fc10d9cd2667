"""The tensor-parallel group of one engine: this process's rank, the group size, and its collectives.

Each engine builds its own process groups straight from a ``torch.distributed`` store
(``ProcessGroupGloo`` / ``ProcessGroupNCCL``) instead of the process-wide default group, so a process
can build, close and rebuild engines (tests do) and nothing global changes under another engine.

Two groups per engine:

* ``compute`` (gloo on CPU, NCCL on GPU): the all-reduces of row-parallel layers and the logits gather.
  Every operation times out after ``timeout_s``: a worker that hangs fails the step instead of
  hanging the engine. A worker that dies closes its sockets and the collective raises at once.
* ``control`` (always gloo, CPU tensors): the driver's per-step broadcast of the ``SchedulerOutput``.
  The driver waits ``timeout_s`` at most; a worker waits as long as the engine is idle (days), and
  still learns at once when the driver dies (its connection closes).

Each rank's execution plan carries its group (``ExecutionPlan.tensor_parallel``): models read it from the
plan they are built under; their layers keep it, so the forward pass never looks anything up.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

WORKER_IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # how long a worker waits for the next step (the driver may be idle)


@dataclass
class TensorParallel:
    """One rank's view of its tensor-parallel group; ``size == 1`` means no parallelism (no groups)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE: whole experts per rank (else every expert is split like an MLP)
    compute: Any = None  # torch.distributed backend (ProcessGroupGloo / ProcessGroupNCCL)
    control: Any = None  # ProcessGroupGloo: step broadcasts
    timeout_s: float = 60.0
    # what this rank sent through the compute group: all-reduce payload bytes and count (the analyzer's
    # predictions, ``analysis/parallel.py``, are checked against these)
    all_reduce_bytes: int = 0
    all_reduces: int = 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the one communication of a row-parallel layer)."""
        self.compute.allreduce([x]).wait()
        self.all_reduce_bytes += x.numel() * x.element_size()
        self.all_reduces += 1
        return x

    def gather_to_driver(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (equal shapes) on rank 0, in rank order; None on the other ranks."""
        x = x.contiguous()
        out = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.compute.gather(out, [x], opts).wait()
        return out[0] if self.rank == 0 else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; length first, then the bytes)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.control.broadcast([t], opts).wait()


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def create_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    *,
    device: str,
    timeout_s: float,
    expert_parallel: bool,
) -> TensorParallel:
    """Join the compute and control groups of one engine (every rank calls this with the same prefix)."""
    control_timeout = timeout_s if rank == 0 else WORKER_IDLE_TIMEOUT_S
    control = dist.ProcessGroupGloo(
        dist.PrefixStore(f"{prefix}/control", store), rank, size, timedelta(seconds=control_timeout)
    )
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        torch.cuda.set_device(torch.device(device))
        compute = dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/compute", store), rank, size, opts)
    else:
        compute = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{prefix}/compute", store), rank, size, timedelta(seconds=timeout_s)
        )
    return TensorParallel(rank, size, expert_parallel, compute, control, timeout_s)

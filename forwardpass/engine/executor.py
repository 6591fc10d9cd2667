"""Where an engine's model steps run: the seam between the engine core and tensor parallelism.

``engine/builder.py`` builds an engine core around the :class:`Executor` it is handed and knows
nothing of how ranks start. :class:`LocalExecutor` runs the model in this process. The tensor-parallel
executor (``distributed/driver.py::ParallelExecutor``) has started the worker ranks before the build; it
builds rank 0's shard in their layout, hands the workers the KV cache layout the builder chose, and its
runner broadcasts each step before computing rank 0's share. ``engine/frontend/launch.py`` picks the executor
from the config (vLLM's ``EngineCore(executor_class)``, ``v1/executor/abstract.py``): it is the one module
that imports both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.engine.worker.model_runner import ModelRunner
from forwardpass.models.model_spec import ModelSpec
from forwardpass.plan import ExecutionPlan


class Executor(Protocol):
    """What the builder asks of the ranks that compute the model."""

    #: ranks the model is split over (1: this process alone)
    size: int

    def rank_plan(self, plan: ExecutionPlan) -> ExecutionPlan:
        """The plan this rank builds its model with (tensor parallel: with its group, so every layer is this
        rank's shard)."""
        ...

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec as this rank's KV cache sees it (its share of the attention heads)."""
        ...

    def make_runner(self, *args: Any, **kwargs: Any) -> ModelRunner:
        """The runner of rank 0's steps (``ModelRunner``'s arguments)."""
        ...

    def share_setup(self, groups: Sequence[KVCacheGroup], decode_kernel: bool) -> None:
        """Once the builder decided them: the KV cache layout and the decode-kernel
        decision, for every rank."""
        ...


class LocalExecutor:
    """The model in this process, one rank."""

    size = 1

    def rank_plan(self, plan: ExecutionPlan) -> ExecutionPlan:
        return plan

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        return spec

    def make_runner(self, *args: Any, **kwargs: Any) -> ModelRunner:
        return ModelRunner(*args, **kwargs)

    def share_setup(self, groups: Sequence[KVCacheGroup], decode_kernel: bool) -> None:
        pass  # no other rank to tell

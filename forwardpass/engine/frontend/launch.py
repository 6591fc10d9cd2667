"""``build_engine_core(model, config)``: the engine core with the executor its config asks for.

The one module above both the engine builder (``engine/builder.py``) and tensor parallelism
(``distributed/``): one rank builds in this process; ``tensor_parallel_size > 1`` first starts the worker
ranks (``distributed/driver.py::start_parallel_executor``), then builds rank 0's engine around their executor,
and stops them if that build fails.
"""

from __future__ import annotations

from pathlib import Path

from forwardpass.config import EngineConfig
from forwardpass.engine import builder
from forwardpass.engine.core import EngineCore


def build_engine_core(
    model: str | Path, config: EngineConfig | None = None, *, core_cls: type[EngineCore] = EngineCore
) -> EngineCore:
    config = config or EngineConfig()
    if config.tensor_parallel_size == 1:
        return builder.build_engine_core(model, config, core_cls=core_cls)
    from forwardpass.distributed.driver import start_parallel_executor

    executor, config = start_parallel_executor(Path(model), config)
    try:
        return builder.build_engine_core(model, config, core_cls=core_cls, executor=executor)
    except BaseException as exc:
        failure = executor.failed_build(exc)  # the workers are stopped either way
        if failure is exc:
            raise
        raise failure from exc

"""Rank 0's side of tensor parallelism inside the engine: refuse what cannot be split, start the workers, and
be the engine's executor (``engine/executor.py``): rank 0's shard, a :class:`DriverRunner` that
broadcasts each step before running its own share.

``engine/frontend/launch.py`` calls :func:`start_parallel_executor` for a ``tensor_parallel_size > 1``
config and hands the executor to ``engine/builder.py``, so the KV cache plan, plug-ins and core are built by
the same code as on one rank; the builder and this package do not import each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forwardpass.config import EngineConfig
from forwardpass.distributed.executor import ParallelGroup, StepMessage
from forwardpass.distributed.worker import WorkerSetup
from forwardpass.engine.scheduling.batch import RunnerOutput, SchedulerOutput
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.engine.worker.model_runner import ModelRunner
from forwardpass.errors import ConfigError, ForwardpassError
from forwardpass.layers.parallel_linear import even_split
from forwardpass.loader.config import load_model_config
from forwardpass.models.model_spec import ModelSpec, model_name
from forwardpass.parallel_state import TensorParallel
from forwardpass.plan import ExecutionPlan

#: architectures whose layers are built for tensor parallelism (the Llama family and its MoE variants)
SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)


def check_supported(config: EngineConfig, spec: ModelSpec) -> None:
    """Refuse, before any process starts, what tensor parallelism cannot do with this model."""
    architecture, n = spec.architecture, config.tensor_parallel_size
    if architecture not in SUPPORTED:
        raise ConfigError(
            f"tensor_parallel_size > 1 supports {', '.join(SUPPORTED)}; {architecture} runs on one rank only",
            param="tensor_parallel_size",
        )
    if config.quantization is not None:
        raise ConfigError(
            "quantization is not supported with tensor_parallel_size > 1 yet", param="quantization"
        )
    if config.enable_lora:
        raise ConfigError(
            "LoRA adapters are not supported with tensor_parallel_size > 1 yet", param="enable_lora"
        )
    tp = TensorParallel(size=n)  # the same checks the sharded layers make, without building them
    even_split(spec.heads, tp, "the attention heads")
    if spec.kv_heads % n and n % spec.kv_heads:
        raise ConfigError(
            f"tensor_parallel_size={n} must divide or be a multiple of the {spec.kv_heads} KV heads",
            param="tensor_parallel_size",
        )
    even_split(spec.intermediate, tp, "the MLP width")
    if spec.moe is not None and spec.moe.layer_ids:
        if config.enable_expert_parallel:
            even_split(spec.moe.num_experts, tp, "the experts")
        else:
            even_split(spec.moe.expert_intermediate, tp, "the expert MLP width")


class DriverRunner(ModelRunner):
    """Rank 0's ``ModelRunner``: broadcasts the step to the workers before running its own share."""

    def __init__(self, *args: Any, parallel: ParallelGroup, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.parallel = parallel
        self._sampled: tuple[tuple[int, int], ...] = ()

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        if self.parallel.failure is not None:
            raise self.parallel.failure
        try:
            self.parallel.tp.broadcast_object(StepMessage(scheduled, self._sampled))
            out = super().execute(scheduled)
        except Exception as exc:  # any failure mid-step leaves the ranks out of step: fatal
            raise self.parallel.fail(exc) from exc
        self._sampled = tuple(zip(out.seq_ids, out.token_ids))
        return out


def local_attention_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The spec as one rank sees its attention (its query and KV heads): what its KV cache holds."""
    kv = spec.kv_heads // size if spec.kv_heads >= size else 1  # replicated KV heads: one per rank
    return dataclasses.replace(spec, heads=spec.heads // size, kv_heads=kv)


class ParallelExecutor:
    """Rank 0's executor (``engine/executor.py``): the started workers, rank 0's shard, the
    broadcasting runner."""

    def __init__(self, group: ParallelGroup):
        self.group, self.size = group, group.size

    def rank_plan(self, plan: ExecutionPlan) -> ExecutionPlan:
        return dataclasses.replace(plan, tensor_parallel=self.group.tp)

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        return local_attention_spec(spec, self.size)

    def make_runner(self, *args: Any, **kwargs: Any) -> ModelRunner:
        return DriverRunner(*args, parallel=self.group, **kwargs)

    def share_setup(self, groups: Sequence[KVCacheGroup], decode_kernel: bool) -> None:
        self.group.share_setup(WorkerSetup(list(groups), decode_kernel))

    def failed_build(self, exc: BaseException) -> BaseException:
        """The workers stopped; what to raise for ``exc`` (a worker's own account of a failed collective)."""
        self.group.close()
        if isinstance(exc, ForwardpassError) or not isinstance(exc, Exception):
            return exc
        return self.group.diagnose(exc)


def start_parallel_executor(model_dir: Path, config: EngineConfig) -> tuple[ParallelExecutor, EngineConfig]:
    """Refuse what cannot be split, then start the workers: ``(executor, config)`` for rank 0's build, the
    config carrying the decode-kernel decision every rank takes."""
    cfg = load_model_config(model_dir)
    check_supported(config, ModelSpec.from_config(cfg, name=model_name(model_dir)))
    # every rank builds with the same plan: the decode-kernel decision ("auto": whether it is built yet) is
    # taken once, here, and handed to the workers as a plain yes or no
    from forwardpass.attention.cpu_kernel import resolve_decode_kernel

    kernel = resolve_decode_kernel(config.cpu_kernels, config.device, config.torch_dtype,
                                   config.attention_backend)
    config = dataclasses.replace(config, cpu_kernels=kernel is not None)
    return ParallelExecutor(ParallelGroup.start(str(model_dir), config)), config

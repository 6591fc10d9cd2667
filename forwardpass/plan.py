"""The execution plan: how a model computes, decided once, before it is built.

An engine resolves one :class:`ExecutionPlan` from its ``EngineConfig``, the machine (CPU flags, device) and
the checkpoint (its format), loading the compiled kernels the plan names first
(``models/prepare.py::resolve_plan``); under tensor parallelism each rank's plan carries its group too
(``tensor_parallel``: degree, rank, collectives), set by ``distributed/`` before the rank builds its shard.
The model is then built inside :func:`building_with_plan`: each layer reads the plan once, in its constructor,
and keeps what it needs (a linear layer its weight method, a norm its fused op, the decoder its decode-stack
switch). After the weights are loaded each module post-processes its own weights once
(``process_weights_after_loading``: packing, quantizing); nothing assigns kernels to a model from outside
afterwards.

Models built outside an engine (tests, converters) get :data:`PLAIN`: fp32 weights, the PyTorch paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from forwardpass.parallel_state import TensorParallel


@dataclass(frozen=True)
class CompiledKernels:
    """The compiled CPU kernels an engine decided on (None: the PyTorch path), loaded
    before the model is built."""

    decode: Any = None  # the paged-decode attention kernel (attention/cpu_kernel.py)
    # its extension module: RMSNorm, q/k norm + rotary, SwiGLU, K/V store, the decode stack
    fused_ops: Any = None
    small_matmul: Any = None  # the small-batch fp32 matmul (layers/small_matmul.py)
    small_matmul_module: Any = None  # its module (``panels_view`` for packed weights)


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything that decides which code computes a model, in one frozen record (reported by
    ``layers/weight_report.py::describe_plan``)."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    #: where the weights come from: "hf" (a Hugging Face directory), "gguf" (a llama.cpp file, whose
    #: quantized tensors every method keeps as stored: layers/weight_methods.py ``load_blocks``) or
    #: "ctranslate2" (a faster-whisper model.bin, read into float32, then quantized like any fp32 checkpoint
    #: where the plan says so: models/whisper_ct2.py)
    checkpoint_format: str = "hf"
    #: the projections' block format when quantizing at load ("q8_0", "q4_0"), else None (fp32 or the file's)
    quantized_format: str | None = None
    #: the LM head's (or tied embedding's) format when quantizing: 8 bits in both int8 and int4 modes
    head_format: str | None = None
    #: quantized matmuls use the C++ kernels (False: the PyTorch reference, for tests)
    quant_kernel: bool = True
    #: fp32 projections packed once for oneDNN and read in place by the small-batch kernel (layers/packed.py)
    packed_weights: bool = False
    #: what packed projections are stored in: float32, or a bf16 / fp16 checkpoint's own dtype, upcast to
    #: float32 in the kernel's registers (layers/half_panels.py); computing stays ``dtype``
    weight_storage: torch.dtype = torch.float32
    #: a decode step's Llama-family layers in one C++ call (models/llama_decode_stack.py)
    decode_stack: bool = False
    kv_cache_dtype: torch.dtype = torch.float32
    #: the weights in one 2 MB-page-backed buffer after loading (huge_pages.py)
    huge_pages: bool = False
    #: every kernel chosen so a row's result does not depend on the other rows of its step
    #: (``batch_invariant``)
    batch_invariant: bool = False
    #: makes each adapter-capable projection's LoRA slot at construction (None: no LoRA)
    lora_slot: Callable[[], Any] | None = field(default=None, compare=False, repr=False)
    kernels: CompiledKernels = field(default_factory=CompiledKernels, compare=False, repr=False)
    #: this rank's tensor-parallel group (degree, rank, the collectives of its sharded layers); set per rank
    #: by ``distributed/`` (``ParallelExecutor.rank_plan``, the worker); size 1 (no groups) for one process
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel, compare=False, repr=False)
    #: the kernel builds and GEMM path chosen from the CPU's flags (reported, not read by layers)
    isa: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def fused_ops(self) -> Any:
        return self.kernels.fused_ops

    @property
    def small_matmul(self) -> Any:
        return self.kernels.small_matmul


PLAIN = ExecutionPlan()
_current: list[ExecutionPlan] = []


def current_plan() -> ExecutionPlan:
    """The plan of the model being built (:data:`PLAIN` outside :func:`building_with_plan`)."""
    return _current[-1] if _current else PLAIN


@contextlib.contextmanager
def building_with_plan(plan: ExecutionPlan) -> Iterator[ExecutionPlan]:
    """Build a model's modules with ``plan`` (tensor parallel: its ``tensor_parallel`` group's shard)."""
    _current.append(plan)
    try:
        yield plan
    finally:
        _current.pop()

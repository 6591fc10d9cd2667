"""From a checkpoint to a model ready to compute: the execution plan first, then the model built with it.

:func:`resolve_plan` decides everything that chooses code (weight methods, compiled kernels, decode stack,
huge pages) from the ``EngineConfig``, the machine and the checkpoint, and loads the kernels it names, before
any weight is read. :func:`prepare_model` builds the model inside the plan, loads its weights, lets every
module post-process its own weights once, and places the weights in memory. The single-process engine and
every tensor-parallel rank call these two, and nothing changes a model's kernels afterwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forwardpass import envs
from forwardpass.config import EngineConfig
from forwardpass.errors import ConfigError
from forwardpass.models.model_spec import ModelSpec
from forwardpass.plan import CompiledKernels, ExecutionPlan, building_with_plan

logger = logging.getLogger(__name__)


def resolve_plan(
    config: EngineConfig, model_dir: str | Path, *, lora_slot: Callable[[], Any] | None = None,
    decode_kernel: bool | str | None = None,
) -> ExecutionPlan:
    """The plan for ``model_dir`` under ``config`` on this machine, its compiled kernels loaded.

    ``decode_kernel`` overrides ``config.cpu_kernels`` (a tensor-parallel worker takes its driver's decision,
    so every rank computes the same way); ``lora_slot`` makes each projection's adapter slot
    (``LoRAManager.slot_factory``).
    """
    from forwardpass.attention.cpu_kernel import fused_ops_for, resolve_decode_kernel, small_matmul_for
    from forwardpass.huge_pages import enabled as huge_pages_enabled
    from forwardpass.kernel_build import cpu_flags
    from forwardpass.layers.small_matmul import host_isa as matmul_isa
    from forwardpass.layers.small_matmul import loaded_kernel
    from forwardpass.loader.config import load_model_config
    from forwardpass.loader.ctranslate2 import is_converted_dir
    from forwardpass.loader.gguf import is_gguf_dir
    from forwardpass.models.weight_path_checks import check_weight_path
    from forwardpass.quant import QUANTIZATIONS
    from forwardpass.quant.apply import HEAD_FORMAT
    from forwardpass.quant.kernel import gemm_path, load_quant_kernel
    from forwardpass.quant.kernel import host_isa as quant_isa

    dtype = config.torch_dtype
    gguf = is_gguf_dir(model_dir)
    checkpoint_format = "gguf" if gguf else "ctranslate2" if is_converted_dir(model_dir) else "hf"
    fmt = QUANTIZATIONS[config.quantization] if config.quantization is not None else None
    # refusals first, before any kernel is built (a GGUF file's types: loader/gguf.py::check_gguf_dir)
    if not gguf:
        check_weight_path(load_model_config(model_dir), ExecutionPlan(quantized_format=fmt))
    if config.batch_invariant:
        check_batch_invariant(config, model_dir)
    mode = config.cpu_kernels if decode_kernel is None else decode_kernel
    if config.batch_invariant:
        mode = True  # its attention is the paged kernel for every query: built now, never a background build
    kernel = resolve_decode_kernel(mode, config.device, dtype, config.attention_backend)
    ops, small = fused_ops_for(kernel), small_matmul_for(kernel)
    if config.batch_invariant and (kernel is None or small is None):
        raise ConfigError("batch_invariant needs the compiled CPU kernels (paged attention, small-batch "
                          "matmul), which could not be built here (see the warning above)",
                          param="batch_invariant")
    isa = {"small_matmul": matmul_isa()} if small is not None else {}
    if fmt is not None or gguf:  # built now, before the model: an engine never swaps kernels mid-run
        if load_quant_kernel() is None and config.batch_invariant:
            raise ConfigError("batch_invariant with quantized weights needs the C++ quantized-matmul kernel, "
                              "which could not be built here", param="batch_invariant")
        isa.update(quant_matmul=quant_isa(), quant_gemm=gemm_path(cpu_flags()))
    packed = small is not None and envs.get("FORWARDPASS_PACKED_WEIGHTS")
    return ExecutionPlan(
        device=config.device,
        dtype=dtype,
        checkpoint_format=checkpoint_format,
        quantized_format=fmt,
        head_format=HEAD_FORMAT if fmt is not None else None,
        packed_weights=packed,
        weight_storage=(half_storage(model_dir, dtype) if packed and fmt is None and checkpoint_format == "hf"
                        else torch.float32),
        # kept by the batch-invariant plan: the stack calls the same kernels as the layers, so a pure decode
        # step computes bitwise what a mixed step's layers do (tests/test_batch_invariance.py runs both kinds)
        decode_stack=ops is not None,
        batch_invariant=config.batch_invariant,
        kv_cache_dtype=config.torch_kv_dtype,
        huge_pages=config.device == "cpu" and huge_pages_enabled(),
        lora_slot=lora_slot,
        kernels=CompiledKernels(decode=kernel, fused_ops=ops, small_matmul=small,
                                small_matmul_module=loaded_kernel() if small is not None else None),
        isa=isa,
    )  # fmt: skip


def half_storage(model_dir: str | Path, dtype: torch.dtype) -> torch.dtype:
    """What a CPU engine computing in ``dtype`` keeps a Hugging Face checkpoint's packed projections in: its
    own bfloat16 / float16 where it computes in float32 (layers/half_panels.py: the kernel upcasts them in
    registers, exactly), else float32. ``FORWARDPASS_HALF_WEIGHTS=0`` keeps float32."""
    from forwardpass.models.model_spec import load_model_spec

    if dtype != torch.float32 or not envs.get("FORWARDPASS_HALF_WEIGHTS"):
        return torch.float32
    return load_model_spec(model_dir).half_dtype or torch.float32


def check_batch_invariant(config: EngineConfig, model_dir: str | Path) -> None:
    """Refuse, before any work, a batch-invariant plan this engine could not keep: the guarantee rests on
    kernels whose rows do not interact (models/prepare.py, layers/weight_methods.py, attention/layer.py), and
    only the model classes that use nothing else for their math say ``batch_invariant_supported``."""
    from forwardpass.loader.config import load_model_config
    from forwardpass.models.registry import resolve_model_class

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"batch_invariant: {why}", param="batch_invariant")

    if config.device != "cpu" or config.torch_dtype != torch.float32:
        raise refuse("its kernels are the CPU fp32 ones; use device='cpu', dtype float32")
    if config.cpu_kernels is False:
        raise refuse("it computes with the compiled CPU kernels; leave cpu_kernels on")
    from forwardpass.attention.layer import KERNEL_CACHE_DTYPES  # the caches the paged kernel reads

    if config.torch_kv_dtype not in KERNEL_CACHE_DTYPES:
        kinds = ", ".join(str(d).removeprefix("torch.") for d in KERNEL_CACHE_DTYPES)
        raise refuse(f"the paged kernel reads {kinds} caches, not {config.kv_cache_dtype}")
    if config.enable_lora:
        raise refuse("LoRA adapters are applied with batched matmuls whose rows interact; not with "
                     "enable_lora")
    if config.tensor_parallel_size > 1:
        raise refuse("not verified with tensor parallelism; use tensor_parallel_size=1")
    arch = load_model_config(model_dir).architecture
    if not getattr(resolve_model_class(arch), "batch_invariant_supported", False):
        raise refuse(f"{arch} computes with layers the batch-invariant kernels do not cover (MoE experts, "
                     "MLA, state-space or linear attention, attention logit caps); dense Llama-family models "
                     f"(Llama, Mistral, Qwen2, Qwen3) have it")


def process_weights_after_loading(model: nn.Module) -> None:
    """Every module's own post-processing of its loaded weights, children before their parents (a decoder's
    stack is built over layers that already hold their final weights)."""
    with torch.no_grad():
        for module in reversed(list(model.modules())):
            process = getattr(module, "process_weights_after_loading", None)
            if process is not None:
                process()


def prepare_model(model_dir: str | Path, plan: ExecutionPlan) -> tuple[nn.Module, ModelSpec]:
    """``(model, spec)``: built with ``plan``, weights loaded (a Hugging Face directory or a GGUF file's),
    each module's weights post-processed once, the whole on 2 MB pages where the plan says so. Tensor
    parallel: a plan with the rank's group (``plan.tensor_parallel``): each rank builds, loads its shard."""
    from forwardpass.huge_pages import move_model_to_huge_pages
    from forwardpass.models.gguf_weights import load_gguf_model
    from forwardpass.models.loading import load_model
    from forwardpass.models.whisper_ct2 import load_ctranslate2_whisper

    # the format resolve_plan found (a llama.cpp file, a CTranslate2 model.bin, safetensors): not probed again
    loaders = {"gguf": load_gguf_model, "ctranslate2": load_ctranslate2_whisper, "hf": load_model}
    t0 = time.perf_counter()
    with building_with_plan(plan):
        net, spec = loaders[plan.checkpoint_format](model_dir, plan.dtype, plan.device)
    process_weights_after_loading(net)
    # decode streams every weight once per step: 2 MB pages; after packing, which drops copies
    if plan.huge_pages:
        move_model_to_huge_pages(net)
    size = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    logger.info("loaded %s in %.2fs: %.1f MB of weights", model_dir, time.perf_counter() - t0, size / 1e6)
    return net, spec

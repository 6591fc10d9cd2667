"""Build a model from a directory: config.json → ``ModelSpec`` → class from the registry → weights,
tensor by tensor.

Parameters are allocated empty and each checkpoint tensor is read from the memory-mapped safetensors
file straight into its parameter (or its slice of a merged parameter), so the process never holds a
second full copy of the weights.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from forwardpass.errors import MissingFileError
from forwardpass.loader.config import load_model_config
from forwardpass.loader.weights import WeightSource, checkpoint_names, find_weight_files, load_into
from forwardpass.models.model_spec import ModelSpec, model_name
from forwardpass.models.registry import resolve_model_class
from forwardpass.plan import current_plan


def load_weights(model: nn.Module, source: WeightSource) -> None:
    # tensor parallel (the plan the model is built under): this rank's slices only, read with get_slice
    if current_plan().tensor_parallel.enabled:
        from forwardpass.models.parallel_loading import load_sharded

        load_sharded(model, source)
        return
    custom = getattr(model, "load_weights", None)
    if custom is not None:  # architectures with special layouts (e.g. stacked experts) load themselves
        custom(source)
        return
    for name, param in model.named_parameters():
        for ckpt_name, span in checkpoint_names(model, name):
            target = param if span is None else param[span[0] : span[1]]
            load_into(target, source, ckpt_name)


class _NoInitOnMeta(TorchFunctionMode):
    """A model built on the meta device (to read its layers' cache specs) has nothing to initialise: the
    ``torch.nn.init`` functions (``nn.Embedding``'s ``normal_``, ``nn.Conv1d``'s ``kaiming_uniform_``) return
    their tensor untouched. Run, they go through torch's Python reference ops on meta tensors, whose first
    call imports torch._dynamo, sympy and triton: seconds of a command's start-up."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """The model class of ``spec.architecture`` built from ``spec``, parameters allocated, not loaded."""
    cls = resolve_model_class(spec.architecture)
    meta = torch.device(device).type == "meta"
    with torch.device(device), (_NoInitOnMeta() if meta else contextlib.nullcontext()):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(spec)
        finally:
            torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[nn.Module, ModelSpec]:
    """Return ``(model, spec)`` for a Hugging Face model directory."""
    cfg = load_model_config(model_dir)
    if not cfg.architecture:
        raise MissingFileError(f"{Path(model_dir) / 'config.json'} has no 'architectures' entry naming the "
                               "model class")
    resolve_model_class(cfg.architecture)  # fail on an unknown architecture before reading its fields
    spec = ModelSpec.from_config(cfg, name=model_name(model_dir))
    find_weight_files(model_dir)
    source = WeightSource.from_dir(model_dir)
    model = build_model(spec, dtype, device)
    with torch.no_grad():
        load_weights(model, source)
    return model, spec

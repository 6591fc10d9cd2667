"""The ``auto`` settings that depend on the checkpoint, decided once before the plan: what an ``EngineConfig``
left at ``auto`` means for this model directory.

The K/V cache (``kv_cache_dtype="auto"``) of an engine that computes in float32 on CPU is kept narrower where
the checkpoint is: a GGUF file's in float16, llama.cpp's default for its files (the same rounding as that
peer); a bfloat16 or float16 checkpoint's in its own dtype (what serving it in its dtype would keep; vLLM
keeps the cache in the model's dtype). Half the bytes a decode step's attention reads: a 16-sequence step of
SmolLM2-135M's Q4_1 file 47 -> 37 ms on a Zen 3 core pair. Only for models whose every cache is plain keys and
values (the layers that keep latents, states or encoder outputs compute in the model's dtype);
``kv_cache_dtype`` set explicitly is kept."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from forwardpass.config import EngineConfig

logger = logging.getLogger(__name__)

_NARROW = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def checkpoint_kv_dtype(model_dir: Path, config: EngineConfig, *, gguf: bool) -> str | None:
    """The K/V cache dtype ``auto`` means for this checkpoint (None: the model's dtype)."""
    if config.kv_cache_dtype != "auto" or config.device != "cpu" or config.torch_dtype != torch.float32:
        return None
    if gguf:
        return "float16"
    try:
        from forwardpass.attention.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
        from forwardpass.engine.scheduling.kv_cache_spec import layer_specs
        from forwardpass.models.model_spec import load_model_spec

        spec = load_model_spec(model_dir)
        stored = spec.half_dtype
        if stored is None:
            return None
        caches = layer_specs(spec, config.block_size, config.torch_dtype)
        if any(c is not None and type(c) not in (FullAttentionSpec, SlidingWindowSpec) for c in caches):
            return None
        return _NARROW[stored]
    except Exception as exc:  # noqa: BLE001 - a directory the spec cannot read here keeps the model's dtype
        logger.debug("no checkpoint default for the KV cache of %s: %s", model_dir, exc)
        return None


def with_checkpoint_defaults(config: EngineConfig, model_dir: str | Path) -> EngineConfig:
    """``config`` with the ``auto`` settings that depend on ``model_dir`` decided (module docstring)."""
    from forwardpass.loader.gguf import is_gguf_dir

    kv = checkpoint_kv_dtype(Path(model_dir), config, gguf=is_gguf_dir(model_dir))
    return config if kv is None else replace(config, kv_cache_dtype=kv)

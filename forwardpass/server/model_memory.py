"""The memory a served model is expected to take once loaded, which ``--models-memory`` counts.

One function, deliberately simple: the bytes of its weight files (what the loader reads, near enough what it
holds) plus the KV cache the engine configuration asks for (``kv_cache_memory``, or ``num_kv_blocks`` blocks
of ``block_size`` tokens, or the engine's default). It is an estimate to refuse a load *before* the OS kills
the process halfway through it; a finer one (activations, kernels' workspaces) can replace it here.
"""

from __future__ import annotations

from pathlib import Path

from forwardpass.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig

#: weight files, by name: what the loaders read (safetensors, PyTorch, GGUF, CTranslate2)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_bytes(source: Path) -> int:
    """The bytes of the weights at ``source``: a weight file, or the weight files under a directory."""
    if source.is_file():
        return source.stat().st_size
    return sum(f.stat().st_size for f in source.rglob("*") if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)


def kv_cache_bytes(config: EngineConfig, kv_bytes_per_token: float) -> int:
    """The KV cache the engine will allocate for ``config`` (per rank)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if config.num_kv_blocks is not None:
        return int(config.num_kv_blocks * config.block_size * kv_bytes_per_token)
    return DEFAULT_KV_CACHE_MEMORY


def model_memory_estimate(source: Path, config: EngineConfig | None = None,
                          kv_bytes_per_token: float = 0.0) -> int:
    """Weights at ``source`` plus, for a model with an engine (``config``), its KV cache, in bytes."""
    kv = kv_cache_bytes(config, kv_bytes_per_token) if config is not None else 0
    return weight_bytes(source) + kv

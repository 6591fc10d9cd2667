"""Memory before the OS: what a model needs (its weights as the engine will hold them, plus the KV cache the
engine allocates) against what this process may use, checked before a byte of weights is read.

Without it a model too large for the machine is loaded until the kernel's out-of-memory killer ends the
engine process, minutes in, with no word of why. :func:`model_memory_need` is the estimate (one function, so a
server holding several models budgets each one with the same numbers); :func:`available_memory` the smallest
of the cgroup's limit (``memory.max`` less what the group already uses; containers), ``MemAvailable``
(/proc/meminfo) and the address-space limit (``ulimit -v``, less what this process has mapped);
:func:`check_memory` refuses with the numbers and the flags that lower them.

The estimate is a floor, not a forecast: parameters times the bytes each is kept in (the engine's dtype, or
its quantized blocks; a GGUF file's tensors as stored), plus the KV pool (``--kv-cache-memory``, or
``--num-kv-blocks`` blocks). Activations, the runtime and the tokenizer come on top, so a refusal is certain
to be right, and a model that passes can still be tight.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from forwardpass.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from forwardpass.errors import ConfigError

GIB = float(1 << 30)
#: bytes per parameter of the load-time quantizations (Q8_0: 34 bytes per 32; Q4_0: 18 per 32)
_QUANTIZED_BYTES = {"int8": 34 / 32, "int4": 18 / 32}


class InsufficientMemoryError(ConfigError):
    """The model's weights and KV cache cannot fit in the memory this process may use."""


@dataclass(frozen=True)
class MemoryNeed:
    weights_bytes: int
    kv_cache_bytes: int
    weights_how: str  # how the weights' bytes were counted (for the message)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


@dataclass(frozen=True)
class AvailableMemory:
    bytes: int
    source: str  # which limit is the smallest (the message names it)


def model_memory_need(model_dir: str | Path, config: EngineConfig) -> MemoryNeed:
    """The bytes the engine will hold for the model in ``model_dir`` under ``config``: weights + KV pool.
    Reads headers only (config.json, a GGUF file's tensor table)."""
    from forwardpass.loader.config import load_model_config
    from forwardpass.loader.gguf import gguf_file, is_gguf_dir
    from forwardpass.models.accounting import params
    from forwardpass.models.model_spec import ModelSpec

    spec = ModelSpec.from_config(load_model_config(model_dir))
    if is_gguf_dir(model_dir):  # quantized tensors stay in their blocks: the file's tensor bytes
        from forwardpass.loader.gguf_header import scan_gguf_header

        weights = sum(t.num_bytes for t in scan_gguf_header(gguf_file(model_dir)).tensors)
        how = "the GGUF file's tensors as stored"
    elif config.quantization in _QUANTIZED_BYTES:
        per = _QUANTIZED_BYTES[config.quantization]
        weights, how = int(params(spec) * per), f"{params(spec):,} parameters in {config.quantization} blocks"
    else:
        per = config.torch_dtype.itemsize
        weights, how = params(spec) * per, f"{params(spec):,} parameters x {per} bytes"
    if config.num_kv_blocks is not None:
        per_token = spec.kv_bytes_per_token(config.torch_kv_dtype.itemsize)
        kv = int(config.num_kv_blocks * config.block_size * per_token)
    else:
        kv = config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    return MemoryNeed(int(weights), int(kv), how)


#: weight files, by name: what the loaders read (safetensors, PyTorch, GGUF, CTranslate2)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_file_bytes(source: str | Path) -> int:
    """The bytes of the weight files at ``source`` (a file, or those under a directory): the estimate of a
    model with no engine (an encoder, a diffusion pipeline), whose weights are held about as stored."""
    source = Path(source)
    if source.is_file():
        return source.stat().st_size
    return sum(f.stat().st_size for f in source.rglob("*") if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_memory() -> AvailableMemory:
    """The bytes this process may still allocate: the smallest of the limits that apply here."""
    found: list[tuple[int, str]] = []
    try:
        meminfo = Path("/proc/meminfo").read_text()
        kb = next(int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
        found.append((kb * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(limit_file)
        if limit is not None and limit < 1 << 60:  # cgroup v1 says "no limit" with a huge number
            found.append((max(0, limit - (_read_int(usage_file) or 0)), f"the cgroup limit ({limit_file})"))
            break
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        mapped = 0
        try:
            mapped = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text()
                          .splitlines() if line.startswith("VmSize:"))
        except (OSError, StopIteration, ValueError):
            pass
        found.append((max(0, soft - mapped), "the address-space limit (ulimit -v)"))
    if not found:
        return AvailableMemory(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory")
    return AvailableMemory(*min(found))


def check_memory(model_dir: str | Path, config: EngineConfig, max_memory: int | None = None) -> MemoryNeed:
    """Refuse (``InsufficientMemoryError``) a model whose weights + KV cache exceed the memory available, or
    ``max_memory`` bytes when given (``--max-memory``); the need, when it fits."""
    need = model_memory_need(model_dir, config)
    avail = available_memory()
    if max_memory is not None and max_memory < avail.bytes:
        avail = AvailableMemory(max_memory, "--max-memory")
    if need.total_bytes > avail.bytes:
        lower = ["--kv-cache-memory BYTES or --num-kv-blocks N (a smaller KV cache)"]
        if not need.weights_how.startswith("the GGUF") and config.quantization is None:
            lower.append("--quantization int8 or int4 (weights in 8- or 4-bit blocks)")
        lower.append("a smaller model")
        raise InsufficientMemoryError(
            f"the model needs at least {need.total_bytes / GIB:.2f} GiB (weights "
            f"{need.weights_bytes / GIB:.2f} GiB: {need.weights_how}; KV cache "
            f"{need.kv_cache_bytes / GIB:.2f} GiB) but {avail.bytes / GIB:.2f} GiB is available "
            f"({avail.source}); lower it with "
            + ", ".join(lower), param="max_memory")
    return need

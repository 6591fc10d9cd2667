"""EngineConfig: everything about *how* a model is served, as opposed to what the model is."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch

from forwardpass.errors import ConfigError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """``auto`` means float32 on CPU: without native bf16 (AVX512-BF16/AMX) torch's bf16 matmul on CPU
    runs ~300× slower than fp32 (0.3 vs 98 GFLOP/s measured on the AVX2 machines we test on), so a bf16
    checkpoint computes in float32 (its projections kept in bf16 and upcast in the kernel's registers:
    ``layers/half_panels.py``). On CUDA ``auto`` means bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16",
                          param="dtype") from None


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")  # docs/speculative.md


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, spelled as vLLM's ``speculative_config`` (docs/speculative.md).

    ``ngram`` (prompt lookup): the longest n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens)
    ending the sequence that also occurs earlier in its prompt + output proposes the up to
    ``num_speculative_tokens`` tokens that followed it; one forward pass verifies them all.
    ``draft_model``: ``model`` (a name, directory or ``.gguf`` file sharing the target's tokenizer) proposes
    the drafts, running in the engine with its own small KV cache (engine/speculative/draft.py).
    ``mtp``: the checkpoint's own next-token-prediction layer (DeepSeek-V3's ``num_nextn_predict_layers``)
    proposes them from the target's hidden states (engine/speculative/mtp.py).
    ``disable_by_batch_size``: no proposals while more sequences than this run (the step is no longer
    memory-bound, so verifying k extra tokens per sequence costs about k times more; None: never).
    ``adaptive``: per request, stop proposing while its measured acceptance makes a verify step a loss.
    """

    method: str = "ngram"
    model: str | None = None  # draft_model: the draft (a model name, a directory or a .gguf file)
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # ~ the ridge of a CPU decode step: fp32 weights give B/2 FLOP per weight byte at batch B, and a
    # 2-core AVX2 machine reaches ~100-200 GFLOP/s against ~10-20 GB/s, so above ~16-32 tokens per step
    # the extra tokens of a verify are no longer nearly free
    disable_by_batch_size: int | None = 16
    adaptive: bool = True
    # draft_model: the draft's weight-only quantization at load ("int8", "int4", None: as stored); "auto":
    # int8 on CPU where the draft loads fp32 weights (its precision moves only acceptance, never the output)
    quantization: str | None = "auto"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.method!r}",
                              param="speculative_config.method")
        if isinstance(self.model, os.PathLike):  # a pathlib.Path from the Python API
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model.strip()):
            raise ConfigError("speculative_config.model: method draft_model needs the draft model (a name "
                              "from `forwardpass models`, a directory or a .gguf file with the target's "
                              "tokenizer), "
                              f"got {self.model!r}", param="speculative_config.model")
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f"speculative_config.model applies to method draft_model, not {self.method!r}",
                              param="speculative_config.model")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config.{name} must be a positive integer, got {value!r}",
                                  param=f"speculative_config.{name}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                              f"prompt_lookup_max ({self.prompt_lookup_max})",
                              param="speculative_config.prompt_lookup_min")
        if self.quantization not in (None, "auto", "int8", "int4"):
            raise ConfigError(f"speculative_config.quantization must be 'auto', 'int8', 'int4' or None, got "
                              f"{self.quantization!r}", param="speculative_config.quantization")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ConfigError(f"speculative_config.disable_by_batch_size must be a positive integer or None, "
                              f"got {b!r}", param="speculative_config.disable_by_batch_size")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A ``SpeculativeConfig`` from itself, a dict (vLLM's spelling; unknown keys refused) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                              f"'num_speculative_tokens': 4}}, got {type(value).__name__}",
                              param="speculative_config")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(sorted(known))}", param=f"speculative_config.{unknown[0]}")
        return cls(**value)


@dataclass
class EngineConfig:
    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV budget as a block count ...
    kv_cache_memory: int | None = None  # ... or in bytes (default: 1 GiB)
    max_model_len: int | None = None  # default: min(max_position_embeddings, what the KV budget holds)
    max_num_seqs: int = 64  # sequences in one forward pass at most
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decode tokens)
    # fairness: with every batch slot taken, a newcomer swaps out a sequence that generated this many
    # tokens or more (see engine/scheduling/scheduler.py). Off (0) by default: offline batches want
    # throughput, first come first served; `forwardpass serve` turns it on (--fair-share-tokens, default 32).
    fair_share_tokens: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str = "sdpa"  # how attention scores are computed: "sdpa", "naive" or "flash"
    # compiled C++ paged-decode kernel on CPU, decided once when the engine is built: "auto" (use it
    # if already built, else build it in the background for later runs), True (build now and wait,
    # e.g. for benchmarks), False (PyTorch path only); see attention/cpu_kernel.py
    cpu_kernels: bool | str = "auto"
    seed: int = 0
    max_stats_records: int = 10_000  # per-step records kept in memory
    # LoRA adapters, applied unmerged so requests with different adapters share a batch
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one batch
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded (least recently used evicted)
    # weight-only quantization at load (CPU): "int8" (Q8_0 blocks), "int4" (Q4_0 blocks) or None (the
    # checkpoint's weights in `dtype`); see forwardpass/quant/apply.py
    quantization: str | None = None
    # what the paged K/V are stored in: "auto" (the model's dtype), "float16" or "bfloat16". Half the bytes of
    # an fp32 cache: twice the context in the same memory, and decode attention (which reads the whole cache
    # every step) reads half as much. Values are rounded once when stored; attention computes in the model's
    # dtype. Plain K/V caches only (Llama-family attention); see engine/builder.py
    kv_cache_dtype: str = "auto"
    # tensor parallelism (forwardpass/distributed): the model split across this many processes (ranks),
    # each holding 1/N of the weights and of the KV cache (kv_cache_memory / num_kv_blocks are per rank)
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: whole experts per rank instead of every expert split
    distributed_timeout_s: float = 60.0  # a collective that waits longer fails the engine (a hung rank)
    # every kernel chosen so that a request's greedy tokens and logprobs are bitwise the same whatever else
    # shares its steps (batch size, chunking, other requests): one matmul kernel for every batch size, every
    # query's attention through the paged kernel; costs prefill speed (see models/prepare.py,
    # benchmarks/batch_invariance.py)
    batch_invariant: bool = False
    # speculative decoding (docs/speculative.md): a SpeculativeConfig, or vLLM's dict spelling
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ConfigError("speculative_config is not supported with tensor_parallel_size > 1 yet",
                              param="speculative_config")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)
        if isinstance(self.fair_share_tokens, bool) or not isinstance(self.fair_share_tokens, int) \
                or self.fair_share_tokens < 0:
            raise ConfigError("fair_share_tokens must be an integer >= 0 (0: off), got "
                              f"{self.fair_share_tokens!r}", param="fair_share_tokens")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}", param="num_kv_blocks")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}",
                              param="kv_cache_memory")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}", param="max_model_len")
        if not self.distributed_timeout_s > 0:
            raise ConfigError(f"distributed_timeout_s must be > 0 seconds, got {self.distributed_timeout_s}",
                              param="distributed_timeout_s")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ConfigError("enable_expert_parallel needs tensor_parallel_size >= 2 (the ranks the experts "
                              "are spread over)", param="enable_expert_parallel")
        if self.cpu_kernels not in (True, False, "auto"):
            raise ConfigError(f"cpu_kernels must be True, False or 'auto', got {self.cpu_kernels!r}",
                              param="cpu_kernels")
        if self.quantization is not None:
            from forwardpass.quant import QUANTIZATIONS

            if self.quantization not in QUANTIZATIONS:
                raise ConfigError(f"unknown quantization {self.quantization!r}; use "
                                  f"{' or '.join(QUANTIZATIONS)}", param="quantization")
            if not self.device.startswith("cpu"):
                raise ConfigError("quantization (int8/int4 weights) is a CPU feature; on CUDA use bfloat16",
                                  param="quantization")
        self.torch_dtype = resolve_dtype(self.dtype, self.device)
        if self.quantization is not None and self.torch_dtype != torch.float32:
            raise ConfigError("quantization computes in float32: leave dtype at auto/float32", param="dtype")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use "
                              f"{', '.join(KV_CACHE_DTYPES)}", param="kv_cache_dtype")
        kv = KV_CACHE_DTYPES[self.kv_cache_dtype]
        self.torch_kv_dtype = self.torch_dtype if kv is None else kv


#: kv_cache_dtype values → the cache's dtype (None: the model's)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float16": torch.float16,
                                                  "bfloat16": torch.bfloat16}


DEFAULT_KV_CACHE_MEMORY = 1 << 30

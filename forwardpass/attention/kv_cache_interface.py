"""What a layer keeps per token or per request: the ``KVCacheSpec`` kinds (vLLM's ``kv_cache_interface.py``).

Each cache-owning layer declares its cache with ``kv_cache_spec(spec, block_size, dtype)``: a mapping from
cache id (``ctx.kv_caches`` index, usually the layer's index) to the spec of that cache (None: the id is its
own but holds nothing). ``engine/scheduling/kv_cache_spec.py::layer_specs`` walks the model's modules asking
them; the KV cache manager and the model runner only ever ask the spec:

* ``blocks_needed(num_tokens)`` — how long a sequence's block table is after ``num_tokens`` tokens;
* ``freeable_prefix_blocks(num_computed_tokens)`` — leading table entries no later query reads (freed at
  once);
* ``max_blocks_per_sequence(max_model_len, max_chunk)`` — the most blocks one sequence ever holds;
* ``page_bytes_per_layer`` / ``cache_shape`` / ``cache_dtype`` — what one block costs and how the tensor
  looks;
* ``supports_prefix_caching`` — whether a block's content is a pure function of the prefix and stays
  available;
* ``metadata_builder(device)`` — the builder of its group's per-step attention metadata (``metadata.py``):
  each kind names its own (``metadata_builder_cls``), so a new kind brings its builder and the runner needs no
  edit.

The kinds here: K and V pages (``FullAttentionSpec``), pages freed behind a window (``SlidingWindowSpec``),
the latent of multi-latent attention (``MLASpec``), one fixed-size slot per request (``StateSpec``: Mamba2,
Gated DeltaNet), a request's cross-attention K/V (``CrossAttentionSpec``: Whisper). A family with a cache of
its own defines its kind next to its model (DeepSeek-V4: ``models/deepseek_v4_cache_spec.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from forwardpass.attention.metadata import (
    GroupMetadataBuilder,
    MetadataBuilder,
    MetadataBuilderFactory,
    StateMetadataBuilder,
)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()



class AttentionShape(Protocol):
    """What a layer reads of the model's spec to declare its cache (``ModelSpec`` has these; it lives in
    ``models/``, above this package)."""

    heads: int
    kv_heads: int
    head_dim: int

@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # tokens per block

    #: the class that builds this kind's attention metadata each step, called as ``cls(spec, device)``
    metadata_builder_cls: ClassVar[MetadataBuilderFactory] = GroupMetadataBuilder

    def metadata_builder(self, device: str | torch.device) -> MetadataBuilder:
        return self.metadata_builder_cls(self, device)

    @property
    def page_bytes_per_layer(self) -> int:
        raise NotImplementedError

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def freeable_prefix_blocks(self, num_computed_tokens: int) -> int:
        """Leading table entries no query at position >= ``num_computed_tokens`` reads (none here)."""
        return 0

    def max_blocks_per_sequence(self, max_model_len: int, max_chunk: int) -> int:
        """The most blocks one sequence of up to ``max_model_len`` tokens holds at once when each
        step computes at most ``max_chunk`` of its tokens."""
        return self.blocks_needed(max_model_len)

    @property
    def supports_prefix_caching(self) -> bool:
        return True

    @property
    def tokens_per_block(self) -> int:
        """Sequence tokens one block covers (a compressed-entry block covers ``block_size · rate``)."""
        return self.block_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor for ``num_blocks`` blocks."""
        raise NotImplementedError

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the cache tensor: the model's, unless the kind keeps its own."""
        return model_dtype


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V of every token of every head: ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer.

    Sliding-window layers are stored this way too until their pages are freed outside the window;
    their attention masks the keys beyond it."""

    num_kv_heads: int = 1
    head_dim: int = 1
    dtype: torch.dtype = torch.float32

    @property
    def page_bytes_per_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * _element_size(self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype  # kv_cache_dtype may be narrower than the model


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full-attention pages for layers whose queries see only the last ``sliding_window`` keys
    (the query's own position included): blocks behind the window are freed as the sequence grows."""

    sliding_window: int = 1

    def freeable_prefix_blocks(self, num_computed_tokens: int) -> int:
        # the next query sits at position num_computed_tokens; the oldest key it sees is W - 1 behind
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def max_blocks_per_sequence(self, max_model_len: int, max_chunk: int) -> int:
        # a step's chunk of C queries needs the W - 1 keys before it plus its own C, possibly
        # straddling one more block boundary
        live = -(-(self.sliding_window - 1 + max_chunk) // self.block_size) + 1
        return min(self.blocks_needed(max_model_len), live)

    @property
    def supports_prefix_caching(self) -> bool:
        return False


def attention_spec(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, sliding_window: int | None = None
) -> FullAttentionSpec:
    """K/V pages of one attention layer: windowed when it has a window."""
    if sliding_window is None:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 dtype=dtype)
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                             sliding_window=sliding_window)


@dataclass(frozen=True)
class MLASpec(KVCacheSpec):
    """Multi-latent attention: per token and layer one vector of ``latent_dim`` values, the
    compressed KV (``kv_lora_rank``) followed by the shared rotary key (``qk_rope_head_dim``)."""

    latent_dim: int = 1
    dtype: torch.dtype = torch.float32

    @property
    def page_bytes_per_layer(self) -> int:
        return self.block_size * self.latent_dim * _element_size(self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """A fixed-size per-request state (Mamba2: conv window then SSM state, ``state_size`` values per
    layer): one "block" per sequence, however long it grows. States stay in float32 by default whatever the
    weights' dtype: they accumulate over the whole sequence."""

    state_size: int = 1
    dtype: torch.dtype = torch.float32

    metadata_builder_cls: ClassVar[MetadataBuilderFactory] = StateMetadataBuilder

    @property
    def page_bytes_per_layer(self) -> int:
        return self.state_size * _element_size(self.dtype)

    def blocks_needed(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    @property
    def supports_prefix_caching(self) -> bool:
        return False

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.state_size)

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype


@dataclass(frozen=True)
class CrossAttentionSpec(StateSpec):
    """One request's cross-attention K and V (``engine/scheduling/cross_attention_spec.py``):
    ``[2, encoder_len, num_heads, head_dim]`` per layer, in the model's dtype (they are projections, not
    accumulated states)."""

    encoder_len: int = 1
    num_heads: int = 1
    head_dim: int = 1

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, 2, self.encoder_len, self.num_heads, self.head_dim)

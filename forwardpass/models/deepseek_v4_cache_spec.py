"""The cache of compressed attention (DeepSeek-V4): what each layer keeps, split into three specs.

A DeepSeek-V4 layer attends to the last ``window`` tokens and, in a CSA / HCA layer, to compressed
entries of its whole history (one per ``compress_rate`` tokens). Three kinds of memory, each in the
group its lifetime calls for:

* **sliding K=V pages** (``SharedKVSlidingSpec``, cache index = the layer): one vector per token (the key
  is the value), freed behind the window like any windowed layer;
* **compressed entries** (``CompressedSpec``, cache index ``dsv4.entries_cache_id(layer)``): they grow
  with the sequence (``L / m`` of them), so they are paged like KV, keyed by *compressed* position:
  entry ``e`` lives in block ``table[e // block_size]`` at offset ``e % block_size``, and a sequence of
  ``n`` tokens holds ``ceil((n // m) / block_size)`` blocks. Read by every later query, never freed
  before the request ends; its group's metadata is a ``CompressedMetadata`` (``CompressedMetadataBuilder``);
* **the compressor's open windows** (``StateSpec``, cache index ``dsv4.state_cache_id(layer)``): the
  kv / gate projections of the tokens not yet pooled (and, for CSA, of the closed window whose first
  series joins the next entry): at most ``2m - 1`` tokens, so a fixed-size slot per request, taken at
  admission, carried across chunks, dropped on preemption (recompute rebuilds it) and at finish.

No prefix caching (the sliding pages are reused as soon as they leave the window). ``DeepseekV4Attention``
declares its layer's three caches with :func:`layer_cache_specs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from forwardpass.attention.kv_cache_interface import KVCacheSpec, SlidingWindowSpec, StateSpec
from forwardpass.attention.metadata import CompressedMetadataBuilder, MetadataBuilderFactory

if TYPE_CHECKING:
    from forwardpass.models.deepseek_v4_spec import DeepseekV4Spec


@dataclass(frozen=True)
class SharedKVSlidingSpec(SlidingWindowSpec):
    """A sliding window whose key and value are one vector (one plane, ``[num_blocks, block_size, head_dim]``
    per layer, ``num_kv_heads`` = 1): half the pages of a K and V layout."""

    @property
    def page_bytes_per_layer(self) -> int:
        return self.block_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.head_dim)


@dataclass(frozen=True)
class CompressedSpec(KVCacheSpec):
    """Compressed entries of one layer kind: ``entry_dim`` values per entry, one entry per
    ``compress_rate`` tokens, ``block_size`` entries per block (``[num_blocks, block_size, entry_dim]``)."""

    compress_rate: int = 1
    entry_dim: int = 1
    dtype: torch.dtype = torch.float32

    metadata_builder_cls: ClassVar[MetadataBuilderFactory] = CompressedMetadataBuilder

    @property
    def page_bytes_per_layer(self) -> int:
        return self.block_size * self.entry_dim * torch.empty((), dtype=self.dtype).element_size()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-(num_tokens // self.compress_rate) // self.block_size)

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.compress_rate

    @property
    def supports_prefix_caching(self) -> bool:
        return False

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.entry_dim)


def layer_cache_specs(
    v4: DeepseekV4Spec, layer: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> dict[int, KVCacheSpec | None]:
    """Layer ``layer``'s caches by cache id: its sliding K=V pages at ``layer``, its compressed entries at
    ``entries_cache_id`` and its compressor state at ``state_cache_id`` (None there for
    a sliding-only layer)."""
    out: dict[int, KVCacheSpec | None] = {
        layer: SharedKVSlidingSpec(block_size=block_size, num_kv_heads=1, head_dim=head_dim, dtype=dtype,
                                   sliding_window=v4.window),
        v4.entries_cache_id(layer): None,
        v4.state_cache_id(layer): None,
    }
    rate = v4.compress_rates[layer]
    if rate:
        out[v4.entries_cache_id(layer)] = CompressedSpec(
            block_size=block_size, compress_rate=rate, entry_dim=v4.entry_dim(layer), dtype=dtype
        )
        # states in float32 (as the other state slots); the projections are copied in exactly
        out[v4.state_cache_id(layer)] = StateSpec(block_size=block_size, state_size=v4.state_size(layer))
    return out

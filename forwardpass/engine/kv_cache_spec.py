"""What each layer keeps per token, grouped so that layers with the same needs share one block table.

The KV cache manager (``kv_cache.py``) never asks what kind of attention a layer runs; it asks the
layer group's ``KVCacheSpec`` three questions:

* ``blocks_needed(num_tokens)`` — how many blocks a sequence of that length holds;
* ``page_bytes`` — how much memory one block costs across the group's layers (sizes the pool);
* ``supports_prefix_caching`` — whether a block's content is a pure function of the prefix.

Full attention is implemented here: K and V of every token, ``block_size`` tokens per block. The
interface is written for the kinds the architectures after it need, each one more subclass:

* **sliding window** — same pages, but ``blocks_needed`` counts only blocks that still overlap the
  last ``window`` tokens, and blocks that fall out of the window are freed as the sequence grows
  (``freeable_prefix_blocks(num_computed_tokens)``);
* **latent (MLA)** — one compressed latent vector per token instead of per-head K and V: only
  ``page_bytes`` changes;
* **state slots (Mamba, linear attention)** — a fixed-size state per sequence: ``blocks_needed`` is
  1 whatever the length, and prefix caching does not apply;
* **cross-attention** — K/V of the encoder output, computed once per request: ``blocks_needed`` of
  the encoder length, not of the decoder tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardpass.loader.spec import ModelSpec


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # tokens per block

    @property
    def page_bytes_per_layer(self) -> int:
        raise NotImplementedError

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def supports_prefix_caching(self) -> bool:
        return True

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor for ``num_blocks`` blocks."""
        raise NotImplementedError


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
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (same spec), and the blocks set aside for them."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]
    num_blocks: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one block across every layer of the group."""
        return self.spec.page_bytes_per_layer * len(self.layer_ids)


def layer_specs(model: ModelSpec, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    """The cache spec of each decoder layer of ``model``."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=dtype
    )
    return [spec] * model.layers


def plan_groups(
    specs: list[KVCacheSpec], memory_bytes: int | None, num_blocks: int | None
) -> list[KVCacheGroup]:
    """Group layers with equal specs; give each group the same number of blocks, from a block count
    or from a memory budget (every group must hold the same number of tokens, so the budget is
    divided by the bytes one block costs in all groups together)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    if num_blocks is None:
        assert memory_bytes is not None
        per_block = sum(s.page_bytes_per_layer * len(ids) for s, ids in by_spec.items())
        num_blocks = memory_bytes // per_block
    return [KVCacheGroup(spec, tuple(ids), num_blocks) for spec, ids in by_spec.items()]

"""What each layer keeps per token, grouped so that layers with the same needs share one block table.

The KV cache manager (``kv_cache.py``) never asks what kind of attention a layer runs; it asks the
layer group's ``KVCacheSpec`` (``attention/kv_cache_interface.py``: how many blocks a sequence needs, which
leading blocks can be freed, what a block costs, whether prefix caching holds, which metadata builder its
group gets).

Nor does this module ask: each cache-owning layer declares its own cache (``kv_cache_spec(spec, block_size,
dtype)`` → ``{cache id: spec}``) and ``layer_specs`` walks the model's modules collecting them. Kinds in use:

* **full attention** (``FullAttentionSpec``, ``attention/layer.py``'s ``CachedAttention``) — K and V of every
  token;
* **sliding window** (``SlidingWindowSpec``, the same layer with a window) — the same pages, but the table
  entries of blocks that lie entirely behind the window of the next query are freed while the request runs
  (the entry becomes ``NULL_BLOCK``), so a sequence holds at most
  ``ceil((window - 1 + chunk) / block_size) + 1`` blocks however long it grows. Prefix caching is off for
  these groups (a freed block's K/V may be reused at once by another sequence);
* **latent (MLA)** (``MLASpec``, DeepSeek-V2/V3's attention) — one compressed latent vector plus the shared
  rotary key per token: ``[num_blocks, block_size, latent_dim]`` per layer;
* **state slots** (``StateSpec``: Mamba2 and Gated DeltaNet mixers) — one fixed-size slot per running request:
  ``blocks_needed`` is 1 whatever the length. Taken at admission, kept across chunks and decode steps,
  returned at finish, abort or preemption. ``plan_groups`` gives such a group ``max_num_seqs`` slots before
  dividing the rest of the budget among the paged groups;
* **cross-attention** (``CrossAttentionSpec``, ``cross_attention_spec.py``: Whisper) — a state slot per
  request;
* **compressed attention** (``compressed_spec.py``: DeepSeek-V4) — window pages, entries paged by entry index,
  a slot.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from forwardpass.attention.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSpec,
)
from forwardpass.models.model_spec import ModelSpec

logger = logging.getLogger(__name__)

__all__ = ["NULL_BLOCK", "FullAttentionSpec", "KVCacheGroup", "KVCacheSpec", "MLASpec", "SlidingWindowSpec",
           "StateSpec", "groups_too_short", "layer_specs", "plan_groups", "sequence_capacity",
           "slots_that_fit", "trim_table"]

NULL_BLOCK = -1  # a block-table entry whose block was freed (behind a sliding window)


class CacheOwner(Protocol):
    """A module that keeps a cache: its caches by cache id (``ctx.kv_caches`` index), None for
    an id it owns unused."""

    def kv_cache_spec(self, spec: ModelSpec, block_size: int,
                      dtype: torch.dtype) -> Mapping[int, KVCacheSpec | None]:
        ...


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


def trim_table(table: list[int], spec: KVCacheSpec, num_tokens: int) -> list[int]:
    """Cut ``table`` to the blocks ``num_tokens`` tokens need; the ids cut off (freed entries excluded). The
    scheduler's tables and the runner's mirror are both cut with it after rejected drafts, from the same
    numbers, so they stay equal (``engine/speculative/rollback.py``)."""
    keep = spec.blocks_needed(num_tokens)
    removed = [b for b in table[keep:] if b != NULL_BLOCK]
    del table[keep:]
    return removed


def layer_specs(
    model: ModelSpec, block_size: int, dtype: torch.dtype, modules: nn.Module | None = None
) -> list[KVCacheSpec | None]:
    """The cache spec of each cache id of ``model`` (None: nothing cached there, e.g. an MLP-only layer), as
    its layers declare them. ``modules``: the built model; by default the spec's model class is built on the
    meta device (no memory) to be asked."""
    if modules is None:
        from forwardpass.models.loading import build_model

        modules = build_model(model, dtype, device="meta")
    found: dict[int, KVCacheSpec | None] = {}
    owners: dict[int, str] = {}
    for name, module in modules.named_modules():
        declare = getattr(module, "kv_cache_spec", None)
        if not callable(declare):
            continue
        for cache_id, spec in declare(model, block_size, dtype).items():
            if cache_id in owners:
                raise ValueError(f"cache {cache_id} is declared by both {owners[cache_id]!r} and {name!r}")
            found[cache_id], owners[cache_id] = spec, name
    return [found.get(i) for i in range(max([model.layers - 1, *found]) + 1)]


def plan_groups(
    specs: Sequence[KVCacheSpec | None], memory_bytes: int | None, num_blocks: int | None,
    max_num_seqs: int = 1
) -> list[KVCacheGroup]:
    """Group layers with equal specs (layers without a spec cache nothing). State groups get one slot
    per possible running sequence (``max_num_seqs``), paid first; every paged group gets the same
    number of blocks, from a block count or from what is left of a memory budget (every paged group
    must hold the same number of tokens, so it is divided by one block's bytes in all of them)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec is not None:
            by_spec.setdefault(spec, []).append(layer)
    state_bytes = sum(s.page_bytes_per_layer * len(ids) * max_num_seqs for s, ids in by_spec.items()
                      if isinstance(s, StateSpec))
    if num_blocks is None:
        assert memory_bytes is not None
        per_block = sum(s.page_bytes_per_layer * len(ids) for s, ids in by_spec.items()
                        if not isinstance(s, StateSpec))
        num_blocks = max(0, memory_bytes - state_bytes) // per_block if per_block else 0
    return [KVCacheGroup(spec, tuple(ids), max_num_seqs if isinstance(spec, StateSpec) else num_blocks)
            for spec, ids in by_spec.items()]


def slots_that_fit(specs: Sequence[KVCacheSpec | None], memory_bytes: int, max_num_seqs: int, tokens: int,
                   max_chunk: int) -> int:
    """The most running requests (at most ``max_num_seqs``) whose state slots, paid first from
    ``memory_bytes``, still leave every paged group room for one sequence of ``tokens``; 0 when not even one
    does. A Whisper request keeps its cross-attention K/V (18 MB for tiny.en, ~0.5 GB for large), so the
    default ``max_num_seqs`` may not fit a default budget: fewer requests run at once instead of none."""

    def fits(n: int) -> bool:  # n >= 1: a state group's one slot per sequence always fits
        return not groups_too_short(plan_groups(specs, memory_bytes, None, n), tokens, max_chunk)

    if fits(max_num_seqs):
        return max_num_seqs
    lo, hi = 0, max_num_seqs  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo:
        per_request = sum(s.page_bytes_per_layer for s in specs if isinstance(s, StateSpec))
        logger.warning("max_num_seqs %d -> %d: each request keeps %.1f MB of state (cross-attention K/V or "
                       "a recurrent state), and %d requests' worth leaves no room for one %d-token sequence "
                       "in a %.0f MB KV budget (raise --kv-cache-memory to run more at once)",
                       max_num_seqs, lo, per_request / 1e6, max_num_seqs, tokens, memory_bytes / 1e6)
    return lo


def groups_too_short(groups: list[KVCacheGroup], tokens: int, max_chunk: int) -> list[KVCacheGroup]:
    """The groups that cannot hold one sequence of ``tokens`` (computed ``max_chunk`` at a time) alone."""
    return [g for g in groups if g.spec.max_blocks_per_sequence(tokens, max_chunk) > g.num_blocks]


def sequence_capacity(groups: list[KVCacheGroup], max_chunk: int) -> int | None:
    """The longest sequence every group can hold alone, or None when no length is too long (every
    group is windowed and its live blocks fit)."""
    unbounded = 1 << 40
    caps = [
        g.num_blocks * g.spec.tokens_per_block
        for g in groups
        if g.spec.max_blocks_per_sequence(unbounded, max_chunk) > g.num_blocks
    ]
    return min(caps) if caps else None

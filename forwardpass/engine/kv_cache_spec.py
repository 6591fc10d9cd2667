"""What each layer keeps per token, grouped so that layers with the same needs share one block table.

The KV cache manager (``kv_cache.py``) never asks what kind of attention a layer runs; it asks the
layer group's ``KVCacheSpec``:

* ``blocks_needed(num_tokens)`` — how long a sequence's block table is after ``num_tokens`` tokens;
* ``freeable_prefix_blocks(num_computed_tokens)`` — how many leading table entries no query from
  position ``num_computed_tokens`` on can attend to (their blocks go back to the pool at once);
* ``max_blocks_per_sequence(max_model_len, max_chunk)`` — the most blocks one sequence ever holds
  (the start-up capacity check);
* ``page_bytes_per_layer`` — how much memory one block costs per layer (sizes the pool);
* ``supports_prefix_caching`` — whether a block's content is a pure function of the prefix and
  stays available.

Implemented kinds:

* **full attention** (``FullAttentionSpec``) — K and V of every token, ``block_size`` tokens per block;
* **sliding window** (``SlidingWindowSpec``) — the same pages, but the table entries of blocks that
  lie entirely behind the window of the next query are freed while the request runs (the entry
  becomes ``NULL_BLOCK``), so a sequence holds at most ``ceil((window - 1 + chunk) / block_size) + 1``
  blocks however long it grows. Prefix caching is off for these groups (a freed block's K/V may be
  reused at once by another sequence);
* **latent (MLA)** (``MLASpec``) — one compressed latent vector (``kv_lora_rank``) plus the shared
  rotary key (``qk_rope_head_dim``) per token, instead of per-head K and V: ``[num_blocks,
  block_size, latent_dim]`` per layer.

* **state slots** (``StateSpec``: Mamba2 and Gated DeltaNet layers) — one fixed-size slot per running request (conv
  window + SSM state, ``[num_slots, state_size]`` per layer): ``blocks_needed`` is 1 whatever the
  length, so a request's memory is constant. The slot is taken at admission, kept across prefill
  chunks and decode steps, and returned at finish, abort or preemption (recompute starts from a zero
  state). ``plan_groups`` gives such a group ``max_num_seqs`` slots before dividing the rest of the
  budget among the paged groups. No prefix caching (a state is not a function of a block's tokens).

* **cross-attention** (``CrossAttentionSpec``, ``cross_attention_spec.py``: Whisper) — a state slot per request.
* **compressed attention** (``compressed_spec.py``: DeepSeek-V4) — window pages, entries paged by entry index, a slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forwardpass.loader.spec import MIXER_ATTENTION, MIXER_GDN, MIXER_MAMBA, ModelSpec

NULL_BLOCK = -1  # a block-table entry whose block was freed (behind a sliding window)


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # tokens per block

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


@dataclass(frozen=True)
class MLASpec(KVCacheSpec):
    """Multi-latent attention: per token and layer one vector of ``latent_dim`` values, the
    compressed KV (``kv_lora_rank``) followed by the shared rotary key (``qk_rope_head_dim``)."""

    latent_dim: int = 1
    dtype: torch.dtype = torch.float32

    @property
    def page_bytes_per_layer(self) -> int:
        return self.block_size * self.latent_dim * torch.empty((), dtype=self.dtype).element_size()

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """A fixed-size per-request state (Mamba2: conv window then SSM state, ``state_size`` values per
    layer): one "block" per sequence, however long it grows."""

    state_size: int = 1
    dtype: torch.dtype = torch.float32

    @property
    def page_bytes_per_layer(self) -> int:
        return self.state_size * torch.empty((), dtype=self.dtype).element_size()

    def blocks_needed(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    @property
    def supports_prefix_caching(self) -> bool:
        return False

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.state_size)


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


def layer_specs(model: ModelSpec, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec | None]:
    """The cache spec of each decoder layer of ``model`` (None: the layer caches nothing, an MLP)."""
    if model.dsv4 is not None:  # DeepSeek-V4: sliding pages, compressed entries, compressor states
        from forwardpass.engine.compressed_spec import deepseek_v4_specs

        return deepseek_v4_specs(model, block_size, dtype)
    if model.whisper is not None:  # encoder–decoder: self-attention pages + one cross-attention K/V slot
        from forwardpass.engine.cross_attention_spec import encoder_decoder_specs

        return encoder_decoder_specs(model, block_size, dtype)
    if model.layer_mixers:  # Mamba2 / hybrid: state slots for Mamba layers, pages for attention layers
        paged = _attention_specs(model, block_size, dtype)
        # states stay in float32 whatever the weights' dtype: they accumulate over the whole sequence
        states = {MIXER_MAMBA: model.ssm, MIXER_GDN: model.gdn}
        out: list[KVCacheSpec | None] = []
        for i, mixer in enumerate(model.layer_mixers):
            sizes = states.get(mixer)
            out.append(paged[i] if mixer == MIXER_ATTENTION else
                       StateSpec(block_size=block_size, state_size=sizes.state_size) if sizes is not None else None)
        return out
    return list(_attention_specs(model, block_size, dtype))


def _attention_specs(model: ModelSpec, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    if model.kv_lora_rank:
        mla = MLASpec(block_size=block_size, latent_dim=model.kv_lora_rank + model.qk_rope_head_dim, dtype=dtype)
        return [mla] * model.layers
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=dtype)
    return [
        full if window is None else SlidingWindowSpec(
            block_size=block_size, num_kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=dtype,
            sliding_window=window,
        )
        for window in model.layer_windows
    ]


def plan_groups(
    specs: Sequence[KVCacheSpec | None], memory_bytes: int | None, num_blocks: int | None, max_num_seqs: int = 1
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
        per_block = sum(s.page_bytes_per_layer * len(ids) for s, ids in by_spec.items() if not isinstance(s, StateSpec))
        num_blocks = max(0, memory_bytes - state_bytes) // per_block if per_block else 0
    return [KVCacheGroup(spec, tuple(ids), max_num_seqs if isinstance(spec, StateSpec) else num_blocks)
            for spec, ids in by_spec.items()]


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

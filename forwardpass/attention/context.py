"""What one forward pass over a mixed batch needs to know to do attention.

The engine flattens every scheduled token of every sequence into one ``[T]`` batch (vLLM's layout):
first the decode sequences (one new token each), then the prefill chunks (many tokens each). The
context says, for each sequence, which rows of the batch are its queries, how long its context is,
and where its keys and values live in the paged KV cache.

A model's layers may be split into KV cache groups (``engine/scheduling/kv_cache_spec.py``): full-attention
layers, sliding-window layers, latent (MLA) layers each have their own block pool, so each group
has its own slot mapping and block tables (``GroupMetadata``). A layer reads its group's metadata
with ``ctx.for_layer(layer_idx)``. A state group (Mamba layers, ``StateSpec``) has a ``StateMetadata``
instead: each sequence's slot and whether its state carries over from an earlier step
(``ctx.for_state(layer_idx)``). A compressed-entry group (DeepSeek-V4) has a ``CompressedMetadata``:
each sequence's table of entry blocks and where its chunk starts (``ctx.for_compressed(cache_id)``).

Block tables of a sliding-window group start at the sequence's first block still inside the window
(the blocks before it have been freed); ``context_len`` and ``decode_seq_lens`` then count tokens
from that block's first token, so every backend sees an ordinary (shorter) causal context whose
last position is the query's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    q_start: int  # first row of this sequence's queries in the flattened batch
    q_len: int  # number of new tokens this step (a whole prompt or one chunk)
    context_len: int  # tokens visible after this step (cached + new), counted from block_table[0]
    block_table: torch.Tensor  # [num_blocks] int64 block ids holding this sequence's KV


@dataclass
class GroupMetadata:
    """The paged-cache addressing of one KV cache group for this step."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each new token
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int64 (padded with 0)
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] int64, context length incl. the new token
    decode_max_len: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)


@dataclass
class StateSpan:
    """One sequence's prefill chunk in a state group: its rows and its slot."""

    q_start: int
    q_len: int
    slot: int
    has_initial_state: bool  # False: the chunk starts the sequence (position 0): the state starts at zero


@dataclass
class StateMetadata:
    """Where each sequence's fixed-size state lives for one state group (Mamba layers) this step.

    The first ``num_decode`` rows of the batch are one-token chunks, one per sequence: their slots are
    ``decode_slots`` (``decode_has_initial`` is False for a one-token prompt, which starts from zero).
    Each longer chunk is a ``StateSpan``."""

    decode_slots: torch.Tensor  # [num_decode] int64
    decode_has_initial: torch.Tensor  # [num_decode] bool
    prefills: list[StateSpan] = field(default_factory=list)


@dataclass
class CompressedSpan:
    """One sequence's chunk in a compressed-entry group (DeepSeek-V4): entries ``start // m`` to
    ``(start + q_len) // m - 1`` are emitted this step, the ones before are already in the cache."""

    q_start: int
    q_len: int
    start: int  # tokens of the sequence computed before this chunk
    block_table: torch.Tensor  # [num_blocks] int64: entry e lives in block e // block_size


@dataclass
class CompressedMetadata:
    """Every sequence of the step, in batch order (decode rows first), for one compressed-entry group."""

    spans: list[CompressedSpan] = field(default_factory=list)


@dataclass
class AttentionContext:
    # per layer: [2, num_blocks, block_size, Hkv, D] (MLA: [num_blocks, bs, latent]; state:
    # [num_slots, state_size])
    kv_caches: list[torch.Tensor]
    groups: list[GroupMetadata | StateMetadata | CompressedMetadata]
    layer_group: list[int]  # layer index -> index into groups
    num_decode: int = 0  # rows 0..num_decode-1 are decode tokens, one per sequence
    backend: str = "sdpa"  # how scores are computed once K/V are read: "sdpa", "naive" or "flash"
    # compiled paged-decode kernel (attention/cpu_kernel.py) reading K/V in place; None = PyTorch path
    decode_kernel: Callable | None = None

    def for_layer(self, layer_idx: int) -> GroupMetadata:
        meta = self.groups[self.layer_group[layer_idx]]
        assert isinstance(meta, GroupMetadata), f"layer {layer_idx} keeps a state, not paged KV"
        return meta

    def for_state(self, layer_idx: int) -> StateMetadata:
        """The state slots of a state layer's group (Mamba)."""
        meta = self.groups[self.layer_group[layer_idx]]
        assert isinstance(meta, StateMetadata), f"layer {layer_idx} keeps paged KV, not a state"
        return meta

    def for_compressed(self, cache_id: int) -> CompressedMetadata:
        """The block tables of a compressed-entry group (DeepSeek-V4)."""
        meta = self.groups[self.layer_group[cache_id]]
        assert isinstance(meta, CompressedMetadata), f"cache {cache_id} does not hold compressed entries"
        return meta

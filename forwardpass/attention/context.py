"""What one forward pass over a mixed batch needs to know to do attention.

The engine flattens every scheduled token of every sequence into one ``[T]`` batch (vLLM's layout):
first the decode sequences (one new token each), then the prefill chunks (many tokens each). The
context says, for each sequence, which rows of the batch are its queries, how long its context is,
and where its keys and values live in the paged KV cache.

A model's layers may be split into KV cache groups (``engine/kv_cache_spec.py``): full-attention
layers, sliding-window layers, latent (MLA) layers each have their own block pool, so each group
has its own slot mapping and block tables (``GroupMetadata``). A layer reads its group's metadata
with ``ctx.for_layer(layer_idx)``.

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
class AttentionContext:
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, Hkv, D] (MLA: [num_blocks, bs, latent])
    groups: list[GroupMetadata]
    layer_group: list[int]  # layer index -> index into groups
    num_decode: int = 0  # rows 0..num_decode-1 are decode tokens, one per sequence
    backend: str = "sdpa"  # how scores are computed once K/V are read: "sdpa", "naive" or "flash"
    # compiled paged-decode kernel (attention/cpu_kernel.py) reading K/V in place; None = PyTorch path
    decode_kernel: Callable | None = None

    def for_layer(self, layer_idx: int) -> GroupMetadata:
        return self.groups[self.layer_group[layer_idx]]

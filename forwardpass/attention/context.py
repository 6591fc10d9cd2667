"""What one forward pass over a mixed batch needs to know to do attention.

The engine flattens every scheduled token of every sequence into one ``[T]`` batch (vLLM's layout):
first the decode sequences (one new token each), then the prefill chunks (many tokens each). The
context says, for each sequence, which rows of the batch are its queries, how long its context is,
and where its keys and values live in the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    q_start: int  # first row of this sequence's queries in the flattened batch
    q_len: int  # number of new tokens this step (a whole prompt or one chunk)
    context_len: int  # tokens visible after this step (already cached + new)
    block_table: torch.Tensor  # [num_blocks] int64 block ids holding this sequence's KV


@dataclass
class AttentionContext:
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each new token
    num_decode: int = 0  # rows 0..num_decode-1 are decode tokens, one per sequence
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int64 (padded with 0)
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] int64, context length incl. the new token
    decode_max_len: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    backend: str = "sdpa"  # how scores are computed once K/V are read: "sdpa" or "naive"
    # compiled paged-decode kernel (attention/cpu_kernel.py) reading K/V in place; None = PyTorch path
    decode_kernel: Callable | None = None

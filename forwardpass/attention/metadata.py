"""Builds one KV cache group's ``GroupMetadata`` (``context.py``) from the chunks of a step.

The model runner calls ``add`` once per scheduled chunk, in batch order (decode chunks first), with
the sequence's block table for this group, then ``build``. Per-token bookkeeping stays in plain
Python ints: at batch 64 a few small tensors per sequence cost more than a small model's decode.

For a sliding-window group the first ``spec.freeable_prefix_blocks(start)`` entries of the table
have been freed by the KV cache manager (the same rule, so the two always agree); the tables handed
to attention start after them and lengths are counted from there.

``StateMetadataBuilder`` does the same for a state group (Mamba layers): a table there is one slot;
``CompressedMetadataBuilder`` for a compressed-entry group (DeepSeek-V4): each chunk with its table.

Which builder a group gets is its spec's choice (``KVCacheSpec.metadata_builder``, ``kv_cache_interface.py``):
every builder is made as ``cls(spec, device)`` and has ``add`` and ``build``, so a new cache kind brings its
own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from forwardpass.attention.context import (
    CompressedMetadata,
    CompressedSpan,
    GroupMetadata,
    PrefillSpan,
    StateMetadata,
    StateSpan,
)


class MetadataBuilder(Protocol):
    """Collects a step's chunks for one KV cache group, then builds the metadata its layers read."""

    def add(self, table: list[int], start: int, end: int, row: int) -> None:
        """Positions ``start..end-1`` of a sequence whose block table in this group is ``table``, its queries
        at batch rows ``row..``."""

    def build(self) -> Any: ...


#: ``cls(spec, device)``: what a ``KVCacheSpec`` names as its builder
MetadataBuilderFactory = Callable[[Any, "str | torch.device"], MetadataBuilder]


class PagedSpec(Protocol):
    @property
    def block_size(self) -> int: ...

    def freeable_prefix_blocks(self, num_computed_tokens: int) -> int: ...


class GroupMetadataBuilder:
    def __init__(self, spec: PagedSpec, device: str | torch.device):
        self.spec, self.device = spec, device
        self.bs = spec.block_size
        self.slots: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.prefills: list[PrefillSpan] = []

    def add(self, table: list[int], start: int, end: int, row: int) -> None:
        """Positions ``start..end-1`` of a sequence, its queries at batch rows ``row..``."""
        bs = self.bs
        first = self.spec.freeable_prefix_blocks(start)
        live = table[first:] if first else table
        base = first * bs  # the token position live[0] starts at
        if end - start == 1:
            self.slots.append(table[start // bs] * bs + start % bs)
            self.decode_tables.append(live)
            self.decode_lens.append(end - base)
        else:
            self.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            self.prefills.append(
                PrefillSpan(q_start=row, q_len=end - start, context_len=end - base,
                            block_table=torch.tensor(live, dtype=torch.long, device=self.device))
            )

    def build(self) -> GroupMetadata:
        meta = GroupMetadata(
            slot_mapping=torch.tensor(self.slots, dtype=torch.long, device=self.device),
            prefills=self.prefills
        )
        if self.decode_lens:
            width = max(len(t) for t in self.decode_tables)
            padded = [t + [0] * (width - len(t)) for t in self.decode_tables]  # pad with any valid block id
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=self.device)
            meta.decode_seq_lens = torch.tensor(self.decode_lens, dtype=torch.long, device=self.device)
            meta.decode_max_len = max(self.decode_lens)
        return meta


class StateMetadataBuilder:
    """``StateMetadata`` of one state group: the table of a sequence is its one slot."""

    def __init__(self, spec: object, device: str | torch.device):
        self.device = device
        self.decode_slots: list[int] = []
        self.decode_has_initial: list[bool] = []
        self.prefills: list[StateSpan] = []

    def add(self, table: list[int], start: int, end: int, row: int) -> None:
        if end - start == 1:
            self.decode_slots.append(table[0])
            self.decode_has_initial.append(start > 0)
        else:
            self.prefills.append(StateSpan(row, end - start, table[0], start > 0))

    def build(self) -> StateMetadata:
        return StateMetadata(
            decode_slots=torch.tensor(self.decode_slots, dtype=torch.long, device=self.device),
            decode_has_initial=torch.tensor(self.decode_has_initial, dtype=torch.bool, device=self.device),
            prefills=self.prefills,
        )


class CompressedMetadataBuilder:
    """``CompressedMetadata`` of one compressed-entry group (DeepSeek-V4): every chunk with its table."""

    def __init__(self, spec: object, device: str | torch.device):
        self.device = device
        self.spans: list[CompressedSpan] = []

    def add(self, table: list[int], start: int, end: int, row: int) -> None:
        self.spans.append(CompressedSpan(row, end - start, start,
                                         torch.tensor(table, dtype=torch.long, device=self.device)))

    def build(self) -> CompressedMetadata:
        return CompressedMetadata(self.spans)

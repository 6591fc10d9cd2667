"""The draft model's own KV cache: paged, with a private block pool and one block table per sequence.

Why paged rather than one contiguous buffer per sequence: the draft then runs through exactly the attention
path the target uses (``attention/layer.py``: the compiled K/V store, the paged decode kernel, the fused
decode stack), so any model the engine loads can be a draft, with no second attention implementation; and
its memory is one fixed pool sized at start-up, not a buffer per sequence that grows and is copied.

Why private rather than blocks of the target's pool: the draft's pages have another shape (its own layers,
heads and head size), and its cache never has to be consistent with the scheduler's: the draft only caches
tokens it has already run, it is rolled back by comparing token ids (``DraftSequence.common_prefix``), and
losing it (the pool runs dry) costs one recomputation, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup, trim_table


@dataclass
class DraftSequence:
    """What the draft has computed for one target sequence: the tokens whose K/V its cache holds."""

    tokens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # one block table per KV cache group
    checked: int = 0  # tokens[:checked] are known to equal the target sequence's (it only ever appends)

    def common_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the cache already holds (K/V of rejected drafts past it
        are stale and will be cut)."""
        n = min(len(self.tokens), len(token_ids))
        i = min(self.checked, n)
        while i < n and self.tokens[i] == token_ids[i]:
            i += 1
        return i


class DraftKVCache:
    """A fixed pool of blocks per KV cache group of the draft model, and the cache tensors they index."""

    def __init__(self, groups: Sequence[KVCacheGroup], dtype: torch.dtype, device: str | torch.device):
        self.groups = list(groups)
        num_layers = 1 + max(i for g in self.groups for i in g.layer_ids)
        self.kv_caches: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.layer_group = [0] * num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layer_ids:
                # zeroed: a padded decode row reads slots no one wrote, and 0 * NaN garbage would be NaN
                self.kv_caches[layer] = torch.zeros(group.spec.cache_shape(group.num_blocks),
                                                    dtype=group.spec.cache_dtype(dtype), device=device)
                self.layer_group[layer] = g
        self.free: list[list[int]] = [list(range(g.num_blocks - 1, -1, -1)) for g in self.groups]
        self.sequences: dict[int, DraftSequence] = {}

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(f) for f in self.free)

    def sequence(self, seq_id: int) -> DraftSequence:
        state = self.sequences.get(seq_id)
        if state is None:
            state = self.sequences[seq_id] = DraftSequence(tables=[[] for _ in self.groups])
        return state

    def truncate(self, state: DraftSequence, num_tokens: int) -> None:
        """Forget the K/V of positions ``num_tokens..`` (rejected drafts); return blocks no longer needed."""
        del state.tokens[num_tokens:]
        state.checked = min(state.checked, num_tokens)
        for group, table, free in zip(self.groups, state.tables, self.free):
            free.extend(trim_table(table, group.spec, num_tokens))

    def reserve(self, state: DraftSequence, num_tokens: int) -> bool:
        """Blocks for positions up to ``num_tokens``; False (and nothing taken) if the pool is short."""
        needs = [max(0, g.spec.blocks_needed(num_tokens) - len(t)) for g, t in zip(self.groups, state.tables)]
        if any(n > len(free) for n, free in zip(needs, self.free)):
            return False
        for n, table, free in zip(needs, state.tables, self.free):
            table.extend(free.pop() for _ in range(n))
        return True

    def release(self, seq_id: int) -> None:
        """The sequence finished or was preempted: every block it held returns to the pool."""
        state = self.sequences.pop(seq_id, None)
        if state is not None:
            self.truncate(state, 0)


def build_draft_cache(spec: Any, model: torch.nn.Module, engine: Any, target_groups: Sequence[KVCacheGroup],
                      num_speculative_tokens: int) -> tuple[DraftKVCache, list[KVCacheGroup], int]:
    """A proposer's own paged cache for ``model`` (its ``spec``): as many tokens as the target's pool holds,
    plus ``num_speculative_tokens`` drafts and a block for every sequence that may run; returns the cache,
    its groups and its bytes. Refuses groups that cannot roll back (the drafts past a rejection go)."""
    from forwardpass.engine.scheduling.kv_cache_spec import layer_specs, plan_groups
    from forwardpass.engine.speculative.rollback import check_can_roll_back

    specs = layer_specs(spec, engine.block_size, engine.torch_dtype, model)
    tokens = max(g.num_blocks * g.spec.tokens_per_block for g in target_groups)
    tokens += engine.max_num_seqs * (num_speculative_tokens + engine.block_size)
    groups = plan_groups(specs, None, -(-tokens // engine.block_size), engine.max_num_seqs)
    check_can_roll_back(groups)
    cache = DraftKVCache(groups, engine.torch_dtype, engine.device)
    return cache, groups, sum(g.page_bytes * g.num_blocks for g in groups)

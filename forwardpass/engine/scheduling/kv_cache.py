"""The paged KV cache's bookkeeping: block tables of every live sequence over one or more layer groups.

A model's layers are grouped by what they cache (``kv_cache_spec.py``); each group has its own block
pool (``block_pool.py``) and each sequence one block table per group. Allocation is all-or-nothing
across groups: a step either gets room in every group or changes nothing (beyond freeing blocks no
query can read any more). The scheduler is the only caller; the model runner receives the resulting
block ids in ``SchedulerOutput``.

Sliding-window groups free blocks while a sequence runs: each ``allocate_slots`` first releases the
leading blocks that lie entirely behind the window of the step's first query
(``KVCacheSpec.freeable_prefix_blocks``) and writes ``NULL_BLOCK`` in their table entries, so table
index ``i`` still means tokens ``[i * block_size, (i + 1) * block_size)``. Prefix caching is switched
off (with a log line) when any group cannot support it.

State groups (``StateSpec``: Mamba layers) hold one slot per sequence: ``blocks_needed`` is 1 for any
length, so the slot is taken by the first ``allocate_slots`` (admission), kept while the sequence
runs, and returned by ``free`` (finish, abort, preemption). ``check_invariants`` checks that no table
is longer than its spec allows (one slot for a state group).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from forwardpass.engine.scheduling.block_pool import BlockKey, BlockPool
from forwardpass.engine.scheduling.kv_cache_spec import NULL_BLOCK, KVCacheGroup, trim_table
from forwardpass.engine.scheduling.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedPrefix:
    """The longest prefix of a sequence whose K/V are already in every group's pool."""

    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per group


NO_PREFIX = CachedPrefix(0, ())


class KVCacheManager:
    def __init__(self, groups: Seq[KVCacheGroup], enable_prefix_caching: bool = True):
        if not groups:
            raise ValueError("a KV cache needs at least one layer group")
        sizes = {g.spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"every KV cache group must use one block size, got {sorted(sizes)}")
        self.groups = list(groups)
        self.block_size = sizes.pop()
        self.pools = [BlockPool(g.num_blocks) for g in groups]
        unsupported = [type(g.spec).__name__ for g in groups if not g.spec.supports_prefix_caching]
        if enable_prefix_caching and unsupported:
            logger.info("prefix caching is off: layer groups with %s do not support it",
                        ", ".join(unsupported))
        self.enable_prefix_caching = enable_prefix_caching and not unsupported
        self.tables: dict[int, list[list[int]]] = {}  # seq_id -> one block table per group
        self._seq_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full blocks (lazy)
        self.prefix_queries = 0  # prompt tokens looked up (cumulative, for the step records)
        self.prefix_hits = 0  # of which were served from the cache

    # ----- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by live sequences (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def bytes_in_use(self) -> int:
        """Cache bytes owned by live sequences, over every group (pages and state slots)."""
        return sum((p.num_blocks - p.num_free) * g.page_bytes for g, p in zip(self.groups, self.pools))

    def can_fit(self, num_tokens: int, freeing: Sequence | None = None) -> bool:
        """Would a new sequence's first ``num_tokens`` get blocks now (after ``freeing`` gave its back)?"""
        tables = self.tables.get(freeing.seq_id, []) if freeing is not None else []
        return all(p.num_free + (len(tables[i]) if tables else 0) >= g.spec.blocks_needed(num_tokens)
                   for i, (g, p) in enumerate(zip(self.groups, self.pools)))

    def blocks_needed(self, num_tokens: int) -> int:
        return self.groups[0].spec.blocks_needed(num_tokens)

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        return self.tables.get(seq.seq_id, [[] for _ in self.groups])

    def block_table(self, seq: Sequence) -> list[int]:
        """The block table of the first (for today's models, the only) group."""
        return self.block_tables(seq)[0]

    # ----- prefix cache --------------------------------------------------------------------------
    def _block_key(self, parent: int, seq: Sequence, i: int) -> BlockKey:
        bs = self.block_size
        return (parent, seq.lora_id, tuple(seq.token_ids[i * bs : (i + 1) * bs]))

    def _hashes_for(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        while len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else 0
            hashes.append(hash(self._block_key(parent, seq, len(hashes))))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest cached prefix of ``seq``'s tokens present in every group.

        At least one token is always left to compute (its logits are needed to sample), so a prompt
        that is entirely cached gives back its last full block, which is recomputed.
        """
        if not self.enable_prefix_caching:
            return NO_PREFIX
        max_full = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes_for(seq, max_full)
        found: list[list[int]] = [[] for _ in self.pools]
        parent = 0
        for i in range(max_full):
            key = self._block_key(parent, seq, i)
            hits = [pool.lookup(hashes[i], key) for pool in self.pools]
            if any(b is None for b in hits):
                break
            for g, b in enumerate(hits):
                found[g].append(b)  # type: ignore[arg-type]
            parent = hashes[i]
        num = len(found[0])
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += num * self.block_size
        return CachedPrefix(num * self.block_size, tuple(tuple(f) for f in found)) if num else NO_PREFIX

    # ----- allocation ----------------------------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX
    ) -> tuple[tuple[int, ...], ...] | None:
        """Make room for ``num_new_tokens`` more computed tokens of ``seq``; return the block ids
        appended to each group's table (cached ones first), or None if a pool ran out, in which case
        nothing changed. ``cached`` (from ``find_cached_prefix``) starts a fresh sequence's tables."""
        tables = self.block_tables(seq)
        start = seq.num_computed_tokens + cached.num_tokens
        total = start + num_new_tokens
        if seq.seq_id in self.tables:
            self._free_behind_window(tables, start)
        plans = []
        for g, (group, pool) in enumerate(zip(self.groups, self.pools)):
            hits = list(cached.block_ids[g]) if cached.block_ids else []
            needed = group.spec.blocks_needed(total) - len(tables[g]) - len(hits)
            if needed > pool.num_free - pool.num_reclaimed(hits):
                return None
            plans.append((hits, max(needed, 0)))
        self.tables[seq.seq_id] = tables
        appended = []
        for g, (hits, needed) in enumerate(plans):
            pool = self.pools[g]
            for block_id in hits:
                pool.touch(block_id)
            new = hits + [pool.take_free() for _ in range(needed)]
            tables[g].extend(new)
            appended.append(tuple(new))
        self._register_full_blocks(seq, total)
        return tuple(appended)

    def _free_behind_window(self, tables: list[list[int]], start: int) -> None:
        """Release the blocks no query from position ``start`` on can read (sliding-window groups)."""
        for group, pool, table in zip(self.groups, self.pools, tables):
            n = min(group.spec.freeable_prefix_blocks(start), len(table))
            gone = [b for b in table[:n] if b != NULL_BLOCK]
            if gone:
                pool.release(gone)
                table[:n] = [NULL_BLOCK] * n

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that will be full after this step. Their K/V are written in this
        step's forward pass, layer by layer, before any sequence that hits them reads them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        hashes = self._hashes_for(seq, num_full)
        tables = self.tables[seq.seq_id]
        parent = 0
        for i in range(num_full):
            key = (
                self._block_key(parent, seq, i)
                if any(pool.blocks[t[i]].hash is None for pool, t in zip(self.pools, tables))
                else None
            )
            if key is not None:
                for pool, table in zip(self.pools, tables):
                    pool.register(table[i], hashes[i], key)
            parent = hashes[i]

    def roll_back(self, seq: Sequence) -> None:
        """After rejected drafts: release the trailing blocks ``seq``'s tokens no longer need (the runner cuts
        its mirror by the same rule, ``trim_table``)."""
        for group, pool, table in zip(self.groups, self.pools, self.tables.get(seq.seq_id, [])):
            if gone := trim_table(table, group.spec, seq.num_tokens):
                pool.release(gone)

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to their pools."""
        for pool, table in zip(self.pools, self.tables.pop(seq.seq_id, [])):
            pool.release([b for b in table if b != NULL_BLOCK])
        self._seq_hashes.pop(seq.seq_id, None)

    # ----- invariants ----------------------------------------------------------------------------
    def check_invariants(self, live_seqs: Seq[Sequence] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. Tests call this after every run."""
        owners: list[dict[int, int]] = [{} for _ in self.pools]
        if live_seqs is not None:
            live = {s.seq_id for s in live_seqs}
            stale = set(self.tables) - live
            assert not stale, f"finished sequences {sorted(stale)} still hold block tables"
        for tables in self.tables.values():
            for g, table in enumerate(tables):
                assert len(table) <= self.groups[g].spec.blocks_needed(1 << 40), ("a table longer than its "
                                                                                  "spec allows")
                held = [b for b in table if b != NULL_BLOCK]
                assert len(held) == len(set(held)), "a block table lists a block twice"
                freed = len(table) - len(held)
                assert table[:freed] == [NULL_BLOCK] * freed, "a freed entry is not in the table's prefix"
                for b in held:
                    owners[g][b] = owners[g].get(b, 0) + 1
        for g, pool in enumerate(self.pools):
            pool.check_invariants(owners[g] if live_seqs is not None else None)

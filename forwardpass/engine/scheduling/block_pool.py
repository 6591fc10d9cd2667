"""A pool of fixed-size KV blocks with reference counts, an LRU free queue and a prefix-cache index.

Each block is in exactly one of two states:

* **owned**: ``ref_count > 0``, listed in the block tables of ``ref_count`` sequences;
* **free**: ``ref_count == 0``, in the free queue exactly once. A free block may still carry a prefix
  hash: its K/V stay valid and a later request with the same prefix takes it back (a cache hit)
  until the block is handed out for new tokens, which evicts it. The free queue is in LRU order.

Prefix caching identifies a *full* block by a chained hash of (parent block's hash, extra key such as
the LoRA adapter id, its token ids), so a block is shared only when the whole prefix up to and
including it is identical. The key is kept next to the hash and compared on a hit, so a hash
collision can never serve wrong K/V.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockKey = tuple[int, int, tuple[int, ...]]  # (parent hash, extra key, token ids)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    key: BlockKey | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        """The block holding exactly ``key``'s content, owned or free, or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].key != key:
            return None
        return block_id

    def num_reclaimed(self, block_ids: list[int]) -> int:
        """How many of these (cached) blocks are free now and would leave the free queue if taken."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def touch(self, block_id: int) -> None:
        """Take one more reference to a cached block (a prefix-cache hit)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.key = None
        block.ref_count = 1
        return block_id

    def register(self, block_id: int, block_hash: int, key: BlockKey) -> None:
        """Publish a full block in the prefix cache (first writer wins; duplicates stay private)."""
        block = self.blocks[block_id]
        if block.hash is None:
            block.hash, block.key = block_hash, key
            self.cached.setdefault(block_hash, block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; tail blocks first so they are evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def check_invariants(self, owners: dict[int, int] | None) -> None:
        """``owners``: block id -> number of live block tables listing it (None: skip that check)."""
        assert len(self.free_queue) == len(set(self.free_queue)), "a block is in the free queue twice"
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            if block.ref_count == 0:
                assert in_free, f"block {block.block_id} has no owner but is not free"
            else:
                assert not in_free, f"block {block.block_id} is owned (ref {block.ref_count}) and free"
            assert block.ref_count >= 0, f"block {block.block_id} has a negative refcount"
            if owners is not None:
                assert owners.get(block.block_id, 0) == block.ref_count, (
                    f"block {block.block_id}: refcount {block.ref_count} but {owners.get(block.block_id, 0)} "
                    "owners"
                )
        for h, b in self.cached.items():
            assert self.blocks[b].hash == h, f"prefix cache entry {h} points at block {b} with another hash"

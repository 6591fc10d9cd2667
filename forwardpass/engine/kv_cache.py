"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, block tables, prefix sharing.

Each block is in exactly one of two states:

* **owned**: ``ref_count > 0``, listed in the block tables of ``ref_count`` sequences;
* **free**: ``ref_count == 0``, in the free queue exactly once. A free block may still carry a prefix
  hash: its K/V stay valid and a later request with the same prefix takes it back (a cache hit)
  until the block is handed out for new tokens, which evicts it. The free queue is in LRU order.

Prefix caching identifies a *full* block by a chained hash of (parent block's hash, its token ids,
extra key such as the LoRA adapter id), so a block is shared only when the whole prefix up to and
including it is identical. We keep the tokens next to the hash and compare them on a hit, so a hash
collision can never serve wrong K/V.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from forwardpass.engine.sequence import Sequence

BlockKey = tuple[int, int, tuple[int, ...]]  # (parent hash, extra key, token ids)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    key: BlockKey | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        # seq_id -> hashes of that sequence's full blocks, in order (recomputed lazily)
        self._seq_hashes: dict[int, list[int]] = {}
        # counters for the per-step records
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which were served from the cache

    # ----- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by running sequences (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``'s tokens.

        At least one token is always left to compute (its logits are needed to sample), so a prompt
        that is entirely cached gives back its last full block, which is recomputed.
        """
        if not self.enable_prefix_caching:
            return []
        max_full = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes_for(seq, max_full)
        found: list[int] = []
        parent = 0
        for i in range(max_full):
            block_id = self.cached.get(hashes[i])
            if block_id is None or self.blocks[block_id].key != self._block_key(parent, seq, i):
                break
            found.append(block_id)
            parent = hashes[i]
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(found) * self.block_size
        return found

    # ----- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens of ``seq``; False if blocks ran out.

        ``cached_blocks`` (from ``find_cached_prefix``) become the start of a fresh sequence's block
        table. Nothing changes when False is returned.
        """
        cached_blocks = cached_blocks or []
        total_tokens = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_needed = self.blocks_needed(total_tokens) - len(seq.block_table) - len(cached_blocks)
        # cached blocks that are currently free will leave the free queue when we take them
        reclaimed = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_needed > self.num_free_blocks - reclaimed:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(max(num_needed, 0)):
            seq.block_table.append(self._take_free_block())
        self._register_full_blocks(seq, total_tokens)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.key = None
        block.ref_count = 1
        return block_id

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that will be full after this step. Their K/V are written in this
        step's forward pass, layer by layer, before any sequence that hits them reads them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        hashes = self._hashes_for(seq, num_full)
        parent = 0
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                h = hashes[i]
                block.hash, block.key = h, self._block_key(parent, seq, i)
                self.cached.setdefault(h, block.block_id)
            parent = hashes[i]

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks. Tail blocks go to the free queue first so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)

    # ----- invariants ----------------------------------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. Tests call this after every run."""
        assert len(self.free_queue) == len(set(self.free_queue)), "a block is in the free queue twice"
        owners: dict[int, int] = {}
        for seq in live_seqs or []:
            assert len(seq.block_table) == len(set(seq.block_table)), f"seq {seq.seq_id} lists a block twice"
            for b in seq.block_table:
                owners[b] = owners.get(b, 0) + 1
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            if block.ref_count == 0:
                assert in_free, f"block {block.block_id} has no owner but is not free"
            else:
                assert not in_free, f"block {block.block_id} is owned (ref {block.ref_count}) and free"
            assert block.ref_count >= 0, f"block {block.block_id} has a negative refcount"
            if live_seqs is not None:
                assert owners.get(block.block_id, 0) == block.ref_count, (
                    f"block {block.block_id}: refcount {block.ref_count} but "
                    f"{owners.get(block.block_id, 0)} owners"
                )
        for h, b in self.cached.items():
            assert self.blocks[b].hash == h, f"prefix cache entry {h} points at block {b} with another hash"

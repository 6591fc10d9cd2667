"""The scheduler: one rule, one token budget (as in vLLM v1).

Every step, each sequence may advance ``num_computed_tokens`` toward ``num_tokens``. Running
sequences go first (most need one token: a decode step; one mid-prefill needs a chunk), then waiting
ones are admitted in arrival order, their prompts cut to whatever budget is left (chunked prefill).
Decode tokens and prefill chunks share one forward pass.

When the KV pool runs dry, the most recently admitted running sequence is preempted: its blocks are
freed and it returns to the *front* of the waiting queue, to be recomputed later (its generated
tokens are kept and become part of what it recomputes). Nothing admitted is ever dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from forwardpass.engine.kv_cache import KVCacheManager
from forwardpass.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences and how many new tokens each computes this step; decode-like (1 token) first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        # optional callable(seq, running) -> bool: may `seq` join the running set now? (LoRA uses it
        # to keep at most max_loras adapters per batch). A refused head of the queue waits there.
        self.admit_filter = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted = 0

        # 1. Running sequences: decode steps and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                chosen.append((seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is running any more

        # 2. Waiting sequences, unless we just had to preempt (there is no room).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if self.admit_filter is not None and not self.admit_filter(seq, self.running):
                break
            cached = self.kv.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq, num_new, cached):
                break
            self.waiting.popleft()
            seq.num_computed_tokens += num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            chosen.append((seq, num_new))
            budget -= num_new

        self.num_preemptions += preempted
        chosen.sort(key=lambda item: item[1] != 1)  # one-token (decode-like) sequences first; stable
        return ScheduledBatch([s for s, _ in chosen], [n for _, n in chosen], preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

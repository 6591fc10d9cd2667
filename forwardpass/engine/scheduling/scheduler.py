"""The scheduler: one rule, one token budget (as in vLLM v1), and the only writer of request state.

Every step, each sequence may advance ``num_computed_tokens`` toward ``num_tokens``. Running
sequences go first (most need one token: a decode step; one mid-prefill needs a chunk), then waiting
ones are admitted in arrival order, their prompts cut to whatever budget is left (chunked prefill).
Decode tokens and prefill chunks share one forward pass.

When the KV pool runs dry, the most recently admitted running sequence is preempted: its blocks are
freed and it returns to the *front* of the waiting queue, to be recomputed later (its generated
tokens are kept and become part of what it recomputes). Nothing admitted is ever dropped.

Fairness: when every batch slot (``max_num_seqs``) is taken, or the KV cache has no room for its
first chunk, and the head of the queue is a newcomer (nothing generated yet), the running sequence
that has generated the most (at least ``fair_share_tokens``) is swapped out to the *back* of the
queue, one per step, so a newcomer's first token does not wait for a long stream to end. Its full
blocks stay in the prefix cache, so coming back usually recomputes less than a block.

Speculative decoding (``speculator``, the ``Speculation`` plug-in of ``speculation.py``, implemented in
engine/speculative/): a decode step may carry draft tokens, whose K/V slots come out of the same budget and
pool (without room for them the step decodes plainly); ``update()`` sets ``num_computed_tokens`` back past
the rejected ones and returns the blocks they held.

``schedule()`` decides; ``update()`` applies the runner's sampled tokens (appends them, checks the
token-level stop conditions, finishes and frees) and returns one ``TokenDelta`` per sequence and step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from forwardpass.engine.scheduling.batch import (
    NewSequence,
    RunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
    TokenDelta,
)
from forwardpass.engine.scheduling.fairness import fair_swap_victim
from forwardpass.engine.scheduling.kv_cache import NO_PREFIX, KVCacheManager
from forwardpass.engine.scheduling.sequence import Sequence, SequenceStatus
from forwardpass.engine.scheduling.speculation import Speculation


class AdmissionPolicy(Protocol):
    """May ``seq`` join the running set now? A refused head of the queue waits there (e.g. LoRA keeps
    at most ``max_loras`` adapters per batch)."""

    def can_admit(self, seq: Sequence, running: list[Sequence]) -> bool: ...


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        eos_token_ids: Iterable[int] = (), admission: AdmissionPolicy | None = None,
        fair_share_tokens: int = 0, speculator: Speculation | None = None):
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.admission = admission
        self.fair_share_tokens = fair_share_tokens
        self.num_swaps = 0  # sequences swapped out for a newcomer (fairness)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests, their n samples each
        self.seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self.num_preemptions = 0
        self._finished_since_schedule: list[int] = []
        self.speculator = speculator  # speculative decoding: drafts per decode step (None: off)
        self._scheduled_at = 0.0  # when schedule() returned: the step's time, for the speculator's cost model

    # ----- requests ------------------------------------------------------------------------------
    def add_request(self, seqs: list[Sequence]) -> None:
        self.requests[seqs[0].request_id] = seqs
        for seq in seqs:
            self.seqs[seq.seq_id] = seq
            self.waiting.append(seq)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Finish these requests now ("abort") and return their blocks. Unknown ids are ignored."""
        for rid in request_ids:
            for seq in self.requests.get(rid, []):
                if not seq.is_finished:
                    self._finish(seq, "abort", None)

    def stop_samples(self, samples: Iterable[tuple[str, int]]) -> None:
        """Finish single samples ``(request id, index)`` (a stop string ended them in the front end)."""
        for rid, index in samples:
            seqs = self.requests.get(rid)
            if seqs is not None and not seqs[index].is_finished:
                self._finish(seqs[index], "stop", None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._make_room_for_newcomer()
        budget = self.max_num_batched_tokens
        chosen: list[ScheduledChunk] = []
        new: list[NewSequence] = []
        preempted = 0

        # 1. Running sequences: decode steps and unfinished prefill chunks.
        i, num_running = 0, len(self.running)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            start = seq.num_computed_tokens
            drafts = (self.speculator.drafts_for_step(seq, num_new, budget, num_running, self.max_model_len)
                      if self.speculator is not None else ())
            blocks = self.kv.allocate_slots(seq, num_new + len(drafts)) if drafts else None
            if blocks is None:
                drafts = ()  # no room for drafts: decode without them rather than preempt for them
                while (blocks := self.kv.allocate_slots(seq, num_new)) is None:
                    victim = self.running.pop()  # the most recently admitted
                    self._preempt(victim)
                    preempted += 1
                    if victim is seq:
                        break
                if blocks is None:
                    break  # seq itself was preempted: nothing after it is running any more
            chosen.append(ScheduledChunk(seq.seq_id, start, num_new + len(drafts), blocks,
                                         _is_decode(seq, num_new), drafts))
            budget -= num_new + len(drafts)
            i += 1

        # 2. Waiting sequences, unless we just had to preempt (there is no room).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if self.admission is not None and not self.admission.can_admit(seq, self.running):
                break
            # prompt_logprobs needs every prompt position's hidden state: no prefix-cache hits for it
            fresh = seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None
            cached = self.kv.find_cached_prefix(seq) if fresh else NO_PREFIX
            num_new = min(seq.num_tokens - seq.num_computed_tokens - cached.num_tokens, budget)
            if self.kv.allocate_slots(seq, num_new, cached) is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens += cached.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached.num_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            if not seq.in_runner:
                new.append(NewSequence(seq.seq_id, tuple(seq.prompt_token_ids), tuple(seq.output_token_ids),
                                       seq.params, seq.index, seq.lora_id, seq.encoder_input))
                seq.in_runner = True
            self.running.append(seq)
            # a (re)admitted sequence's whole block table is new to the runner
            tables = tuple(tuple(t) for t in self.kv.block_tables(seq))
            chosen.append(
                ScheduledChunk(seq.seq_id, seq.num_computed_tokens, num_new, tables, _is_decode(seq, num_new))
            )
            budget -= num_new

        self.num_preemptions += preempted
        chosen.sort(key=lambda c: c.num_new_tokens != 1 + len(c.draft_token_ids))  # decode/verify rows first
        finished, self._finished_since_schedule = tuple(self._finished_since_schedule), []
        self._scheduled_at = time.perf_counter()
        return SchedulerOutput(tuple(new), tuple(chosen), finished, preempted)

    def update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[TokenDelta]:
        """Apply one step's results: computed tokens, sampled tokens (a sequence that verified drafts has
        several, cut at the first stop), rejected drafts rolled back, token-level stops, finishing."""
        drafted: dict[int, int] = {}
        for chunk in scheduled.chunks:
            seq = self.seqs.get(chunk.seq_id)
            if seq is not None:
                seq.num_computed_tokens += chunk.num_new_tokens
            if chunk.draft_token_ids:
                drafted[chunk.seq_id] = len(chunk.draft_token_ids)
        if self.speculator is not None and not scheduled.is_empty:
            self.speculator.observe_step(scheduled.chunks, time.perf_counter() - self._scheduled_at)
        deltas = []
        prompt_lps = dict(result.prompt_logprobs)
        rows = zip(result.seq_ids, result.token_ids, result.logprobs)
        for seq_id, run in itertools.groupby(rows, key=lambda r: r[0]):
            seq = self.seqs.get(seq_id)
            if seq is None:  # aborted while the step ran
                continue
            _, tokens, logprobs = zip(*run)
            kept, reason, stop = 0, None, None
            while reason is None and kept < len(tokens):  # EOS / stop token / length inside a run cuts it
                seq.append_token(tokens[kept])
                reason, stop = seq.check_stop(tokens[kept], self.eos_token_ids, self.max_model_len)
                kept += 1
            proposed, accepted = drafted.get(seq_id, 0), len(tokens) - 1
            if proposed:
                self.speculator.record(seq.draft_stats, proposed, accepted)  # type: ignore[union-attr]
                seq.num_computed_tokens -= proposed - accepted  # the rejected drafts' positions
                if reason is None:
                    self.kv.roll_back(seq)
            if reason is not None:
                self._finish(seq, reason, stop)
            deltas.append(TokenDelta(
                seq.request_id, seq.index, tokens[:kept], None if logprobs[0] is None else logprobs[:kept],
                reason, stop, seq.num_cached_tokens, seq.num_preemptions, seq.first_scheduled_time,
                prompt_lps.get(seq_id), proposed, accepted if proposed else 0))
        return deltas

    # ----- internals -----------------------------------------------------------------------------
    def _make_room_for_newcomer(self) -> None:
        """Fairness (the module docstring): the longest-served sequence goes to the back of the queue."""
        victim = fair_swap_victim(self.waiting, self.running, self.kv,
                                  fair_share_tokens=self.fair_share_tokens, max_num_seqs=self.max_num_seqs,
                                  token_budget=self.max_num_batched_tokens)
        if victim is not None:
            self.running.remove(victim)
            self._preempt(victim, to_front=False)  # it queues behind the newcomers
            self.num_preemptions += 1
            self.num_swaps += 1

    def _preempt(self, seq: Sequence, to_front: bool = True) -> None:
        self.kv.free(seq)
        if self.speculator is not None: self.speculator.release(seq.seq_id)  # a draft model's cache blocks
        seq.num_computed_tokens, seq.status = 0, SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.in_runner = False
        (self.waiting.appendleft if to_front else self.waiting.append)(seq)

    def _finish(self, seq: Sequence, reason: str, stop: int | None) -> None:
        """Remove a finished or aborted sequence wherever it is and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if self.speculator is not None: self.speculator.release(seq.seq_id)  # a draft model's cache blocks
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop
        del self.seqs[seq.seq_id]
        self._finished_since_schedule.append(seq.seq_id)
        samples = self.requests[seq.request_id]
        if all(s.is_finished for s in samples):
            del self.requests[seq.request_id]

    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]


def _is_decode(seq: Sequence, num_new: int) -> bool:
    """One new token of a sequence that has generated before: a decode step, not prompt work."""
    return num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens

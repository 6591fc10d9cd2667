"""Fairness: swap the longest-served running sequence out for a newcomer (``Scheduler``'s module docstring).

When every batch slot is taken, or the KV cache has no room for its first chunk, and the head of the queue
is a newcomer (nothing generated yet), the running sequence that has generated the most (at least
``fair_share_tokens``) goes to the *back* of the queue, one per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardpass.engine.scheduling.scheduler import Scheduler


def make_room_for_newcomer(scheduler: Scheduler) -> None:
    """Fairness (see the module docstring): swap the longest-served sequence out for a newcomer."""
    if not scheduler.fair_share_tokens or not scheduler.waiting or not scheduler.running:
        return
    head = scheduler.waiting[0]
    first_chunk = min(head.num_tokens, scheduler.max_num_batched_tokens)
    slots_full = len(scheduler.running) >= scheduler.max_num_seqs
    if (head.output_token_ids or head.num_preemptions
            or not (slots_full or not scheduler.kv.can_fit(first_chunk))):
        return  # not a newcomer, or it has a slot and KV blocks as things are
    victim = max(scheduler.running, key=lambda s: len(s.output_token_ids))
    if len(victim.output_token_ids) < scheduler.fair_share_tokens:
        return
    if not slots_full and not scheduler.kv.can_fit(first_chunk, freeing=victim):
        return  # swapping it out would not make room: no point interrupting it
    scheduler.running.remove(victim)
    scheduler._preempt(victim)
    scheduler.waiting.popleft()  # _preempt put it first; it queues behind the newcomers instead
    scheduler.waiting.append(victim)
    scheduler.num_preemptions += 1
    scheduler.num_swaps += 1

"""Fairness: which running sequence to swap out for a newcomer (``Scheduler``'s module docstring).

When every batch slot is taken, or the KV cache has no room for its first chunk, and the head of the queue
is a newcomer (nothing generated yet), the running sequence that has generated the most (at least
``fair_share_tokens``) goes to the *back* of the queue, one per step. This module only chooses; the scheduler,
the one writer of its queues, moves it (``Scheduler._make_room_for_newcomer``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardpass.engine.scheduling.kv_cache import KVCacheManager
    from forwardpass.engine.scheduling.sequence import Sequence


def fair_swap_victim(waiting: Seq[Sequence], running: Seq[Sequence], kv: KVCacheManager, *,
                     fair_share_tokens: int, max_num_seqs: int, token_budget: int) -> Sequence | None:
    """The running sequence to swap out for the newcomer at the head of ``waiting``, or None (see the module
    docstring). ``token_budget``: the scheduler's ``max_num_batched_tokens``. Changes nothing."""
    if not fair_share_tokens or not waiting or not running:
        return None
    head = waiting[0]
    first_chunk = min(head.num_tokens, token_budget)
    slots_full = len(running) >= max_num_seqs
    if head.output_token_ids or head.num_preemptions or not (slots_full or not kv.can_fit(first_chunk)):
        return None  # not a newcomer, or it has a slot and KV blocks as things are
    victim = max(running, key=lambda s: len(s.output_token_ids))
    if len(victim.output_token_ids) < fair_share_tokens:
        return None
    if not slots_full and not kv.can_fit(first_chunk, freeing=victim):
        return None  # swapping it out would not make room: no point interrupting it
    return victim

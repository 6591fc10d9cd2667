"""What speculation did across the engine: the engine-wide acceptance estimate (a new request's prior)
and one step's totals for its record. A sequence's own ``DraftStats`` is the scheduler's
(``scheduling/speculation.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from forwardpass.engine.scheduling.speculation import DraftStats

if TYPE_CHECKING:
    from forwardpass.engine.scheduling.batch import ScheduledChunk

# The engine-wide estimates (the prior of a new request) forget more slowly: about the last 30 verifies.
_ENGINE_DECAY = 0.97


def engine_draft_stats() -> DraftStats:
    """The speculator's engine-wide estimates: every request's verifies, the prior of the next request."""
    return DraftStats(decay=_ENGINE_DECAY)


def step_acceptance(
    chunks: Iterable[ScheduledChunk], emitted_seq_ids: Iterable[int]
) -> tuple[int, int, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """One step's speculation: drafts verified, drafts accepted, the acceptance length (tokens emitted:
    accepted + 1) of each sequence that verified drafts and those drafts (``forwardpass explain`` shows
    them), from the step's chunks and the runner's tokens."""
    emitted = Counter(emitted_seq_ids)
    drafts = accepted = 0
    lengths, proposals = [], []
    for chunk in chunks:
        if chunk.draft_token_ids and emitted[chunk.seq_id]:
            drafts += len(chunk.draft_token_ids)
            accepted += emitted[chunk.seq_id] - 1
            lengths.append(emitted[chunk.seq_id])
            proposals.append(chunk.draft_token_ids)
    return drafts, accepted, tuple(lengths), tuple(proposals)

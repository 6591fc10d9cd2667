"""What speculation did for one sequence: totals for its output's metrics, an acceptance estimate for
the policy. Kept on the scheduler's ``Sequence`` (only the scheduler writes it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardpass.engine.scheduling.batch import ScheduledChunk

# Each verify's evidence weighs this much against the history: about the last 8 verifies decide.
_DECAY = 0.88
# The engine-wide estimates (the prior of a new request) forget more slowly: about the last 30 verifies.
_ENGINE_DECAY = 0.97
# The estimate a request starts from (as if it had seen 1 accepted of 2 tries): optimistic enough to try.
_PRIOR_ACCEPTED, _PRIOR_TRIALS = 1.0, 2.0


@dataclass
class DraftStats:
    """Counts, and a decayed per-token acceptance estimate per n-gram match length (0: all drafts, and a
    proposer without match lengths): a draft continuing a 4-token match is accepted far more often than one
    continuing a single recurring token, so the policy sizes each step's drafts by the match it has."""

    num_draft_tokens: int = 0  # proposed and verified (cumulative)
    num_accepted_tokens: int = 0  # of which the target agreed with
    num_verifies: int = 0  # decode steps that verified drafts
    steps_since_draft: int = 0  # decode steps without a proposal since the last one (re-probing)
    match_length: int = 0  # the n-gram length behind the drafts now being verified (0: none known)
    decay: float = _DECAY
    # match length -> [decayed accepted, decayed trials] of the per-token geometric model below
    counts: dict[int, list[float]] = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """Estimated probability that the target accepts the next draft token given it accepted the
        ones before (the geometric model of Leviathan et al.), over every draft."""
        return self.acceptance_for(0)

    def acceptance_for(self, length: int, prior: float | None = None) -> float:
        """The estimate for drafts behind an n-gram match of ``length`` tokens (0: every draft), starting from
        ``prior`` (default 0.5) with the weight of ``_PRIOR_TRIALS`` tries."""
        accepted, trials = self.counts.get(length, (0.0, 0.0))
        p = _PRIOR_ACCEPTED / _PRIOR_TRIALS if prior is None else prior
        return (accepted + p * _PRIOR_TRIALS) / (trials + _PRIOR_TRIALS)

    def record(self, proposed: int, accepted: int) -> None:
        """One verify: ``accepted`` of ``proposed`` drafts, accepted as a prefix."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_verifies += 1
        for length in {0, self.match_length}:
            c = self.counts.setdefault(length, [0.0, 0.0])
            # accepted successes, then one failure unless every draft was accepted
            c[0] = self.decay * c[0] + accepted
            c[1] = self.decay * c[1] + accepted + (accepted < proposed)


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

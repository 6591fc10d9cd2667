"""What speculation did for one sequence: totals for its output's metrics, an acceptance estimate for
the policy. Kept on the scheduler's ``Sequence`` (only the scheduler writes it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardpass.engine.scheduling.batch import ScheduledChunk

# Each verify's evidence weighs this much against the history: about the last 8 verifies decide.
_DECAY = 0.88
# The estimate a request starts from (as if it had seen 1 accepted of 2 tries): optimistic enough to try.
_PRIOR_ACCEPTED, _PRIOR_TRIALS = 1.0, 2.0


@dataclass
class DraftStats:
    num_draft_tokens: int = 0  # proposed and verified (cumulative)
    num_accepted_tokens: int = 0  # of which the target agreed with
    num_verifies: int = 0  # decode steps that verified drafts
    steps_since_draft: int = 0  # decode steps without a proposal since the last one (re-probing)
    _accepted: float = _PRIOR_ACCEPTED  # decayed counts of the per-token geometric model below
    _trials: float = _PRIOR_TRIALS

    @property
    def acceptance(self) -> float:
        """Estimated probability that the target accepts the next draft token given it accepted the
        ones before (the geometric model of Leviathan et al.)."""
        return self._accepted / self._trials

    def record(self, proposed: int, accepted: int) -> None:
        """One verify: ``accepted`` of ``proposed`` drafts, accepted as a prefix."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_verifies += 1
        # accepted successes, then one failure unless every draft was accepted
        self._accepted = _DECAY * self._accepted + accepted
        self._trials = _DECAY * self._trials + accepted + (accepted < proposed)


def step_acceptance(chunks: Iterable[ScheduledChunk],
                    emitted_seq_ids: Iterable[int]) -> tuple[int, int, tuple[int, ...]]:
    """One step's speculation: drafts verified, drafts accepted, and the acceptance length (tokens emitted:
    accepted + 1) of each sequence that verified drafts, from the step's chunks and the runner's tokens."""
    emitted = Counter(emitted_seq_ids)
    drafts = accepted = 0
    lengths = []
    for chunk in chunks:
        if chunk.draft_token_ids and emitted[chunk.seq_id]:
            drafts += len(chunk.draft_token_ids)
            accepted += emitted[chunk.seq_id] - 1
            lengths.append(emitted[chunk.seq_id])
    return drafts, accepted, tuple(lengths)

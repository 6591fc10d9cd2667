"""What the scheduler knows of speculative decoding: the plug-in it asks for drafts (:class:`Speculation`,
implemented by ``engine/speculative/policy.py``'s ``Speculator``, wired in by ``engine/builder.py``) and
the per-sequence record of what speculation did (:class:`DraftStats`, kept on the scheduler's ``Sequence``;
only the scheduler writes it, through ``Speculation.record``). Defined here, below ``speculative/``, so the
scheduler imports nothing of it."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from forwardpass.engine.scheduling.batch import ScheduledChunk
    from forwardpass.engine.scheduling.sequence import Sequence

# Each verify's evidence weighs this much against the history: about the last 8 verifies decide.
_DECAY = 0.88
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


class Speculation(Protocol):
    """The scheduler's plug-in (its constructor's ``speculator``): drafts for one sequence's step, and what
    came of them."""

    def drafts_for_step(self, seq: Sequence, num_new: int, budget: int, num_running: int,
                        max_model_len: int) -> tuple[int, ...]:
        """Drafts to verify with this step of ``seq`` (often none), within the token budget and its limits."""

    def observe_step(self, chunks: Seq[ScheduledChunk], seconds: float) -> None:
        """A step's chunks and its time, for the cost model."""

    def record(self, stats: DraftStats, proposed: int, accepted: int) -> None:
        """One verify of a sequence: ``accepted`` of its ``proposed`` drafts."""

    def release(self, seq_id: int) -> None:
        """The scheduler freed ``seq_id`` (finished or preempted)."""

"""What speculation did for one sequence: totals for its output's metrics, an acceptance estimate for
the policy. Kept on the scheduler's ``Sequence`` (only the scheduler writes it).

The estimate is a survival curve, not one acceptance rate: ``S(j)``, the probability that the target accepts
at least ``j`` drafts, from the decayed count of verifies that reached draft ``j`` (accepted the ``j - 1``
before it) and of those that accepted it (a Kaplan-Meier estimate: a verify of ``k`` drafts says nothing of
draft ``k + 1``). A single per-token rate (Leviathan et al.'s geometric model) fits a draft model, whose
drafts fail independently, but not copied text: behind a short n-gram match the first draft is usually
rejected (the text did not go on as before), yet once it is accepted the copy tends to run for many tokens
(SmolLM2's copy prompts: behind a 3-token match 55% of first drafts fail, and the accepted ones run 7 tokens
on average). The geometric model then sizes the drafts at one or two, where fourteen pay.

Curves are kept per *context*: for ngram drafts the length of the copy run behind them (how far back the
sequence's end agrees with the earlier text it continues, in buckets ``run_bucket``), 0 for other proposers.
"""

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
# A draft position never reached starts at this acceptance (the position before it, where known), with the
# weight of this many verifies: optimistic enough to try.
_PRIOR_ACCEPTANCE, _PRIOR_TRIALS = 0.5, 2.0
# The copy-run lengths whose curves are kept apart: 1, 2, 3, 4-7, 8-15, 16 and more tokens.
_RUN_BUCKETS = (16, 8, 4, 3, 2, 1)


def run_bucket(run: int) -> int:
    """The context of drafts continuing a copy run of ``run`` tokens (0: no run known)."""
    return next((b for b in _RUN_BUCKETS if run >= b), 0)


@dataclass
class DraftStats:
    """Counts, and per context the decayed ``[reached, accepted]`` of each draft position (see the module
    docstring)."""

    num_draft_tokens: int = 0  # proposed and verified (cumulative)
    num_accepted_tokens: int = 0  # of which the target agreed with
    num_verifies: int = 0  # decode steps that verified drafts
    steps_since_draft: int = 0  # decode steps without a proposal since the last one (re-probing)
    context: int = 0  # the context of the drafts now being verified (run_bucket; 0: none known)
    decay: float = _DECAY
    # context -> per draft position j (0-based): [decayed verifies that reached it, of which accepted it]
    counts: dict[int, list[list[float]]] = field(default_factory=dict)

    def acceptance(self, context: int, k: int, prior: list[float] | None = None) -> list[float]:
        """``p[j]``: the probability that draft ``j + 1`` is accepted given the ``j`` before it were, for
        ``j < k``; a position with little evidence leans on ``prior[j]`` (default: the position before it,
        the first ``_PRIOR_ACCEPTANCE``)."""
        rows = self.counts.get(context, [])
        out: list[float] = []
        for j in range(k):
            base = prior[j] if prior is not None else out[-1] if out else _PRIOR_ACCEPTANCE
            reached, accepted = rows[j] if j < len(rows) else (0.0, 0.0)
            out.append((accepted + base * _PRIOR_TRIALS) / (reached + _PRIOR_TRIALS))
        return out

    def record(self, proposed: int, accepted: int) -> None:
        """One verify in ``self.context``: ``accepted`` of ``proposed`` drafts, accepted as a prefix."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_verifies += 1
        rows = self.counts.setdefault(self.context, [])
        rows.extend([0.0, 0.0] for _ in range(proposed - len(rows)))
        for j, row in enumerate(rows):
            row[0] *= self.decay
            row[1] *= self.decay
            if j <= accepted and j < proposed:  # reached: the drafts before it were accepted
                row[0] += 1.0
                row[1] += j < accepted


def expected_tokens(acceptance: Iterable[float]) -> list[float]:
    """``E[k]`` for ``k = 0, 1, ...``: tokens a verify of ``k`` drafts emits on average (1 + the expected
    accepted drafts: the sum of the survival curve), from the per-position ``acceptance``."""
    out, survive = [1.0], 1.0
    for p in acceptance:
        survive *= p
        out.append(out[-1] + survive)
    return out


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

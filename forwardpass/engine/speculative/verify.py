"""The runner's acceptance rule: which drafts a verify step keeps, and the token that follows them.

:class:`SpeculativeVerifier` is the runner's ``DraftVerifier`` (``worker/sample_step.py``, whose round loop
asks it only for sequences that carry drafts; ``engine/builder.py`` hands it to the runner).

A speculating sequence's chunk is ``[last token, d_1 .. d_k]``, so the forward pass gives the target's
logits at ``k + 1`` positions: position ``j`` predicts the token after ``d_j`` (after the last token for
``j = 0``). Round ``j`` samples position ``j`` exactly as a decode step would (the same sampler, every
processor, penalties and the grammar seeing the tokens accepted so far, the sequence's own generator);
the draft ``d_{j+1}`` is accepted iff the sampled token equals it, and the first token that differs (or
the token after ``d_k`` when all are accepted, the "bonus") ends the run.

Why this is the rejection-sampling rule (Leviathan et al. 2023, Chen et al. 2023): a prompt-lookup draft
is one token, a point mass ``q = δ(d)``, so the rule "accept ``d`` with probability ``min(1, p(d)/q(d)) =
p(d)``, else draw from ``norm(max(0, p - q))`` = ``p`` with ``d`` removed" is the same distribution as
"draw ``x ~ p``; accept if ``x == d``, else emit ``x``": ``P(accept) = p(d)`` and ``x | x != d ~ p`` without
``d``. Drawing it this way also consumes a seeded request's generator exactly as decoding without
speculation does (one draw per emitted token, none for positions after a rejection), so a seeded request
gives the same tokens with and without speculation, not just the same distribution. Greedy is the same
rule with ``p`` the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from forwardpass.engine.speculative.draft_verify import sample_round
from forwardpass.engine.worker.isolation import Sampled
from forwardpass.engine.worker.sample_step import SampleTarget
from forwardpass.sampling.argmax import greedy_tokens
from forwardpass.sampling.sampler import Sampler, SamplingRow, rows_logprobs


class SpeculativeVerifier:
    """The runner's ``DraftVerifier``: the rule of the module docstring (the functions below, looked up when
    called)."""

    def verify_at_once(self, logits: torch.Tensor, target: SampleTarget) -> str | None:
        return _verify_at_once(logits, target)

    def sample_round(self, sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                     eos_token_ids: Sequence[int], drafts: Sequence[Any], j: int) -> list[Sampled | str]:
        # drafts a draft model sampled from its q: the full rejection rule (draft_verify.py); others: sampled
        return sample_round(sampler, logits, rows, eos_token_ids, drafts, j)

    def accepts(self, sampled: int, draft: int) -> bool:
        return accepts(sampled, draft)


def accepts(sampled: int, draft: int) -> bool:
    """The acceptance rule for a one-token draft (see the module docstring): the draw agrees with it."""
    return sampled == draft


def _verify_at_once(logits: torch.Tensor, t: SampleTarget) -> str | None:
    """All rounds of a target whose every round is the argmax of its raw logits (``Sampler.plain_argmax``),
    in one pass: the argmax of its ``k + 1`` rows, its drafts kept up to the first that differs, and the
    emitted rows' logprobs (the caller takes the prompt logprobs). The round loop would give the same tokens
    and logprobs (each row's argmax and logprobs are computed from that row alone either way,
    ``tests/test_speculative_fast_path.py``) for ~0.3 ms of per-round overhead each on a 49k vocabulary.
    Returns why the target's sampling failed, or None."""
    try:
        rows = logits[t.row : t.row + len(t.drafts) + 1]
        tokens = greedy_tokens(rows.float())  # as Sampler._choose takes an all-greedy batch's tokens
        ids = tokens.tolist()
        kept = next((j for j, d in enumerate(t.drafts) if ids[j] != d), len(t.drafts))
        row = SamplingRow(t.seq.params, t.seq.prompt, t.seq.output, t.seq.generator)
        lps = rows_logprobs(rows[: kept + 1], tokens[: kept + 1], [row] * (kept + 1))
    except Exception as exc:  # noqa: BLE001 - fails this request only, as the round loop's sample_isolated does
        return f"sampling failed for this request: {type(exc).__name__}: {exc}"
    for token, lp in zip(ids[: kept + 1], lps):
        t.seq.output.append(token)
        t.emitted.append((token, lp))
    return None

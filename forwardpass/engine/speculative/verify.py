"""The runner's acceptance rule: which drafts a verify step keeps, and the token that follows them.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from forwardpass.engine.speculative.draft_verify import sample_round
from forwardpass.engine.worker.prompt_logprobs import take_prompt_logprobs
from forwardpass.sampling.argmax import greedy_tokens
from forwardpass.sampling.sampler import Sampler, SamplingRow, TokenLogprobs, rows_logprobs
from forwardpass.structured.backend import GrammarBackend


@dataclass
class SampleTarget:
    """A sequence that samples this step: its logits start at ``row``, one row per draft plus one."""

    seq_id: int
    seq: Any  # the runner's mirror (model_runner._RunnerSequence): params, prompt, output, generator, grammar
    row: int
    drafts: tuple[int, ...] = ()
    emitted: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)


@dataclass
class SampledStep:
    """What the step emitted: a sequence's tokens consecutive, in the targets' order."""

    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, tuple[TokenLogprobs | None, ...]]] = field(default_factory=list)


def accepts(sampled: int, draft: int) -> bool:
    """The acceptance rule for a one-token draft (see the module docstring): the draw agrees with it."""
    return sampled == draft


def sample_and_verify(sampler: Sampler, grammars: GrammarBackend | None, eos_token_ids: Sequence[int],
                      logits: torch.Tensor, targets: list[SampleTarget]) -> SampledStep:
    """Sample every target's next token, and verify its drafts round by round (one row each per round)."""
    out = SampledStep()
    failed: dict[int, str] = {}
    live = []
    for t in targets:
        if t.drafts and Sampler.plain_argmax(t.seq.params):
            if (why := _verify_at_once(logits, t, out)) is not None:
                failed[t.seq_id] = why
        else:
            live.append(t)
    j = 0
    while live:
        rows = [SamplingRow(t.seq.params, t.seq.prompt, t.seq.output, t.seq.generator) for t in live]
        bad: dict[int, str] = {}  # rows whose grammar failed: their requests fail, the batch goes on
        if grammars is not None and any(t.seq.params.structured_outputs for t in live):
            states, masks, bad = grammars.prepare(
                [(t.seq.params.structured_outputs, t.seq.grammar, t.seq.output) for t in live])
            for t, state, mask, row in zip(live, states, masks, rows):
                t.seq.grammar, row.token_bitmask = state, mask
        index = torch.tensor([t.row + j for t in live], device=logits.device)
        # drafts a draft model sampled from its q: the full rejection rule (draft_verify.py); others: as above
        results = sample_round(sampler, logits.index_select(0, index), rows, eos_token_ids,
                               [t.drafts for t in live], j)
        going_on = []
        for i, (t, r) in enumerate(zip(live, results)):
            if i in bad or isinstance(r, str):  # this sequence's own sampling failed: only its request fails
                failed[t.seq_id] = bad.get(i) or str(r)
                continue
            token = r[0]
            t.seq.output.append(token)
            t.emitted.append(r)
            if j == 0 and (lps := take_prompt_logprobs(t.seq)) is not None:
                out.prompt_logprobs.append((t.seq_id, lps))
            if j < len(t.drafts) and accepts(token, t.drafts[j]):
                going_on.append(t)
        live, j = going_on, j + 1
    for t in targets:
        if t.seq_id in failed:
            out.failed.append((t.seq_id, failed[t.seq_id]))
            continue
        for token, lp in t.emitted:
            out.seq_ids.append(t.seq_id)
            out.token_ids.append(token)
            out.logprobs.append(lp)
    return out


def _verify_at_once(logits: torch.Tensor, t: SampleTarget, out: SampledStep) -> str | None:
    """All rounds of a target whose every round is the argmax of its raw logits (``Sampler.plain_argmax``),
    in one pass: the argmax of its ``k + 1`` rows, its drafts kept up to the first that differs, and the
    emitted rows' logprobs. The round loop would give the same tokens and logprobs (each row's argmax and
    logprobs are computed from that row alone either way, ``tests/test_speculative_fast_path.py``) for ~0.3 ms
    of per-round overhead each on a 49k vocabulary. Returns why the target's sampling failed, or None."""
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
    if (prompt_lps := take_prompt_logprobs(t.seq)) is not None:
        out.prompt_logprobs.append((t.seq_id, prompt_lps))
    return None

"""The step's sampling: each sequence whose known tokens are all computed draws its next token.

A plain decode or prefill step samples one row per sequence, once: the sampler over the batch
(``isolation.sample_isolated``: a row whose own sampling fails fails only its request), with each row's
grammar mask, and the first sampled token carries the sequence's prompt logprobs (``prompt_logprobs.py``).

A sequence that carries drafts (speculative decoding) has one row per draft plus one, sampled in rounds:
round ``j`` draws position ``j`` of every sequence still going, exactly as a decode step would, and a
sequence goes on while its draw is accepted as its draft ``j``. How a round draws a drafted row and what
counts as accepted is the :class:`DraftVerifier`'s (``engine/speculative/verify.py``, handed to the runner
by ``engine/builder.py``); a step without drafts never asks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from forwardpass.engine.worker.isolation import Sampled, sample_isolated
from forwardpass.engine.worker.prompt_logprobs import take_prompt_logprobs
from forwardpass.sampling.sampler import Sampler, SamplingRow, TokenLogprobs
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


class DraftVerifier(Protocol):
    """Speculative decoding's acceptance rule, asked only for sequences that carry drafts."""

    def verify_at_once(self, logits: torch.Tensor, target: SampleTarget) -> str | None:
        """Every round of ``target`` at once, for a row that is the argmax of its raw logits at every position
        (``Sampler.plain_argmax``): its emitted tokens appended to ``target.emitted`` and its mirror's output;
        why its sampling failed, or None."""

    def sample_round(self, sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                     eos_token_ids: Sequence[int], drafts: Sequence[Any], j: int) -> list[Sampled | str]:
        """Round ``j``'s draw for each row (its logits row ``j`` of its target), or why the row failed."""

    def accepts(self, sampled: int, draft: int) -> bool:
        """Whether the round's draw keeps ``draft`` (the sequence goes on to the next round)."""


def sample_step(sampler: Sampler, grammars: GrammarBackend | None, eos_token_ids: Sequence[int],
                logits: torch.Tensor, targets: list[SampleTarget],
                verifier: DraftVerifier | None = None) -> SampledStep:
    """Sample every target's next token, and verify its drafts round by round (one row each per round)."""
    if verifier is None and any(t.drafts for t in targets):
        raise RuntimeError("a step carries draft tokens but the runner has no DraftVerifier")
    out = SampledStep()
    failed: dict[int, str] = {}
    live = []
    for t in targets:
        if t.drafts and Sampler.plain_argmax(t.seq.params):
            if (why := verifier.verify_at_once(logits, t)) is not None:  # type: ignore[union-attr]
                failed[t.seq_id] = why
            elif (lps := take_prompt_logprobs(t.seq)) is not None:
                out.prompt_logprobs.append((t.seq_id, lps))
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
        drafts = [t.drafts for t in live]
        chosen = logits.index_select(0, index)
        if verifier is not None and any(j < len(d) for d in drafts):  # a drafted row's draw is the verifier's
            results = verifier.sample_round(sampler, chosen, rows, eos_token_ids, drafts, j)
        else:
            results = sample_isolated(sampler, chosen, rows, eos_token_ids)
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
            if j < len(t.drafts) and verifier.accepts(token, t.drafts[j]):  # type: ignore[union-attr]
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

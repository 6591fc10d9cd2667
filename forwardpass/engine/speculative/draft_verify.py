"""The full rejection-sampling rule, for drafts drawn from a draft model's distribution ``q``.

``verify.py`` samples each verify round with the normal sampler and accepts a draft iff the draw equals it:
exact for any draft, but it accepts ``d`` only with probability ``p(d)``. A draft model that sampled
``d ~ q`` can do better (Leviathan et al. 2023, Chen et al. 2023): accept ``d`` with probability
``min(1, p(d) / q(d))``, else emit a token drawn from ``norm(max(0, p - q))``. The emitted token follows
``p`` exactly, and a draft is accepted with probability ``sum_x min(p(x), q(x))`` (1 when ``q = p``).

``p`` is the target's distribution as the sampler would draw from it: the processors first (penalties,
grammar mask, logit bias, ...: ``Sampler.apply_processors``, over the tokens accepted so far), then the
temperature. Requests with top-k / top-p / min-p filters never reach this rule: the draft proposes its argmax
for them (``draft.samples_from_q``), which ``verify.py``'s rule handles. The residual never contains ``d``
(a rejection needs ``p(d) < q(d)``), so "the emitted token equals the draft" still means "accepted", and the
round loop in ``verify.py`` is unchanged. Logprobs are of the raw distribution, as the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from forwardpass.engine.worker.isolation import Sampled, sample_isolated
from forwardpass.sampling.sampler import Sampler, SamplingRow, rows_logprobs


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft's replacement is drawn from: ``max(0, p - q)`` (normalised by the caller)."""
    return (p - q).clamp_min_(0.0)


def reject_or_accept(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator | None) -> int:
    """One round of the rule: ``draft`` if accepted, else a draw from the normalised residual."""
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    qd = float(q[draft])
    if u * qd < float(p[draft]):  # u < p(d) / q(d), without dividing
        return draft
    r = residual(p, q)
    total = float(r.sum())
    if not total > 0.0:  # p == q up to rounding: a rejection was (almost) impossible; p itself is exact
        r, total = p, float(p.sum())
    return int(torch.multinomial(r / total, 1, generator=generator))


def target_probs(sampler: Sampler, logits: torch.Tensor, row: SamplingRow,
                 eos_token_ids: Sequence[int]) -> torch.Tensor:
    """The target's distribution at one position (float64), as the sampler would draw from it."""
    x = sampler.apply_processors(logits[None], [row], list(eos_token_ids))[0]
    return torch.softmax(x.double() / row.params.temperature, dim=-1)


def sample_round(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                 eos_token_ids: Sequence[int], drafts: Sequence[Any], j: int) -> list[Sampled | str]:
    """Round ``j`` of the verify loop: rows whose draft ``j`` came with its ``q`` take the full rule, the
    others the sampler (``sample_isolated``). One ``(token, logprobs)`` per row, or why the row's sampling
    failed."""
    full = [i for i, d in enumerate(drafts)
            if j < len(d) and getattr(d, "probs", None) is not None and not rows[i].params.greedy]
    if not full:
        return sample_isolated(sampler, logits, rows, eos_token_ids)
    taken = set(full)
    rest = [i for i in range(len(rows)) if i not in taken]
    results: list[Sampled | str] = [""] * len(rows)
    if rest:
        index = torch.tensor(rest, device=logits.device)
        for i, r in zip(rest, sample_isolated(sampler, logits.index_select(0, index), [rows[i] for i in rest],
                                              eos_token_ids)):
            results[i] = r
    for i in full:
        row = rows[i]
        try:
            p = target_probs(sampler, logits[i], row, eos_token_ids)
            q = drafts[i].probs[j].to(device=p.device, dtype=torch.float64)
            token = reject_or_accept(p, q, drafts[i][j], row.generator)
            lp = rows_logprobs(logits[i : i + 1], torch.tensor([token], device=logits.device), [row])[0]
            results[i] = (token, lp)
        except Exception as exc:  # noqa: BLE001 - fails this row's request only, as sample_isolated does
            results[i] = f"sampling failed for this request: {type(exc).__name__}: {exc}"
    return results
